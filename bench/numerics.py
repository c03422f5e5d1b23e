"""Cost of layer numerics: one probe pass against one untraced step, and a run's amax sampling against no sampling.

numerics_ratio: a probe pass (a copy of the model recorded through one forward + backward in fp32 and one in the
mode, every module's ranges measured and compared) against the forward + backward a training step runs (same mode,
same batch), for digits_mlp and tiny_transformer, in the modes with a 16-bit format (the probe's purpose; --modes
adds 32-true). The two are timed alternately (both see the same machine load) and each is summarised by its
fastest run, the least noisy estimate of its cost on a shared machine. Target: <= 10; the figure is the largest.

amax_sampling_ratio: wall time per training step of a run that samples per-layer amax every 100 steps against the
same without, measured inside the sampled runs: the gap between two step records that holds a sample against the
gaps that do not (interleaved at step granularity, so the machine's load hits both alike); the median over runs.
Printed beside it: whole runs with against whole runs without (alternating order; noisy on a loaded machine) and
the same figure from each sample's own measured cost (its event's sample_ms). Target: <= 1.03.
Last line: numerics_ratio=<the largest of the workloads' and modes' ratios>.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/numerics.py` from anywhere

from amp_core.config import RunConfig
from amp_core.probes.numerics import LAYER_AMAX_EVENT, probe_step
from amp_core.race.runner import Run
from bench.trace import one_step, time_ms

WORKLOADS_TIMED = ("digits_mlp", "tiny_transformer")


def numerics_ratio(workload_name: str, mode: str, batch_size: int, repeats: int) -> float:
    step = one_step(workload_name, mode, batch_size)

    def probed() -> None:
        probe_step(step.model, step.precision, step.workload.loss, step.batch)

    times = time_ms({"untraced": step.untraced, "probed": probed}, repeats)
    modules = len(probe_step(step.model, step.precision, step.workload.loss, step.batch).modules)
    ratio = min(times["probed"]) / min(times["untraced"])
    print(f"workload={workload_name} mode={mode} batch={batch_size} module_calls={modules} repeats={repeats}")
    for name, values in times.items():
        print(f"  {name}_ms fastest={min(values):.3f} median={statistics.median(values):.3f}")
    print(f"numerics_ratio_{workload_name}_{mode}={ratio:.2f}")
    return ratio


def run_figures(config: RunConfig) -> dict:
    """A run to its end: its wall ms per step (first to last step record), median step_ms, the samples' sample_ms,
    and the wall time between consecutive step records of its first lane, split by whether a sample fell in it."""
    run = Run(config).start()
    run.join()
    frame, events = run.frame(), run.events()
    if run.status != "finished":
        raise RuntimeError(f"bench run ended {run.status}: {[e.message for e in events][-3:]}")
    samples = [e for e in events if e.kind == LAYER_AMAX_EVENT]
    sampled = {e.step for e in samples}
    lane = frame[frame["lane"] == 0].sort_values("step")
    gaps = lane["t_wall_s"].diff().to_numpy()[1:] * 1e3
    after_sample = lane["step"].to_numpy()[:-1]  # the gap from step s to s + 1 holds the sample taken after step s
    return {"wall_ms": (frame["t_wall_s"].iloc[-1] - frame["t_wall_s"].iloc[0]) * 1e3 / (len(frame) - 1),
            "step_ms": float(frame["step_ms"].median()),
            "sample_ms": [e.data["sample_ms"] for e in samples],
            "gaps_with": [g for g, s in zip(gaps, after_sample, strict=True) if s in sampled],
            "gaps_without": [g for g, s in zip(gaps, after_sample, strict=True) if s not in sampled]}


def amax_sampling_ratio(workload: str, mode: str, steps: int, every: int, pairs: int) -> float:
    """Wall time per step with sampling every `every` steps against without, from the steps of the sampled runs
    themselves: the gaps between step records that hold a sample against those that do not, interleaved at step
    granularity in one process, so machine load hits both alike. Paired runs without sampling are the cross-check."""
    base = RunConfig(workload=workload, modes=(mode,), steps=steps, batch_size=64, device="cpu", gradstats_every=0,
                     intra_op_threads=1)
    sampled_config = RunConfig.from_dict({**base.to_dict(), "amax_every": every})
    run_figures(base)  # warm-up
    plain, sampled = [], []
    for pair in range(pairs):
        # every other pair the other way round, so going second favours neither side
        order = (base, sampled_config) if pair % 2 == 0 else (sampled_config, base)
        for config in order:
            (sampled if config is sampled_config else plain).append(run_figures(config))
    ratios = []
    for figures in sampled:
        typical = statistics.median(figures["gaps_without"])
        extra = statistics.median(figures["gaps_with"]) - typical
        ratios.append(1 + extra / every / typical)
    print(f"workload={workload} mode={mode} steps={steps} amax_every={every} samples_per_run={steps // every} "
          f"runs={pairs} sampled + {pairs} plain, alternating")
    for name, runs in (("plain", plain), ("sampled", sampled)):
        print(f"  {name}: wall_ms_per_step median={statistics.median(r['wall_ms'] for r in runs):.4f} · "
              f"median step_ms {statistics.median(r['step_ms'] for r in runs):.4f}")
    gaps_with = [g for r in sampled for g in r["gaps_with"]]
    gaps_without = [g for r in sampled for g in r["gaps_without"]]
    sample_ms = [ms for r in sampled for ms in r["sample_ms"]]
    print(f"  gap between step records: median {statistics.median(gaps_without):.4f} ms, with a sample "
          f"{statistics.median(gaps_with):.4f} ms; sample_ms median {statistics.median(sample_ms):.3f}")
    wall = (statistics.median(r["wall_ms"] for r in sampled) / statistics.median(r["wall_ms"] for r in plain))
    print(f"amax_sampling_wall_ratio={wall:.3f}  (whole runs against whole runs: at the mercy of the machine's load)")
    step_ms = statistics.median(r["step_ms"] for r in sampled) / statistics.median(r["step_ms"] for r in plain)
    print(f"step_ms_ratio={step_ms:.3f}  (the timed step alone: sampling is outside it)")
    cost = statistics.median(sample_ms) / every / statistics.median(gaps_without)
    print(f"amax_sampling_cost_ratio={1 + cost:.4f}  (1 + median sample_ms / {every} / median gap)")
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
    ratios = [numerics_ratio(name, mode, args.batch_size, args.repeats)
              for mode in args.modes.split(",") for name in WORKLOADS_TIMED]
    sampling = amax_sampling_ratio(args.amax_workload, args.amax_mode, args.amax_steps, 100, args.amax_pairs)
    print(f"amax_sampling_ratio={sampling:.3f}")
    print(f"numerics_ratio={max(ratios):.2f}")


if __name__ == "__main__":
    main()
