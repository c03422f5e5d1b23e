"""Held-in models with planted format-sensitive layers, for the plan search (bench.plan, tests/test_plan.py): a stack
of blocks, each `spread -> linear -> LayerNorm -> GELU`, where a planted block's `spread` multiplies one feature of
every 16 by a large factor (its Linear's matching weight columns are divided by it, so the function is the plain
stack's). NVFP4 shares one scale per 16 values: the outlier takes it and its 15 neighbours flush to zero, so the
planted Linear sees little but the outliers. MXFP8 (e4m3 beside a power-of-two scale) holds them; so does bf16."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads import Data, Workload

OUTLIER = 1000.0
"""A planted feature's factor: its NVFP4 block neighbours (below 1/24 of it after the e2m1 grid) flush to zero."""
OUTLIER_EVERY = 16
"""One outlier feature per NVFP4 block."""


SKEW = 1e8
"""A skewed block's token gain: every other group of SKEW_GROUP tokens reads its input x1e8, so its output gradient
arrives /1e8 (and the other groups' inputs sit 1e8 below theirs). NVFP4's per-tensor scale sets the tensor's amax;
an e4m3 block scale cannot go below 2^-9 of it, so a block 1e8 down holds nothing above e2m1's half-step: those
tokens' gradients (and the other tokens' inputs) flush to zero, and the layer's grad-weight GEMM reads zero in every
product. MXFP8's power-of-two scale per block spans 2^-127..2^127 and holds both."""
SKEW_GROUP = 32
"""Tokens per gain group: MXFP8's block along the grad-weight GEMM's tokens, so each of its blocks holds one gain
(a block spanning 1e8 would flush in MXFP8 too: e4m3 elements span 2^17). A batch needs 2 groups: 64 rows."""


class Spread(nn.Module):
    """x * factor on one feature of every OUTLIER_EVERY (factor 1: the identity): an outlier channel."""

    def __init__(self, width: int, factor: float):
        super().__init__()
        scale = torch.ones(width)
        scale[::OUTLIER_EVERY] = factor
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Block(nn.Module):
    """x + GELU(LN(linear(spread(x)))); a skewed block's linear reads each token scaled by its own gain and its
    output is scaled back (`skew`), so its GEMM operands span SKEW between tokens."""

    def __init__(self, width: int, factor: float, skew: bool = False):
        super().__init__()
        self.spread = Spread(width, factor)
        self.linear = nn.Linear(width, width)
        with torch.no_grad():
            self.linear.weight[:, ::OUTLIER_EVERY] /= factor
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()
        self.skew = skew

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spread = self.spread(x)
        if self.skew:  # (W (g x) - b) / g + b = W x + b exactly; the gradient reaching W's output is dy / g
            groups = torch.arange(x.shape[0], device=x.device) // SKEW_GROUP
            gain = torch.where(groups % 2 == 0, 1.0, SKEW)[:, None]
            out = (self.linear(spread * gain) - self.linear.bias) / gain + self.linear.bias
        else:
            out = self.linear(spread)
        return x + self.act(self.norm(out))


class Stack(nn.Module):
    def __init__(self, features: int, width: int, factors: list[float], classes: int, skewed: tuple[int, ...] = ()):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.Sequential(*(Block(width, factor, index in skewed) for index, factor in enumerate(factors)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


class PlantedFormats(Workload):
    """8-class classification of 32 features through 6 residual blocks; planted outlier channels at the size's
    blocks (small: one, medium: two); large: one skewed block (token groups x1e8 apart: NVFP4 flushes its
    gradients, MXFP8 holds them); xl: one outlier block and one skewed block."""

    name = "planted_formats"
    title = "Blocks with planted outlier channels (plan search)"
    description = ("6 residual blocks x + GELU(LN(linear(spread(x)))); a planted spread puts one feature of every 16 "
                   "at x1000 (NVFP4 flushes its block neighbours); a skewed block's token groups are x1e8 apart "
                   "(NVFP4's block scales underflow); the head (32->8) is not whole NVFP4 blocks.")
    sizes = {"small": {"planted": (2,)}, "medium": {"planted": (1, 4)}, "large": {"planted": (), "skewed": (3,)},
             "xl": {"planted": (1,), "skewed": (4,)}}
    features, width, depth, classes = 32, 32, 6, 8

    def load_data(self, config) -> Data:
        generator = torch.Generator().manual_seed(1234)  # one task for every seed: the seeds vary weights and order
        inputs = torch.randn(1024, self.features, generator=generator)
        mixing = torch.randn(self.features, self.classes, generator=generator)
        targets = (inputs @ mixing).argmax(dim=1)
        return Data(inputs, targets, "1024 synthetic samples, 32 features, 8 classes")

    def build_model(self, size: str, data: Data) -> nn.Module:
        planted = self.sizes[size]["planted"]
        factors = [OUTLIER if index in planted else 1.0 for index in range(self.depth)]
        return Stack(self.features, self.width, factors, self.classes, self.sizes[size].get("skewed", ()))

    def loss(self, output, target):
        return nn.functional.cross_entropy(output.float(), target)


def planted_linears(size: str) -> list[str]:
    """The Linear layers a plan search of `PlantedFormats` at `size` with an NVFP4 target should promote."""
    spec = PlantedFormats.sizes[size]
    return [f"blocks.{index}.linear" for index in sorted((*spec["planted"], *spec.get("skewed", ())))]
