"""The emulated block-scaled Linear: each of a Linear's three GEMMs reads its operands quantised and dequantised
exactly as a block-scaled recipe (MXFP8, NVFP4, blockwise FP8) would hand them to the tensor cores, then multiplies
in fp32. The numbers are the format's; the speed is not (a CPU has no such tensor cores).

Each GEMM's blocks run along its reduction dim, as the hardware's do: forward `x @ W^T` (x and W along in_features),
grad-input `dy @ W` (dy and W^T along out_features), grad-weight `dy^T @ x` (both along the tokens). NVFP4's recipe
quantises weights in 16x16 tiles (a weight and its transpose then hold the same values), applies a random Hadamard
transform to both grad-weight inputs along the tokens, and rounds gradients stochastically."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from amp_core.formats import stages
from amp_core.formats.quantize import (
    FP8_BLOCKWISE_BLOCK,
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    Blocked,
    hadamard_transform,
    quantize_fp8_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    random_signs,
)

FORMATS = ("mxfp8", "nvfp4", "fp8-blockwise")
INPUT, WEIGHT, GRAD_OUTPUT = "input", "weight", "grad_output"
OPERANDS = (INPUT, WEIGHT, GRAD_OUTPUT)
"""A Linear's GEMM operands, as layer numerics names them."""


@dataclass(frozen=True, slots=True)
class GemmRecipe:
    """How a block-scaled recipe quantises each operand of a Linear's GEMMs."""

    format: str
    """mxfp8 | nvfp4 | fp8-blockwise."""
    scaling: str = "rceil"
    """MXFP8's scale rounding (quantize.SCALINGS)."""
    wgrad_hp: bool = False
    """The grad-weight GEMM in high precision (its operands not quantised)."""
    weight_tiles: bool = False
    """Weights in square tiles (NVFP4 16x16, blockwise FP8 128x128) instead of rows of blocks."""
    hadamard: bool = False
    """NVFP4: a random Hadamard transform on both grad-weight inputs along the tokens."""
    stochastic_gradients: bool = False
    """NVFP4: output gradients rounded stochastically (both backward GEMMs)."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown block-scaled format {self.format!r}; choose from {', '.join(FORMATS)}")

    @property
    def block(self) -> int:
        """Values per block along a GEMM's reduction dim."""
        return {"mxfp8": MXFP8_BLOCK, "nvfp4": NVFP4_BLOCK, "fp8-blockwise": FP8_BLOCKWISE_BLOCK}[self.format]

    def quantize(self, tensor: torch.Tensor, operand: str, *, generator: torch.Generator | None = None) -> Blocked:
        """`tensor` (blocks along its last dim, the GEMM's reduction dim) quantised as this recipe quantises
        `operand` (OPERANDS)."""
        tiles = operand == WEIGHT and self.weight_tiles
        if self.format == "mxfp8":
            return quantize_mxfp8(tensor, self.scaling)
        if self.format == "nvfp4":
            return quantize_nvfp4(tensor, tile_2d=tiles, generator=generator,
                                  stochastic=operand == GRAD_OUTPUT and self.stochastic_gradients)
        return quantize_fp8_blockwise(tensor, tile_2d=tiles)

    def misfit(self, in_features: int, out_features: int) -> str:
        """Why a Linear of this shape cannot be converted (empty: it can): both its dims are some GEMM's reduction
        dim, so both must be whole blocks."""
        if in_features % self.block or out_features % self.block:
            return (f"misshaped: {in_features}->{out_features} is not a multiple of {self.format}'s block of "
                    f"{self.block}")
        return ""


