"""A workload plugin: your own model, data and loss raced by AMP Lab like a built-in.

    PYTHONPATH=examples amp-lab run --workload-module my_workload --workload sine_mlp --modes 32-true,16-mixed
    PYTHONPATH=examples AMP_LAB_WORKLOADS=my_workload amp-lab ui

Every public Workload subclass this module defines joins the registry: the Train page, the CLI, the op inspector and
the layer numerics page list it. It is created with no arguments; sizes are small/medium/large/xl.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from amp_core.workloads import Data, Workload


class SineMLP(Workload):
    name = "sine_mlp"
    title = "Sine MLP (plugin example: 1-H-H-1, MSE)"
    description = "y = sin(3x) + noise on x in [-pi, pi], fitted by a two-hidden-layer MLP (examples/my_workload.py)."
    sizes = {"small": {"samples": 2048, "hidden": 64}, "medium": {"samples": 65_536, "hidden": 1024}}

    def load_data(self, config) -> Data:
        samples = self.sizes[config.size]["samples"]
        generator = torch.Generator().manual_seed(config.seed)
        x = (torch.rand(samples, 1, generator=generator) * 2 - 1) * math.pi
        y = torch.sin(3 * x) + 0.05 * torch.randn(samples, 1, generator=generator)
        return Data(x, y, f"{samples} points of sin(3x) + noise")

    def build_model(self, size: str, data: Data) -> nn.Module:
        hidden = self.sizes[size]["hidden"]
        return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                             nn.Linear(hidden, 1))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)
