"""The format each module of a prepared model computes its matmuls in, read from the layers themselves (not from a
plan file or a recipe string): what a plan lane, a `+keep:` lane or the user's own converted model really runs. The
op inspector shows it beside each module's ops; the plan as code checks the user's model against the plan with it."""

from __future__ import annotations

from torch import nn

from amp_core.formats.linear import BlockScaledLinear
from amp_core.formats.plan import PlannedLinear
from amp_core.precision import is_kept, low_precision_dtype, recipe_mode

KEPT = "fp32 (kept)"
"""A module computed in fp32 by a keep (`+keep:`, a plan's fp32, `keep_in_fp32`) that is not itself a Linear."""
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


def plain_format(recipe: str) -> str:
    """What a plain nn.Linear computes in on a lane of `recipe`: its mode's 16-bit dtype, fp32 for 32-true and tf32
    (the lane's matmul option, if any, has replaced the Linear layers it converts by then)."""
    return DTYPE_NAMES.get(str(low_precision_dtype(recipe_mode(recipe))), "fp32")


def _kept_names(model: nn.Module) -> set[str]:
    """Every module computed in fp32 by a keep: each kept module and everything under it ("" is the root)."""
    kept = [name for name, layer in model.named_modules() if is_kept(layer)]
    return {name for name, _ in model.named_modules()
            if any(name == k or name.startswith(f"{k}.") or not k for k in kept)}


def linear_formats(model: nn.Module, plain: str = "bf16") -> dict[str, str]:
    """The matmul format of each nn.Linear of a prepared `model`: fp32 (kept), bf16 / fp16 (a plan's), mxfp8 / nvfp4 /
    fp8-blockwise (block-scaled), fp8 (torchao's Float8Linear), or `plain` (a Linear nothing converted: the loop's
    autocast dtype)."""
    kept = _kept_names(model)
    out = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, nn.Linear):
            continue
        if name in kept:
            out[name] = "fp32"
        elif isinstance(layer, PlannedLinear):
            out[name] = layer.format
        elif isinstance(layer, BlockScaledLinear):
            out[name] = layer.recipe.format
        elif type(layer).__name__ == "Float8Linear":
            out[name] = "fp8"
        else:
            out[name] = plain
    return out


def module_formats(model: nn.Module, plain: str = "bf16") -> dict[str, str]:
    """`linear_formats`, plus every other module kept in fp32 (KEPT), by `named_modules()` name ("" for the root)."""
    kept = _kept_names(model)
    out = {name: KEPT for name, _ in model.named_modules() if name in kept}
    out.update(linear_formats(model, plain))
    return out
