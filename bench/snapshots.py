"""Replay snapshots' cost: host time of one SnapshotRing.take against the lane's own step, for each built-in workload
at size small, and its share of the training time at the default interval (RunConfig.snapshot_every). The take and
the step are timed alternately on one thread (best of neighbours is not used: medians), so machine load hits both.

    python3 -m bench.snapshots [--modes 32-true,16-mixed] [--repeats 200]
Last line: snapshot_share_max=<the largest snapshot ms / (snapshot_every x step ms)>
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from amp_core.config import RunConfig
from amp_core.precision.switches import pin_intra_op_threads
from amp_core.race.runner import build_lane_state
from amp_core.race.snapshots import SnapshotRing
from amp_core.race.step import train_step
from amp_core.workloads import WORKLOADS


def measure(workload_name: str, mode: str, repeats: int) -> tuple[float, float, int]:
    """(median step ms, median snapshot ms, snapshot bytes) of one lane of `workload_name` at size small."""
    config = RunConfig(workload=workload_name, modes=(mode,), device="cpu")
    workload = WORKLOADS[workload_name]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    state = build_lane_state(config, 0, mode, workload.build_model(config.size, data), workload, "cpu")
    order = torch.Generator().manual_seed(config.seed)
    ring = SnapshotRing(every=1, keep=RunConfig().snapshot_keep)
    steps, takes = [], []
    for step in range(repeats + 5):
        batch = data.sample(order, config.batch_size)
        started = time.perf_counter()
        train_step(state, batch, step)
        step_ms = (time.perf_counter() - started) * 1e3
        take_ms = ring.take(state, step, batch, order) * 1e3
        if step >= 5:  # past the first steps' allocations
            steps.append(step_ms)
            takes.append(take_ms)
    bytes_per_snapshot = ring.nbytes() // len(ring.steps(0))
    return statistics.median(steps), statistics.median(takes), bytes_per_snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", default="32-true,16-mixed")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    pin_intra_op_threads(1)  # as a run on a small model chooses on a CPU (see runner.choose_threads)
    every = RunConfig().snapshot_every
    shares = []
    for workload in sorted(WORKLOADS):
        for mode in args.modes.split(","):
            step_ms, take_ms, nbytes = measure(workload, mode, args.repeats)
            share = take_ms / (every * step_ms)
            shares.append(share)
            print(f"{workload:<18}{mode:<12} step_ms={step_ms:.4f} snapshot_ms={take_ms:.4f} "
                  f"snapshot_kib={nbytes / 1024:.0f} share_at_every_{every}={share:.4%}")
    print(f"snapshot_share_max={max(shares):.4%}")


if __name__ == "__main__":
    main()
