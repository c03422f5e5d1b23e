"""What a plan's matmuls would cost on a named GPU, *modelled*: each layer's matmul FLOPs of a step divided by the
published dense peak throughput of its format there. A floor (real GEMMs reach a share of peak, and quantising adds
work), used where the device cannot run the formats natively; every figure it gives says *modelled*."""

from __future__ import annotations

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA's datasheets, dense (no 2:4 sparsity). H100 SXM5: FP32 67, BF16/FP16 989, FP8 1979; Hopper has no
    # MXFP8/NVFP4 tensor cores (torchao runs them on sm100 only): counted at BF16's rate, as a dequantised GEMM.
    "H100": {"fp32": 67.0, "bf16": 989.0, "fp8": 1979.0, "mxfp8": 989.0, "nvfp4": 989.0},
    # HGX B200, per GPU: FP32 75, BF16/FP16 2250, FP8 and MXFP8 4500, NVFP4 9000.
    "B200": {"fp32": 75.0, "bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "nvfp4": 9000.0},
}
"""Published dense peak TFLOP/s per GEMM format class."""
GPUS = tuple(PEAK_TFLOPS)


def rate_class(format_name: str) -> str:
    """The throughput class of a plan format: fp32, bf16 (bf16, fp16), fp8 (tensorwise, rowwise, blockwise), mxfp8,
    nvfp4."""
    if format_name in ("bf16", "fp16"):
        return "bf16"
    if format_name.startswith("nvfp4"):
        return "nvfp4"
    if format_name.startswith("mxfp8"):
        return "mxfp8"
    if format_name.startswith("fp8"):
        return "fp8"
    return "fp32"


def modelled_gemm_ms(flops: dict[str, float], formats: dict[str, str], gpu: str, other: str = "bf16") -> float:
    """Modelled GEMM time of one step in ms: Σ FLOPs / peak of each layer's format on `gpu` (layers `formats` does
    not name, and the matmuls that are no Linear's, at `other`'s rate)."""
    peaks = PEAK_TFLOPS[gpu]
    return sum(n / (peaks[rate_class(formats.get(name, other))] * 1e12) for name, n in flops.items()) * 1e3


def flop_shares(flops: dict[str, float], formats: dict[str, str], other: str = "bf16") -> dict[str, float]:
    """Share of the step's matmul FLOPs in each format."""
    total = sum(flops.values()) or 1.0
    shares: dict[str, float] = {}
    for name, n in flops.items():
        key = formats.get(name, other)
        shares[key] = shares.get(key, 0.0) + n / total
    return dict(sorted(shares.items(), key=lambda item: -item[1]))
