"""Block-scaled number formats quantised and dequantised in plain torch: MXFP8 (e4m3 elements, an e8m0 power-of-two
scale per 32), NVFP4 (e2m1 elements, an e4m3 scale per 16 (1x16 or 16x16), a per-tensor fp32 scale; optional
stochastic rounding; the 16-point random Hadamard transform) and blockwise FP8 (e4m3, fp32 scales per 1x128 or
128x128, as DeepSeek-V3). Written once to equal torchao's own quantisers bit for bit (tests/test_block_formats.py
checks scales and values), so an emulated lane and the layer numerics compute the format's numbers, not an
approximation of them. torch only: torchao is never imported here (it needs a GPU for most of these paths)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
"""The largest float8 e4m3fn value."""
E4M3_TINY = 2.0**-6
"""The smallest normal e4m3fn value: NVFP4's block scales are clamped up to it (torchao's E4M3_EPS)."""
E2M1_MAX = 6.0
"""The largest fp4 e2m1 value."""
E8M0_BIAS = 127
"""e8m0's exponent bias: a stored byte b means 2^(b - 127)."""
MX_E4M3_MAX_POW2 = 8
"""floor(log2(448)): MXFP8's FLOOR scale is 2^(floor(log2 amax) - 8)."""
FP8_BLOCKWISE_EPS = 1e-12
"""The amax floor of blockwise FP8's scale (torchao's blockwise_fp8_training EPS)."""

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCKWISE_BLOCK = 128
SCALINGS = ("rceil", "floor")
"""MXFP8's ways of choosing a block's power-of-two scale (torchao's ScaleCalculationMode): RCEIL rounds amax/448 up
to a power of two (cuBLAS's, the recipe torchao trains with); FLOOR takes 2^(floor(log2 amax) - 8) (the OCP spec's
minimal one; the block's largest values can clip at 448)."""

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Every non-negative e2m1 value."""


@dataclass(frozen=True, slots=True)
class Blocked:
    """One tensor in a block-scaled format: what the GEMM would read (elements and scales) and what they mean
    (`values`, the dequantised tensor)."""

    values: torch.Tensor
    """The dequantised tensor (fp32, the input's shape): elements times their block's scale."""
    elements: torch.Tensor
    """The element values before scaling (fp32, on the element format's grid; the input's shape)."""
    scales: torch.Tensor
    """Each block's decoded fp32 scale (NVFP4: the per-tensor scale times the e4m3 block scale), one per block:
    shape (*leading, rows_of_blocks, blocks) as laid out over the input."""
    stored_scales: torch.Tensor
    """The block scales as the format stores them: e8m0 (MXFP8), e4m3 (NVFP4), fp32 reciprocals (blockwise FP8)."""
    tensor_scale: torch.Tensor | None
    """NVFP4's per-tensor fp32 scale (amax / (448 * 6)); None for the others."""
    saturated: torch.Tensor
    """Per block: the scale the block needed was above the largest the format stores, or (MXFP8 FLOOR) its largest
    element clipped at the element format's maximum."""
    underflowed: torch.Tensor
    """Per block: a block with non-zero values needed a scale below the smallest the format stores (its small values
    then lose bits or flush to zero)."""


def block_view(x: torch.Tensor, block: int, tile_2d: bool = False) -> torch.Tensor:
    """`x` grouped as a format groups it: (..., blocks, values of one block), blocks of `block` along the last dim
    or (tile_2d) square tiles of a 2-D tensor; what shares a scale is in one row."""
    return _tiles(x, block) if tile_2d else _blocks(x, block)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) is not a multiple of the block ({block})")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """(rows, cols) -> (rows/tile, cols/tile, tile*tile): each square tile's values on the last dim."""
    if x.dim() != 2 or x.shape[0] % tile or x.shape[1] % tile:
        raise ValueError(f"a {tile}x{tile}-tiled tensor must be 2-D with both dims multiples of {tile}; got "
                         f"{tuple(x.shape)}")
    rows, cols = x.shape
    return x.reshape(rows // tile, tile, cols // tile, tile).permute(0, 2, 1, 3).reshape(rows // tile, cols // tile,
                                                                                        tile * tile)


