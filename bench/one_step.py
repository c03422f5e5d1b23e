"""What the probe benches (trace, numerics) share: one training step's forward + backward of a workload in a mode,
set up once, and a timer that alternates the functions it compares so both see the same machine load."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from amp_core.config import RunConfig
from amp_core.precision import Precision, get_precision
from amp_core.workloads import WORKLOADS, Workload


@dataclass
class OneStep:
    """A workload's model in a mode and one batch: `untraced()` is the forward + backward a training step runs."""

    workload: Workload
    precision: Precision
    model: torch.nn.Module
    batch: tuple[torch.Tensor, torch.Tensor]

    def __post_init__(self):
        self._inputs, self._target = (self.precision.prepare_input(t) for t in self.batch)
        self._scaler = self.precision.make_scaler()

    def untraced(self) -> None:
        self.model.zero_grad(set_to_none=True)
        with self.precision.forward_context():
            loss = self.workload.loss(self.model(self._inputs), self._target)
        self._scaler.scale(loss).backward()


def one_step(workload_name: str, mode: str, batch_size: int) -> OneStep:
    """The workload's default-size model (seeded as a run seeds it) and its first batch, on the CPU."""
    config = RunConfig(workload=workload_name, modes=(mode,), batch_size=batch_size, device="cpu")
    workload = WORKLOADS[workload_name]
    precision = get_precision(mode, "cpu")
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    model = precision.prepare_module(workload.build_model(config.size, data))
    batch = data.sample(torch.Generator().manual_seed(config.seed), config.batch_size)
    return OneStep(workload, precision, model, batch)


def time_ms(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Run each function `repeats` times, alternating between them; the times of each in milliseconds."""
    for fn in fns.values():
        fn()  # warm-up: first-call dispatch and allocator costs are not the steady state
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times
