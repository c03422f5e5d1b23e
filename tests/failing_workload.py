"""A workload whose model really runs out of memory at a chosen step in its low-precision lanes (for failure tests)."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads.mlp_regression import MLPRegression

HUGE_BYTES = 1 << 60
"""More than any machine can give: the CPU allocator refuses it (RuntimeError: can't allocate memory)."""


class AllocatesTooMuchAt(nn.Module):
    """Wraps a model; its training forward number `step` under autocast asks the allocator for HUGE_BYTES.

    Only lanes that run under autocast (16-mixed, bf16-mixed) reach that allocation, so a 32-true lane beside them
    trains on: one lane fails the way a too-large model or batch fails, the others do not.
    """

    def __init__(self, inner: nn.Module, step: int):
        super().__init__()
        self.inner = inner
        self.step = step
        self.training_forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and torch.is_autocast_enabled(x.device.type):
            if self.training_forwards == self.step:
                torch.empty(HUGE_BYTES, dtype=torch.uint8, device=x.device)
            self.training_forwards += 1
        return self.inner(x)


class OutOfMemoryAt(MLPRegression):
    """mlp_regression whose autocast lanes run out of memory in their forward at step `step`."""

    name = "out_of_memory_at"

    def __init__(self, step: int):
        self.step = step

    def build_model(self, size: str, data) -> nn.Module:
        return AllocatesTooMuchAt(super().build_model(size, data), self.step)
