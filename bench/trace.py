"""Cost of the op inspector: one traced forward + backward of digits_mlp against the same step untraced.

The traced step is what the page and `trace_lane` pay: copy the model, record every op with its module and FLOPs,
forward and backward. The untraced step is the forward + backward a training step runs (same mode, same batch).
The two are timed alternately (so both see the same machine load) and each is summarised by its fastest run,
the least noisy estimate of its cost on a shared machine; medians are printed too.
Last line: trace_ratio=<fastest traced / fastest untraced>. Target: <= 10.

    python3 -m bench.trace [--mode bf16-mixed] [--batch-size 64] [--repeats 100]   (from the repository root)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from amp_core.config import RunConfig
from amp_core.precision import Precision, get_precision
from amp_core.probes.optrace import trace_step
from amp_core.workloads import WORKLOADS, Workload

WORKLOAD = "digits_mlp"


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
    model, batch = workload.seeded_model_and_batch(config)
    return OneStep(workload, precision, precision.prepare_module(model), batch)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="bf16-mixed")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()

    step = one_step(WORKLOAD, args.mode, args.batch_size)

    def traced() -> None:
        trace_step(step.model, step.precision, step.workload.loss, step.batch)

    torch.set_num_threads(1)  # both sides on one thread, so the ratio is not thread-scheduling noise
    times = time_ms({"untraced": step.untraced, "traced": traced}, args.repeats)
    ops = trace_step(step.model, step.precision, step.workload.loss, step.batch).summary().ops
    print(f"workload={WORKLOAD} mode={args.mode} batch={args.batch_size} ops={ops} repeats={args.repeats}")
    for name, values in times.items():
        print(f"{name}_step_ms fastest={min(values):.3f} median={statistics.median(values):.3f}")
    print(f"trace_ratio={min(times['traced']) / min(times['untraced']):.2f}")


if __name__ == "__main__":
    main()
