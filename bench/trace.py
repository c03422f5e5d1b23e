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

import torch

from amp_core.probes.optrace import trace_step
from bench.one_step import one_step, time_ms

WORKLOAD = "digits_mlp"


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
