"""A stack of blocks with planted precision failures beside large-but-safe layers (for bisect tests): each block is
Linear -> a planted or safe module -> LayerNorm -> GELU; the size names where the planted modules are."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads import Data, Workload
from amp_core.workshop.planted import OVERFLOW, SAFE, Boost
from amp_core.workshop.planted import Gain as Amplify  # x * factor / factor: planted (OVERFLOW) or safe (SAFE)

COARSEN_OFFSET = 64.0
"""A planted `Coarsen` adds and subtracts this: bf16 (8 bits of mantissa) rounds x to steps of 0.5 there."""


class Coarsen(nn.Module):
    """x + gain * ((x + 64) - 64 - x): the identity in fp32 (the rounding error is ~1e-6); in bf16 the error is up to
    0.25, amplified: a loss that stays above fp32's."""

    def __init__(self, gain: float = 6.0):
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * ((x + COARSEN_OFFSET) - COARSEN_OFFSET - x)


class Block(nn.Module):
    def __init__(self, width: int, middle: nn.Module):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.middle = middle
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.middle(self.linear(x))))


class Stack(nn.Module):
    def __init__(self, width: int, blocks: list[nn.Module], classes: int):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width, middle) for middle in blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class PlantedStack(Workload):
    """4-class classification of 32 features through 8 blocks; planted modules at the size's blocks."""

    name = "planted_stack"
    title = "Blocks with planted precision failures (bisect tests)"
    description = ("8 blocks of Linear -> planted/safe -> LayerNorm -> GELU; small: one planted overflow, medium: two "
                   "at different depths, large: a bf16 drift.")
    sizes = {
        "small": {"planted": (3,), "kind": "overflow"},
        "medium": {"planted": (1, 6), "kind": "overflow"},
        "large": {"planted": (2,), "kind": "coarsen"},
    }
    width, depth = 32, 8

    def load_data(self, config) -> Data:
        generator = torch.Generator().manual_seed(config.seed)
        inputs = torch.randn(512, self.width, generator=generator)
        targets = (inputs[:, :4] * torch.arange(1.0, 5.0)).argmax(dim=1)
        return Data(inputs, targets, "512 synthetic samples, 32 features, 4 classes")

    def build_model(self, size: str, data: Data) -> nn.Module:
        spec = self.sizes[size]
        planted = Amplify(OVERFLOW) if spec["kind"] == "overflow" else None
        middles = [(Amplify(OVERFLOW) if planted is not None else Coarsen()) if index in spec["planted"]
                   else Amplify(SAFE) for index in range(self.depth)]
        return Stack(self.width, middles, 4)

    def loss(self, output, target):
        return nn.functional.cross_entropy(output.float(), target)


BOOST_PLANTED = 1e5
"""A planted Boost's factor: its output (values near 1 after a Linear and GELU) is beyond fp16's 65504."""
BOOST_DECOY = 300.0
"""The decoy Boost's factor: large (hundreds) but inside fp16's range, so keeping it fixes nothing."""


class LateBoost(Boost):
    """A Boost that multiplies by its factor only from its `after`-th forward on (x1 before): an overflow that comes
    later in training than the step a bisect replays, so a set that fixes that step fails the price race after it."""

    def __init__(self, factor: float, after: int = 3):
        super().__init__(factor)
        self.after, self.calls = after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.factor if self.calls > self.after else x * 1.0


class ResidualBlock(nn.Module):
    """x + proj(boost(act(fc(norm(x)))) / factor): the boost's output is scaled back by plain code after it."""

    def __init__(self, width: int, factor: float, late: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.boost = LateBoost(factor) if late else Boost(factor)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.boost(self.act(self.fc(self.norm(x)))) / self.boost.factor)


class ResidualMLP(nn.Module):
    def __init__(self, features: int, width: int, factors: list[float], classes: int, late: tuple[int, ...] = ()):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.Sequential(*(ResidualBlock(width, factor, index in late)
                                      for index, factor in enumerate(factors)))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


class ResidualPlanted(PlantedStack):
    """The issue's residual MLP: 8 blocks, 1-3 Boosts whose outputs leave fp16's range (scaled back by plain code
    after them) and one decoy Boost that is large but safe; small, medium, large: 1, 2, 3 planted; xl: one planted
    and one that overflows only from its fourth forward on (after the step a bisect replays)."""

    name = "residual_planted"
    title = "Residual MLP with planted out-of-range module outputs (bisect tests)"
    description = ("8 residual blocks x + proj(boost(GELU(fc(LN(x)))) / factor); 1-3 boosts x1e5 (beyond fp16), one "
                   "decoy x300; the rest x1.")
    sizes = {
        "small": {"planted": (3,), "decoy": 5},
        "medium": {"planted": (1, 6), "decoy": 3},
        "large": {"planted": (1, 4, 6), "decoy": 2},
        "xl": {"planted": (3, 6), "decoy": 2, "late": (6,)},
    }

    def build_model(self, size: str, data: Data) -> nn.Module:
        spec = self.sizes[size]
        factors = [BOOST_PLANTED if index in spec["planted"] else BOOST_DECOY if index == spec["decoy"] else 1.0
                   for index in range(self.depth)]
        return ResidualMLP(self.width, self.width, factors, 4, spec.get("late", ()))


def planted_names(size: str) -> list[str]:
    """The modules a bisect of `ResidualPlanted` at `size` should find, in the model's order (the late one too)."""
    return [f"blocks.{index}.boost" for index in ResidualPlanted.sizes[size]["planted"]]
