"""Forecast quality: how early a planted overflow is seen coming, how close the forecast step is, and how often a
healthy run is warned of nothing.

Planted: the workshop's growing layer (amp_core.workshop.planted.GrowingPlantedDigits: block 2's output multiplied by
a factor that gains a fixed number of bits per step, undone by the LayerNorm after it) at three rates (its sizes
small / medium / large: 0.04, 0.02 and 0.01 bits per step, fp16 overflowing after some 250, 450 and 850 steps),
raced in 16-mixed with layers sampled every --every steps (default 10), across --seeds seeds. The failure is the
lane's first non-finite loss (the planted overflow is in the forward; a step the GradScaler skips for a gradient
overflow is its routine, not this failure); the forecast is the first `forecast` event naming the planted module.
(e4m3 is in the format table, but no lane here casts to it unscaled: an FP8 lane's casts are scaled per tensor by
torchao, so its raw e4m3 headroom is not what breaks it.)

Healthy: digits_mlp, mlp_regression and tiny_transformer (--all-workloads adds checkerboard_cnn and the transformers
ones) in 16-mixed and bf16-mixed for --healthy-steps steps (default 300; the full figure is
`python3 -m bench.forecast --healthy-steps 2000 --all-workloads --seeds 3`). Any `forecast` event there is a false
alarm.

Prints per run lines, then: wrong_layer= (forecasts naming another layer before a planted failure),
lead_steps_min= (the shortest warning; goal >= 100), lead_error_median= (|predicted - actual failure step| / the
steps the warning came ahead; goal <= 0.3), missed= (planted failures with no forecast before them; goal 0) and,
last, false_alarms_per_1k_steps= (on healthy lanes; goal 0).
Default runtime: a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/forecast.py` from anywhere

from amp_core.config import RunConfig
from amp_core.probes.headroom import FORECAST_EVENT
from amp_core.race.runner import Run
from amp_core.workshop import planted

PLANTED_STEPS = {"small": 400, "medium": 700, "large": 1300}
"""Steps a planted run may take: well past its failure (the lane stops at the failure)."""
HEALTHY = ("digits_mlp", "mlp_regression", "tiny_transformer")
MORE = ("checkerboard_cnn", "gpt2", "llama", "bert", "vit")
"""With --all-workloads (checkerboard_cnn's fp16 convolutions take seconds a step on a CPU without fp16 math)."""


def first_failure(frame) -> int | None:
    failed = frame[~frame["loss"].map(math.isfinite)]
    return int(failed["step"].min()) if len(failed) else None


def planted_run(size: str, seed: int, every: int) -> dict:
    config = RunConfig(workload=planted.GrowingPlantedDigits.name, size=size, modes=("16-mixed",),
                       steps=PLANTED_STEPS[size], amax_every=every, seed=seed, device="cpu", intra_op_threads=1)
    run = Run(config).start()
    run.join()
    failure = first_failure(run.frame())
    told = [e for e in run.events() if e.kind == FORECAST_EVENT and (failure is None or e.step < failure)]
    right = [e for e in told if e.data["module"] == planted.GROWING_MODULE]
    out = {"size": size, "seed": seed, "failure": failure, "wrong_layer": len(told) - len(right)}
    if failure is not None and right:
        first = right[0]
        ahead = failure - first.step
        out |= {"forecast_at": first.step, "predicted": first.data["predicted_step"], "lead": ahead,
                "error": abs(first.data["predicted_step"] - failure) / max(ahead, 1)}
    return out


def healthy_run(workload: str, seed: int, steps: int, every: int) -> tuple[int, int, list[str]]:
    """(lane steps, forecast events, their messages)."""
    config = RunConfig(workload=workload, modes=("16-mixed", "bf16-mixed"), steps=steps, amax_every=every,
                       seed=seed, device="cpu", intra_op_threads=1)
    run = Run(config).start()
    run.join()
    told = [e for e in run.events() if e.kind == FORECAST_EVENT]
    return len(run.frame()), len(told), [f"lane {e.lane} step {e.step}: {e.message}" for e in told]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--healthy-steps", type=int, default=300)
    parser.add_argument("--all-workloads", action="store_true")
    args = parser.parse_args(argv)
    planted.register()
    started = time.perf_counter()
    results = []
    for size in PLANTED_STEPS:
        for seed in range(args.seeds):
            result = planted_run(size, seed, args.every)
            results.append(result)
            print(f"planted {size} seed {seed}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                             for k, v in result.items()), flush=True)
    steps = alarms = 0
    for workload in HEALTHY + (MORE if args.all_workloads else ()):
        for seed in range(args.seeds):
            lane_steps, told, messages = healthy_run(workload, seed, args.healthy_steps, args.every)
            steps, alarms = steps + lane_steps, alarms + told
            print(f"healthy {workload} seed {seed}: {lane_steps} lane steps, {told} forecasts", flush=True)
            for message in messages:
                print(f"  {message}")
    failed = [r for r in results if r["failure"] is not None]
    leads = [r["lead"] for r in failed if "lead" in r]
    print(f"planted_runs={len(results)} failed={len(failed)} healthy_lane_steps={steps}")
    print(f"runtime_s={time.perf_counter() - started:.0f}")
    print(f"wrong_layer={sum(r['wrong_layer'] for r in results)}")
    print(f"lead_steps_min={min(leads) if leads else 'none'}")
    print(f"lead_error_median={statistics.median(r['error'] for r in failed if 'error' in r):.3f}" if leads
          else "lead_error_median=none")
    print(f"missed={len(failed) - len(leads)}")
    print(f"false_alarms_per_1k_steps={1000 * alarms / max(steps, 1):.3f}")


if __name__ == "__main__":
    main()
