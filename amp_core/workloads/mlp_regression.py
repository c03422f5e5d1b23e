"""mlp_regression: the 10 -> 20 -> 1 MLP with MSE on synthetic data (seed notes 000)."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads.base import Data, Workload


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.layer1 = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.layer2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.relu(self.layer1(x)))


class MLPRegression(Workload):
    name = "mlp_regression"
    title = "Regression on random numbers (the smallest network)"
    description = ("Fits 10 random inputs to a target drawn around 10 (normal, spread 5) with a 10-20-1 network and a "
                   "squared-error loss: the quickest workload, for a first look.")
    sizes = {"small": {"samples": 1000, "hidden": 20},
             "medium": {"samples": 20_000, "hidden": 512},
             "large": {"samples": 100_000, "hidden": 4096}}

    def load_data(self, config) -> Data:
        n = self.sizes[config.size]["samples"]
        g = torch.Generator().manual_seed(config.seed)
        x = torch.randn(n, 10, generator=g)
        y = torch.randn(n, 1, generator=g) * 5 + 10
        return Data(x, y, f"{n} synthetic samples, 10 features")

    def build_model(self, size: str, data: Data) -> nn.Module:
        return MLP(10, self.sizes[size]["hidden"], 1)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
