"""The bytes a block-scaled recipe's scales take, named for the memory breakdown: per converted Linear, the scales of
its weight (as the forward and the grad-input GEMMs read it) and, per token of a batch, the scales of its input and
output gradient (as all three GEMMs read them), by each format's own layout: E8M0 (1 B) per 32 values for MXFP8, E4M3
(1 B) per 16 values plus one fp32 tensor scale per tensor for NVFP4, fp32 (4 B) per 1x128 (activations, gradients)
or 128x128 (weights) for blockwise FP8. Exactly what the recipe's quantisers return (tests/test_block_sampling.py
holds the two equal); an emulated lane holds them only during each GEMM, a GPU's kernels beside their elements."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from amp_core.formats.linear import GemmRecipe

SCALE_LAYOUTS = {"mxfp8": "E8M0 (1 B) per 32 values", "nvfp4": "E4M3 (1 B) per 16 values + an fp32 tensor scale",
                 "fp8-blockwise": "fp32 (4 B) per 1x128 values"}
"""Each format's scales in words (its weights' tiles, where the recipe tiles them, are said beside)."""
SCALE_BYTES = {"mxfp8": 1, "nvfp4": 1, "fp8-blockwise": 4}
TENSOR_SCALE_BYTES = 4
"""NVFP4's per-tensor fp32 scale."""


def layer_scale_bytes(gemm: GemmRecipe, in_features: int, out_features: int) -> dict[str, int]:
    """One Linear's scales in one training step: `weight` (the weight as the forward reads it and, unless the recipe
    tiles it so that one quantisation serves both, its transpose as the grad-input GEMM reads it), `per_token` (the
    input and output gradient along their features, and again along the tokens for the grad-weight GEMM unless it
    runs in high precision), `tensor` (NVFP4's per-tensor scales, one per quantised tensor)."""
    size, block = SCALE_BYTES[gemm.format], gemm.block
    if gemm.weight_tiles:
        weight, weight_tensors = (out_features // block) * (in_features // block) * size, 1
    else:
        weight, weight_tensors = 2 * (out_features * in_features // block) * size, 2
    passes = 1 if gemm.wgrad_hp else 2
    per_token = passes * (in_features + out_features) * size // block
    tensors = weight_tensors + 2 * passes
    return {"weight": weight, "per_token": per_token,
            "tensor": tensors * TENSOR_SCALE_BYTES if gemm.format == "nvfp4" else 0}


def block_scale_report(gemm: GemmRecipe, module: torch.nn.Module, converted: Iterable[str]) -> dict:
    """The recipe report's `block_scales`: the layout in words and the bytes summed over the `converted` layers of
    `module` (weight_bytes, per_token_bytes, tensor_scale_bytes)."""
    layers = dict(module.named_modules())
    totals = {"weight": 0, "per_token": 0, "tensor": 0}
    for name in converted:
        out_features, in_features = layers[name].weight.shape
        for key, value in layer_scale_bytes(gemm, in_features, out_features).items():
            totals[key] += value
    layout = SCALE_LAYOUTS[gemm.format]
    if gemm.weight_tiles:
        layout += f"; weights per {gemm.block}x{gemm.block} tile"
    return {"layout": layout, "weight_bytes": totals["weight"], "per_token_bytes": totals["per_token"],
            "tensor_scale_bytes": totals["tensor"]}


def scale_text(scales: dict, tokens: int | None = None) -> str:
    """'1.5 KiB for the weights + 96 B per token (E8M0 (1 B) per 32 values)': a recipe report's block_scales in words;
    with `tokens` (a step's tokens), also the step's total."""
    per_step = "" if tokens is None else \
        f" = {_bytes(scales['weight_bytes'] + scales['tensor_scale_bytes'] + tokens * scales['per_token_bytes'])} " \
        f"in a step of {tokens:,} tokens"
    tensor = f" + {_bytes(scales['tensor_scale_bytes'])} of tensor scales" if scales["tensor_scale_bytes"] else ""
    return (f"{_bytes(scales['weight_bytes'])} for the weights + {_bytes(scales['per_token_bytes'])} per token"
            f"{tensor}{per_step} ({scales['layout']})")


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if value < 1024 or unit == "MiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value} B"