def _untile(x: torch.Tensor, tile: int, rows: int, cols: int) -> torch.Tensor:
    return x.reshape(rows // tile, cols // tile, tile, tile).permute(0, 2, 1, 3).reshape(rows, cols)


# MXFP8 ------------------------------------------------------------------------------------------------------------

def quantize_mxfp8(x: torch.Tensor, scaling: str = "rceil", block: int = MXFP8_BLOCK) -> Blocked:
    """MXFP8 along the last dim: e4m3 elements, one e8m0 (power-of-two) scale per `block` values, chosen by
    `scaling` (SCALINGS); torchao's `to_mx` + `to_dtype`, op for op."""
    if scaling not in SCALINGS:
        raise ValueError(f"unknown MXFP8 scaling {scaling!r}; choose from {', '.join(SCALINGS)}")
    data = _blocks(x, block).to(torch.float32)
    max_abs = data.abs().amax(-1, keepdim=True)
    if scaling == "rceil":
        descale = max_abs / E4M3_MAX
        needed = torch.ceil(torch.log2(descale))
        exponent = torch.clamp(needed, min=-E8M0_BIAS, max=E8M0_BIAS) + E8M0_BIAS
        exponent = torch.where(torch.isnan(descale), 255.0, torch.where(torch.isinf(descale), 254.0, exponent))
        exponent = exponent.to(torch.uint8)
        reciprocal = torch.where(exponent == 255, descale, torch.where(
            exponent == 254, 2.0**-127,
            torch.where(exponent == 0, 1.0, torch.exp2(E8M0_BIAS - exponent.to(torch.float32)))))
        scaled = torch.clamp(data * reciprocal, min=-E4M3_MAX, max=E4M3_MAX)
        saturated = needed > E8M0_BIAS
        underflowed = (needed < -E8M0_BIAS) & (max_abs > 0)
    else:
        extracted = (torch.bitwise_right_shift(max_abs.view(torch.int32), 23) & 0xFF) - E8M0_BIAS
        unbiased = extracted - MX_E4M3_MAX_POW2
        exponent = (torch.clamp(unbiased, min=-E8M0_BIAS, max=E8M0_BIAS + 1) + E8M0_BIAS).to(torch.uint8)
        exponent = torch.where(torch.isnan(max_abs), 255, exponent).to(torch.uint8)
        scale = torch.bitwise_left_shift(exponent.to(torch.int32), 23).view(torch.float32)
        scale = torch.clamp(scale, min=2.0**-126)
        unclipped = data / scale
        scaled = torch.clamp(unclipped, min=-E4M3_MAX, max=E4M3_MAX)
        saturated = (unbiased > E8M0_BIAS) | (unclipped.abs().amax(-1, keepdim=True) > E4M3_MAX)
        underflowed = (unbiased < -E8M0_BIAS) & (max_abs > 0)
    elements = scaled.to(torch.float8_e4m3fn).to(torch.float32)
    decoded = _e8m0_value(exponent)
    values = (elements * decoded).reshape(x.shape)
    return Blocked(values=values, elements=elements.reshape(x.shape), scales=decoded.squeeze(-1),
                   stored_scales=exponent.squeeze(-1), tensor_scale=None, saturated=saturated.squeeze(-1),
                   underflowed=underflowed.squeeze(-1))


def _e8m0_value(exponent: torch.Tensor) -> torch.Tensor:
    """A stored e8m0 byte as fp32 (255 is NaN), as torchao's get_fp_scale."""
    power = torch.pow(torch.full_like(exponent, 2.0, dtype=torch.float32), exponent.to(torch.int16) - E8M0_BIAS)
    return torch.where(exponent != 255, power, float("nan"))


# NVFP4 ------------------------------------------------------------------------------------------------------------

def round_e2m1(x: torch.Tensor, stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 values already within [-6, 6] onto the e2m1 grid (E2M1_GRID): round half to even (torchao's
    f32_to_f4_unpacked, the hardware's cvt.rn), or stochastically (up with probability equal to the distance from
    the lower neighbour over the gap: cvt.rs, unbiased on average). The grid's step is 0.5 below 2, 1 below 4 and 2
    up to 6, and torch.round rounds half to even, so one division by the step rounds as the format does (a tie at
    a step's edge, 1.75 or 3.5, goes up to the even neighbour as it must). The sign is kept, zero included."""
    magnitude = x.abs()
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    steps = magnitude / step
    if stochastic:
        lower = torch.floor(steps)
        draw = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        rounded = (lower + (draw < steps - lower).to(torch.float32)) * step
    else:
        rounded = torch.round(steps) * step
    return torch.copysign(rounded, x)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor fp32 scale from the tensor's amax (torchao's per_tensor_amax_to_scale): the block scales
    then use e4m3's whole range. An all-zero tensor gets 1 (torchao's would divide by zero)."""
    scale = amax.to(torch.float32) / (E4M3_MAX * E2M1_MAX)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_nvfp4(x: torch.Tensor, *, tile_2d: bool = False, stochastic: bool = False, per_tensor: bool = True,
                   generator: torch.Generator | None = None) -> Blocked:
    """NVFP4: e2m1 elements with an e4m3 scale per 16 values along the last dim (or per 16x16 tile of a 2-D
    tensor: `tile_2d`, the recipe's weights, so a weight and its transpose quantise alike) and, with `per_tensor`,
    a per-tensor fp32 scale; torchao's nvfp4_quantize + NVFP4Tensor.dequantize, op for op, plus the recipe's
    stochastic rounding (`stochastic`, drawing from `generator` or torch's default)."""
    data = (_tiles(x, NVFP4_BLOCK) if tile_2d else _blocks(x, NVFP4_BLOCK)).to(torch.float32)
    max_abs = data.abs().amax(-1)
    block_scale = max_abs / E2M1_MAX
    if per_tensor:
        tensor_scale = nvfp4_tensor_scale(x.abs().amax())
        needed = block_scale / tensor_scale
        stored = torch.clamp(needed, min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn)
        reciprocal = (1.0 / tensor_scale) / stored.to(torch.float32)
        decoded = tensor_scale * stored.to(torch.float32)
    else:
        tensor_scale = None
        needed = block_scale
        stored = torch.clamp(needed, min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn)
        reciprocal = 1.0 / stored.to(torch.float32)
        decoded = stored.to(torch.float32)
    scaled = torch.clamp(data * reciprocal.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
    elements = round_e2m1(scaled, stochastic=stochastic, generator=generator)
    values = elements * decoded.unsqueeze(-1)
    if tile_2d:
        rows, cols = x.shape
        values, elements = _untile(values, NVFP4_BLOCK, rows, cols), _untile(elements, NVFP4_BLOCK, rows, cols)
    else:
        values, elements = values.reshape(x.shape), elements.reshape(x.shape)
    return Blocked(values=values, elements=elements, scales=decoded, stored_scales=stored, tensor_scale=tensor_scale,
                   saturated=needed > E4M3_MAX, underflowed=(needed < E4M3_TINY) & (max_abs > 0))


@functools.lru_cache(maxsize=1)
def _hadamard16() -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix over sqrt(16): orthonormal."""
    h = torch.ones(1, 1)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(NVFP4_BLOCK)


def random_signs(generator: torch.Generator | None = None) -> torch.Tensor:
    """16 random signs (+-1) for a random Hadamard transform (one draw per layer, as torchao's NVFP4Linear)."""
    draw = torch.rand(NVFP4_BLOCK, generator=generator)
    return torch.where(draw >= 0.5, 1.0, -1.0)


def rht_matrix(signs: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """diag(signs) @ H16 / 4 (torchao's get_rht_matrix): orthonormal, so (a R)(b R)^T = a b^T exactly in real
    arithmetic while each 16 values' outliers spread over the 16."""
    return (signs.to(torch.float32)[:, None] * _hadamard16()).to(device)


def hadamard_transform(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The random Hadamard transform over each 16 consecutive values of the last dim (fp32 out): what NVFP4's recipe
    applies to both inputs of the weight-gradient GEMM along their shared (token) dim."""
    blocks = _blocks(x.to(torch.float32), NVFP4_BLOCK)
    return (blocks @ rht_matrix(signs, x.device)).reshape(x.shape)


# Blockwise FP8 ----------------------------------------------------------------------------------------------------

def quantize_fp8_blockwise(x: torch.Tensor, *, tile_2d: bool = False, block: int = FP8_BLOCKWISE_BLOCK) -> Blocked:
    """Blockwise FP8 (DeepSeek-V3): e4m3 elements with an fp32 scale per 1x`block` along the last dim (activations
    and gradients) or per `block`x`block` tile of a 2-D tensor (`tile_2d`: weights); torchao's
    torch_blockwise_scale_act_quant_lhs / torch_blockwise_scale_weight_quant, op for op. `stored_scales` are
    the reciprocals torchao returns (what multiplies the elements back)."""
    data = _tiles(x, block) if tile_2d else _blocks(x, block)
    max_abs = data.abs().amax(-1, keepdim=True)
    amax = torch.clamp(max_abs.to(torch.float64), min=FP8_BLOCKWISE_EPS, max=float("inf"))
    scale = (E4M3_MAX / amax).to(torch.float32)
    elements = (data * scale).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    reciprocal = 1.0 / scale
    values = elements * reciprocal
    if tile_2d:
        rows, cols = x.shape
        values, elements = _untile(values, block, rows, cols), _untile(elements, block, rows, cols)
    else:
        values, elements = values.reshape(x.shape), elements.reshape(x.shape)
    reciprocal = reciprocal.squeeze(-1)
    return Blocked(values=values, elements=elements, scales=reciprocal, stored_scales=reciprocal, tensor_scale=None,
                   saturated=torch.isinf(scale).squeeze(-1),
                   underflowed=((max_abs < FP8_BLOCKWISE_EPS) & (max_abs > 0)).squeeze(-1))
