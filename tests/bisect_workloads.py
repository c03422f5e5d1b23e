"""A stack of blocks with planted precision failures beside large-but-safe layers (for bisect tests): each block is
Linear -> a planted or safe module -> LayerNorm -> GELU; the size names where the planted modules are."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads import Data, Workload
from amp_core.workshop.planted import OVERFLOW, SAFE
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