def _pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows up to a multiple of `multiple`: the grad-weight GEMM sums over rows (tokens), so zero rows add
    nothing to it and change no amax."""
    extra = -tensor.shape[0] % multiple
    return F.pad(tensor, (0, 0, 0, extra)) if extra else tensor


def layout(recipe: GemmRecipe, operand: str, along: str) -> str:
    """How `operand` is blocked in a GEMM, in words: "1x32 blocks along in_features", "16x16 tiles"."""
    if operand == WEIGHT and recipe.weight_tiles:
        return f"{recipe.block}x{recipe.block} tiles"
    return f"1x{recipe.block} blocks along {along}"


def _quantized(recipe: GemmRecipe, tensor: torch.Tensor, operand: str, along: str,
               generator: torch.Generator | None = None, extra: str = "") -> torch.Tensor:
    """`tensor` quantised and dequantised as `recipe` quantises `operand`, the stage named for the op tracer."""
    rounding = ", stochastic rounding" if operand == GRAD_OUTPUT and recipe.stochastic_gradients and \
        recipe.format == "nvfp4" else ""
    return stages.run(lambda: f"quantise+dequantise {operand} · {recipe.format} · {layout(recipe, operand, along)}"
                              f"{extra}{rounding}",
                      lambda: recipe.quantize(tensor, operand, generator=generator).values)


def _gemm(recipe: GemmRecipe, which: str, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """`first @ second` (dequantised operands, an fp32 product), the stage named for the op tracer."""
    return stages.run(lambda: f"GEMM {which} · {recipe.format} operands (emulated: fp32 product)",
                      lambda: first @ second)


def _wgrad_operand(recipe: GemmRecipe, tensor: torch.Tensor, operand: str, signs: torch.Tensor,
                   generator: torch.Generator | None) -> torch.Tensor:
    """A (tokens, features) operand of the grad-weight GEMM as it reads it: transposed so the tokens are the
    reduction dim, Hadamard-transformed where the recipe says, quantised."""
    transposed = _pad_rows(tensor, recipe.block).t().contiguous()
    if recipe.hadamard:
        transposed = stages.run(lambda: f"random Hadamard transform {operand} · 16 along tokens",
                                lambda: hadamard_transform(transposed, signs))
    return _quantized(recipe, transposed, operand, "tokens", generator,
                      " (Hadamard-transformed)" if recipe.hadamard else "")


class _BlockScaledMatmul(torch.autograd.Function):
    """x @ W^T with every GEMM's operands quantised as `recipe`; fp32 products, results in the operands' dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: GemmRecipe, signs: torch.Tensor,
                generator: torch.Generator | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.signs, ctx.generator = recipe, signs, generator
        rows = x.reshape(-1, x.shape[-1])
        product = _gemm(recipe, "forward (input x weight)", _quantized(recipe, rows, INPUT, "in_features"),
                        _quantized(recipe, weight, WEIGHT, "in_features").t())
        return product.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, signs, generator = ctx.recipe, ctx.signs, ctx.generator
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            dy = _quantized(recipe, grad_rows, GRAD_OUTPUT, "out_features", generator)
            weight_t = _quantized(recipe, weight.t().contiguous(), WEIGHT, "out_features")
            grad_input = _gemm(recipe, "grad-input (grad_output x weight)", dy, weight_t.t()).to(x.dtype)
            grad_input = grad_input.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad_hp:
                grad_weight = stages.run(lambda: "GEMM grad-weight (grad_output x input) · high precision (not "
                                                 "quantised)",
                                         lambda: grad_rows.t().to(torch.float32) @ rows.to(torch.float32))
            else:
                dy_t = _wgrad_operand(recipe, grad_rows, GRAD_OUTPUT, signs, generator)
                x_t = _wgrad_operand(recipe, rows, INPUT, signs, generator)
                grad_weight = _gemm(recipe, "grad-weight (grad_output x input)", dy_t, x_t.t())
            grad_weight = grad_weight.to(weight.dtype)
        return grad_input, grad_weight, None, None, None


class BlockScaledLinear(torch.nn.Linear):
    """An nn.Linear whose GEMMs run emulated in a block-scaled format (`recipe`). It holds the original layer's own
    weight and bias Parameters (same names, same optimizer state). Under autocast the operands are first cast to the
    autocast dtype, as torchao's float8 and MX layers do, and autocast is off inside the emulated GEMMs."""

    def __init__(self, layer: torch.nn.Linear, recipe: GemmRecipe, name: str = "") -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.recipe = recipe
        # One sign vector per layer (torchao's NVFP4Linear draws one each too), seeded by the layer's name so a lane
        # and its replay transform alike; not a buffer, so the state dict is the plain Linear's.
        self.signs = random_signs(torch.Generator().manual_seed(zlib.crc32(name.encode())))
        self._seed = zlib.crc32(f"sr:{name}".encode())
        self._draws = 0

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """This backward's stochastic-rounding draws: the layer's own stream (seeded by its name and how many
        backwards it has drawn for), so the model's other random numbers stay the lane's and a copy of the layer
        (a probe's) copies a number, not a generator."""
        if not self.recipe.stochastic_gradients:
            return None
        self._draws += 1
        return torch.Generator(device).manual_seed(self._seed + self._draws)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            out = _BlockScaledMatmul.apply(x, weight, self.recipe, self.signs, self._generator(x.device))
            return out + bias if bias is not None else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.recipe.format} (emulated)"


_EMULATION_ATTRIBUTES = ("recipe", "signs", "_seed", "_draws")


def plain_linears(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (one the caller owns: a copy) with every BlockScaledLinear made a plain nn.Linear again, in place: the
    same Parameters and hooks, its emulation's attributes dropped. A copy of a block-scaled lane's model then takes
    any recipe as a fresh model would: a 32-true reference computes in fp32, a `+keep:` trial leaves its kept layers
    out of the format."""
    for layer in module.modules():
        if isinstance(layer, BlockScaledLinear):
            for name in _EMULATION_ATTRIBUTES:
                layer.__dict__.pop(name, None)
            layer.__class__ = torch.nn.Linear
    return module
