"""Workloads for the compiled-lane tests: a model with a planted graph break, and one that dynamo cannot compile
under bf16 autocast (a custom op whose fake kernel is broken), while it runs eagerly in every mode."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads.mlp_regression import MLPRegression


@torch.library.custom_op("amp_lab_tests::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("amp_lab_tests::double has no shape function (planted for the tests)")


double.register_autograd(lambda ctx, grad: grad * 2)


class BreaksAndFails(nn.Module):
    """Linear -> ReLU -> (a planted graph break) -> Linear; under CPU autocast the hidden layer also goes through
    `double`, which dynamo cannot trace (its fake kernel raises): a compiled bf16-mixed lane fails, a compiled
    32-true lane compiles in two graphs around the break, recompiles on its next call (the call count it read changed)
    and, past dynamo's recompile limit, runs its forward eagerly; every eager lane trains."""

    def __init__(self, hidden: int):
        super().__init__()
        self.layer1 = nn.Linear(10, hidden)
        self.layer2 = nn.Linear(hidden, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # dynamo guards on the count it read: every call of a compiled lane fails that guard
        hidden = torch.relu(self.layer1(x)) * (1.0 if self.calls > 0 else 2.0)
        torch._dynamo.graph_break()
        if torch.is_autocast_enabled("cpu"):
            hidden = double(hidden) / 2
        return self.layer2(hidden)


class PlantedBreak(MLPRegression):
    name = "planted_break"

    def build_model(self, size: str, data) -> nn.Module:
        return BreaksAndFails(self.sizes[size]["hidden"])


class Chain(nn.Module):
    """Linear -> a chain of pointwise ops -> Linear: under bf16 autocast eager rounds each op of the chain to bf16,
    inductor fuses the chain into one kernel that computes in fp32 and rounds once, so the compiled loss differs from
    eager's in its last bits (the drift pytorch#150638 describes)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.layer1 = nn.Linear(10, hidden)
        self.layer2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.layer1(x)
        hidden = hidden * torch.sigmoid(hidden) * 1.7 + torch.tanh(hidden) * 0.3 - hidden * 0.1
        return self.layer2(hidden)


class FusedChain(MLPRegression):
    name = "fused_chain"

    def build_model(self, size: str, data) -> nn.Module:
        return Chain(self.sizes[size]["hidden"])
