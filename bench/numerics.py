"""Cost of layer numerics: one probe pass against one untraced step, and a run's amax sampling against no sampling.

numerics_ratio: a probe pass (a copy of the model recorded through one forward + backward in fp32 and one in the
mode, every module's ranges measured and compared) against the forward + backward a training step runs (same mode,
same batch), for digits_mlp and tiny_transformer, in the modes with a 16-bit format (the probe's purpose; --modes
adds 32-true). The two are timed alternately (both see the same machine load) and each is summarised by its
fastest run, the least noisy estimate of its cost on a shared machine. Target: <= 10; the figure is the largest.

amax_sampling_ratio: wall time per training step of a run that samples per-layer amax every 100 steps against the
same run without, in pairs of runs in one process, alternating which goes first (the median of the pairs' ratios).
Wall time runs from the first to the last step record, so the sampling's own cost (taken outside step_ms) counts.
Target: <= 1.03.
amax_sampling_cost_ratio is the same figure from the measured cost of each sample (its event's sample_ms).
Last line: numerics_ratio=<the largest of the workloads' and modes' ratios>.
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
    print(f"numerics_ratio_{workload_name}_{mode}={ratio:.2f}")
    return ratio


def run_figures(config: RunConfig) -> tuple[float, float, list[float]]:
    """A run to its end: (wall ms per step from the first to the last step record, median step_ms, the sampled
    steps' sample_ms)."""
    run = Run(config).start()
    run.join()
    frame = run.frame()
    if run.status != "finished":
        raise RuntimeError(f"bench run ended {run.status}: {[e.message for e in run.events()][-3:]}")
    samples = [e.data["sample_ms"] for e in run.events() if e.kind == LAYER_AMAX_EVENT]
    wall = (frame["t_wall_s"].iloc[-1] - frame["t_wall_s"].iloc[0]) * 1e3 / (len(frame) - 1)
    return wall, float(frame["step_ms"].median()), samples


def amax_sampling_ratio(workload: str, mode: str, steps: int, every: int, pairs: int) -> float:
    """Median over pairs of runs (without, then with sampling) of the ratio of their wall time per step."""
    base = RunConfig(workload=workload, modes=(mode,), steps=steps, batch_size=64, device="cpu", gradstats_every=0)
    sampled_config = RunConfig.from_dict({**base.to_dict(), "amax_every": every})
    run_figures(base)  # warm-up
    ratios, walls, step_ms, sample_ms = [], {"plain": [], "sampled": []}, {"plain": [], "sampled": []}, []
    for pair in range(pairs):
        if pair % 2:  # every other pair the other way round, so going second (a warmer or a more crowded process)
            sampled_wall, sampled_ms, samples = run_figures(sampled_config)  # favours neither side
            plain_wall, plain_ms, _ = run_figures(base)
        else:
            plain_wall, plain_ms, _ = run_figures(base)
            sampled_wall, sampled_ms, samples = run_figures(sampled_config)
        ratios.append(sampled_wall / plain_wall)
        walls["plain"].append(plain_wall)
        walls["sampled"].append(sampled_wall)
        step_ms["plain"].append(plain_ms)
        step_ms["sampled"].append(sampled_ms)
        sample_ms.extend(samples)
    print(f"workload={workload} mode={mode} steps={steps} amax_every={every} samples_per_run={steps // every} "
          f"pairs={pairs} (a run without and a run with sampling, in alternating order)")
    for name in walls:
        print(f"  {name}: wall_ms_per_step median={statistics.median(walls[name]):.4f} "
              f"fastest={min(walls[name]):.4f} · median step_ms {statistics.median(step_ms[name]):.4f}")
    print(f"  sample_ms median={statistics.median(sample_ms):.3f} (one sample: copy + forward + backward + maxima)")
    print(f"step_ms_ratio={statistics.median(step_ms['sampled']) / statistics.median(step_ms['plain']):.3f}"
          "  (the timed step alone: sampling is outside it)")
    cost = statistics.median(sample_ms) / every / statistics.median(walls["plain"])
    print(f"amax_sampling_cost_ratio={1 + cost:.4f}  (1 + median sample_ms / {every} / wall ms per step: the same "
          "figure from the measured cost of a sample, steadier than the wall clock on a loaded machine)")
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="bf16-mixed,16-mixed", help="comma-separated modes for numerics_ratio")
    parser.add_argument("--amax-mode", default="16-mixed")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--amax-workload", default="digits_mlp")
    parser.add_argument("--amax-steps", type=int, default=1000)
    parser.add_argument("--amax-pairs", type=int, default=9)
    args = parser.parse_args()

    torch.set_num_threads(1)  # both sides on one thread, so the ratio is not thread-scheduling noise
    # Runs too: a run measures whether one intra-op thread beats the process's count, a choice that noise on a
    # shared machine can tip either way; starting from one thread, every run trains alike.
    runner.PROCESS_THREADS = 1
    ratios = [numerics_ratio(name, mode, args.batch_size, args.repeats)
              for mode in args.modes.split(",") for name in WORKLOADS_TIMED]
    sampling = amax_sampling_ratio(args.amax_workload, args.amax_mode, args.amax_steps, 100, args.amax_pairs)
    print(f"amax_sampling_ratio={sampling:.3f}")
    print(f"numerics_ratio={max(ratios):.2f}")


if __name__ == "__main__":
    main()
