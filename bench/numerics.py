"""Cost of layer numerics: one probe pass against one untraced step, and a run's amax sampling against no sampling.

numerics_ratio: a probe pass (two copies of the model, an fp32 reference and the mode, each one recorded forward +
backward, every module's ranges measured and compared) against the forward + backward a training step runs (same
mode, same batch), for digits_mlp and tiny_transformer. The two are timed alternately (both see the same machine
load) and each is summarised by its fastest run, the least noisy estimate of its cost on a shared machine.
Target: <= 10 for both; the figure is the larger.

amax_sampling_ratio: wall time per training step of a run that samples per-layer amax every 100 steps against the
same run without, runs alternating in one process. Wall time between the first and the last step record, so the
sampling's own cost (taken outside step_ms) is counted. Target: <= 1.03.
Last line: numerics_ratio=<larger of the two workloads' ratios>.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/numerics.py` from anywhere

from amp_core import runner
from amp_core.config import RunConfig
from amp_core.precision import get_precision
from amp_core.probes.numerics import LAYER_AMAX_EVENT, probe_step
from amp_core.runner import Run
from amp_core.workloads import WORKLOADS

WORKLOADS_TIMED = ("digits_mlp", "tiny_transformer")


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


def numerics_ratio(workload_name: str, mode: str, batch_size: int, repeats: int) -> float:
    config = RunConfig(workload=workload_name, modes=(mode,), batch_size=batch_size, device="cpu")
    workload = WORKLOADS[workload_name]
    precision = get_precision(mode, "cpu")
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    model = precision.prepare_module(workload.build_model(config.size, data))
    batch = data.sample(torch.Generator().manual_seed(config.seed), config.batch_size)
    inputs, target = (precision.prepare_input(t) for t in batch)
    scaler = precision.make_scaler()

    def untraced() -> None:
        model.zero_grad(set_to_none=True)
        with precision.forward_context():
            loss = workload.loss(model(inputs), target)
        scaler.scale(loss).backward()

    def probed() -> None:
        probe_step(model, precision, workload.loss, batch)

    times = time_ms({"untraced": untraced, "probed": probed}, repeats)
    modules = len(probe_step(model, precision, workload.loss, batch).modules)
    ratio = min(times["probed"]) / min(times["untraced"])
    print(f"workload={workload_name} mode={mode} batch={batch_size} module_calls={modules} repeats={repeats}")
    for name, values in times.items():
        print(f"  {name}_ms fastest={min(values):.3f} median={statistics.median(values):.3f}")
    print(f"numerics_ratio_{workload_name}={ratio:.2f}")
    return ratio


def run_wall_ms_per_step(config: RunConfig) -> tuple[float, float, int]:
    """A run to its end: (wall ms per step from the first to the last step record, median step_ms, samples)."""
    run = Run(config).start()
    run.join()
    frame = run.frame()
    if run.status != "finished":
        raise RuntimeError(f"bench run ended {run.status}: {[e.message for e in run.events()][-3:]}")
    samples = [e for e in run.events() if e.kind == LAYER_AMAX_EVENT]
    wall = (frame["t_wall_s"].iloc[-1] - frame["t_wall_s"].iloc[0]) * 1e3 / (len(frame) - 1)
    return wall, float(frame["step_ms"].median()), len(samples)


def amax_sampling_ratio(workload: str, mode: str, steps: int, every: int, repeats: int) -> float:
    base = RunConfig(workload=workload, modes=(mode,), steps=steps, batch_size=64, device="cpu", gradstats_every=0)
    configs = {"plain": base, "sampled": RunConfig.from_dict({**base.to_dict(), "amax_every": every})}
    wall: dict[str, list[float]] = {name: [] for name in configs}
    step_ms: dict[str, list[float]] = {name: [] for name in configs}
    samples = 0
    run_wall_ms_per_step(base)  # warm-up
    for _ in range(repeats):
        for name, config in configs.items():
            per_step, median_ms, count = run_wall_ms_per_step(config)
            wall[name].append(per_step)
            step_ms[name].append(median_ms)
            samples = count if name == "sampled" else samples
    print(f"workload={workload} mode={mode} steps={steps} amax_every={every} samples_per_run={samples} "
          f"runs={repeats} each, alternating")
    for name in configs:
        print(f"  {name}: wall_ms_per_step fastest={min(wall[name]):.4f} median={statistics.median(wall[name]):.4f}"
              f" · median step_ms {statistics.median(step_ms[name]):.4f}")
    print(f"step_ms_ratio={statistics.median(step_ms['sampled']) / statistics.median(step_ms['plain']):.3f}"
          "  (the timed step alone: sampling is outside it)")
    return min(wall["sampled"]) / min(wall["plain"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="16-mixed")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--amax-workload", default="digits_mlp")
    parser.add_argument("--amax-steps", type=int, default=1000)
    parser.add_argument("--amax-runs", type=int, default=7)
    args = parser.parse_args()

    torch.set_num_threads(1)  # both sides on one thread, so the ratio is not thread-scheduling noise
    # Runs too: a run measures whether one intra-op thread beats the process's count, a choice that noise on a
    # shared machine can tip either way; starting from one thread, every run trains alike.
    runner.PROCESS_THREADS = 1
    ratios = [numerics_ratio(name, args.mode, args.batch_size, args.repeats) for name in WORKLOADS_TIMED]
    sampling = amax_sampling_ratio(args.amax_workload, args.mode, args.amax_steps, 100, args.amax_runs)
    print(f"amax_sampling_ratio={sampling:.3f}")
    print(f"numerics_ratio={max(ratios):.2f}")


if __name__ == "__main__":
    main()
