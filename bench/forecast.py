"""Forecast quality: how early a planted overflow is seen coming, how close the forecast step is, and how often a
healthy run is warned of nothing.

Planted, fp16: the workshop's growing layer (amp_core.workshop.planted.GrowingPlantedDigits: block 2's output
multiplied by a factor that gains a fixed number of bits per step, undone by the LayerNorm after it) at three rates
(its sizes small / medium / large: 0.04, 0.02 and 0.01 bits per step, fp16 overflowing after some 250, 450 and 850
steps), raced in 16-mixed with layers sampled every --every steps (default 10), across --seeds seeds. The failure is
the lane's first non-finite loss (the planted overflow is in the forward; a step the GradScaler skips for a gradient
overflow is its routine, not this failure); the forecast is the first `forecast` event naming the planted module.

Planted, e4m3: the same rates started as far below e4m3's largest value (448) (planted.GrowingE4m3Digits), raced in
32-true with layers sampled every step. No lane here casts that output to e4m3 unscaled (an FP8 lane's casts are
scaled per tensor by torchao), so the failure is where an unscaled e4m3 cast would overflow: the first step whose
sampled abs max of the planted output passes 448. The forecast is the forecaster's (amp_core.probes.headroom, the one
the race and the Monitor run) fed the samples every --every steps against e4m3's limits: its first forecast of the
planted output reaching e4m3's max. Forecasts of other limits (a gradient heading for e4m3's smallest normal, 2^-6:
the planted layer's own gradient shrinks as its output grows, and unscaled e4m3 would flush it) are real forecasts of
another failure, counted apart (other_limits= per run), not as wrong layers.

Healthy: digits_mlp, mlp_regression and tiny_transformer (--all-workloads adds checkerboard_cnn and the transformers
ones) in 16-mixed and bf16-mixed for --healthy-steps steps (default 300) across the seeds, and digits_mlp (with
--all-workloads every one of them) once for --long-steps (default 2000: a trend that only shows late). Any
`forecast` event there is a false alarm.

Prints per run lines, then: wrong_layer= (forecasts naming another layer before a planted failure), per format
fp16_lead_steps_min= / e4m3_lead_steps_min=, then over both lead_steps_min= (the shortest warning; goal >= 100),
lead_error_median= (|predicted - actual failure step| / the steps the warning came ahead; goal <= 0.3), missed=
(planted failures with no forecast before them; goal 0) and, last, false_alarms_per_1k_steps= (on healthy lanes; goal
0). Default runtime: about five minutes on two quiet cores.
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
from amp_core.probes.headroom import FORECAST_EVENT, FORMAT_LIMITS, LaneHeadroom
from amp_core.probes.numerics import LAYER_AMAX_EVENT
from amp_core.race.runner import Run
from amp_core.workshop import planted

PLANTED_STEPS = {"small": 400, "medium": 700, "large": 1300}
"""Steps a planted run may take: well past its failure (the lane stops at the failure)."""
E4M3 = "fp8 e4m3fn"
HEALTHY = ("digits_mlp", "mlp_regression", "tiny_transformer")
LONG = ("digits_mlp",)
"""The long healthy run's workloads (--all-workloads: every healthy one)."""
MORE = ("checkerboard_cnn", "gpt2", "llama", "bert", "vit")
"""With --all-workloads (checkerboard_cnn's fp16 convolutions take seconds a step on a CPU without fp16 math)."""


def first_failure(frame) -> int | None:
    failed = frame[~frame["loss"].map(math.isfinite)]
    return int(failed["step"].min()) if len(failed) else None


def _lead(out: dict, failure: int | None, told_step: int | None, predicted: int | None) -> dict:
    if failure is not None and told_step is not None:
        ahead = failure - told_step
        out |= {"forecast_at": told_step, "predicted": predicted, "lead": ahead,
                "error": abs(predicted - failure) / max(ahead, 1)}
    return out


def planted_run(size: str, seed: int, every: int) -> dict:
    config = RunConfig(workload=planted.GrowingPlantedDigits.name, size=size, modes=("16-mixed",),
                       steps=PLANTED_STEPS[size], amax_every=every, seed=seed, device="cpu", intra_op_threads=1)
    run = Run(config).start()
    run.join()
    failure = first_failure(run.frame())
    told = [e for e in run.events() if e.kind == FORECAST_EVENT and (failure is None or e.step < failure)]
    right = [e for e in told if e.data["module"] == planted.GROWING_MODULE]
    out = {"format": "fp16", "size": size, "seed": seed, "failure": failure, "wrong_layer": len(told) - len(right)}
    first = right[0] if right else None
    return _lead(out, failure, first and first.step, first and first.data["predicted_step"])


def e4m3_run(size: str, seed: int, every: int) -> dict:
    """The e4m3 case: every step sampled (the crossing), every `every`-th sample fed to the forecaster."""
    config = RunConfig(workload=planted.GrowingE4m3Digits.name, size=size, modes=("32-true",),
                       steps=PLANTED_STEPS[size], amax_every=1, seed=seed, device="cpu", intra_op_threads=1)
    run = Run(config).start()
    run.join()
    samples = sorted((e for e in run.events() if e.kind == LAYER_AMAX_EVENT), key=lambda e: e.step)
    limit = FORMAT_LIMITS[E4M3].max
    failure = None
    for event in samples:
        amax = dict(zip(event.data["modules"], event.data["output_amax"], strict=False))[planted.GROWING_MODULE]
        if isinstance(amax, str) or amax >= limit:
            failure = event.step
            break
    headroom, told = LaneHeadroom(), None
    wrong: set[str] = set()
    other_limits: set[tuple[str, str, str]] = set()
    for event in samples:
        if event.step % every or (failure is not None and event.step >= failure):
            continue
        headroom.add(event.step, event.data)
        for forecast in headroom.forecasts([E4M3]):
            if forecast.tensor != "output" or forecast.limit != "max":
                other_limits.add((forecast.module, forecast.tensor, forecast.limit))
            elif forecast.module != planted.GROWING_MODULE:
                wrong.add(forecast.module)
            elif told is None:
                told = (event.step, forecast.predicted_step)
    out = {"format": "e4m3", "size": size, "seed": seed, "failure": failure, "wrong_layer": len(wrong),
           "other_limits": len(other_limits)}
    return _lead(out, failure, told and told[0], told and told[1])


def healthy_run(workload: str, seed: int, steps: int, every: int) -> tuple[int, int, list[str]]:
    """(lane steps, forecast events, their messages)."""
    config = RunConfig(workload=workload, modes=("16-mixed", "bf16-mixed"), steps=steps, amax_every=every,
                       seed=seed, device="cpu", intra_op_threads=1)
    run = Run(config).start()
    run.join()
    told = [e for e in run.events() if e.kind == FORECAST_EVENT]
    return len(run.frame()), len(told), [f"lane {e.lane} step {e.step}: {e.message}" for e in told]


def _figures(prefix: str, results: list[dict]) -> tuple[list[int], list[float], int]:
    failed = [r for r in results if r["failure"] is not None]
    leads = [r["lead"] for r in failed if "lead" in r]
    print(f"{prefix}lead_steps_min={min(leads) if leads else 'none'}")
    return leads, [r["error"] for r in failed if "error" in r], len(failed) - len(leads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--healthy-steps", type=int, default=300)
    parser.add_argument("--long-steps", type=int, default=2000, help="the long healthy runs' steps (0: none)")
    parser.add_argument("--all-workloads", action="store_true")
    args = parser.parse_args(argv)
    planted.register()
    started = time.perf_counter()
    results = []
    for one in (planted_run, e4m3_run):
        for size in PLANTED_STEPS:
            for seed in range(args.seeds):
                result = one(size, seed, args.every)
                results.append(result)
                print("planted " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in result.items()), flush=True)
    steps = alarms = 0
    healthy = [(workload, seed, args.healthy_steps) for workload in HEALTHY + (MORE if args.all_workloads else ())
               for seed in range(args.seeds)]
    long_runs = HEALTHY + MORE if args.all_workloads else LONG
    healthy += [(workload, 0, args.long_steps) for workload in long_runs if args.long_steps]
    for workload, seed, length in healthy:
        lane_steps, told, messages = healthy_run(workload, seed, length, args.every)
        steps, alarms = steps + lane_steps, alarms + told
        print(f"healthy {workload} seed {seed} ({length} steps): {lane_steps} lane steps, {told} forecasts",
              flush=True)
        for message in messages:
            print(f"  {message}")
    print(f"planted_runs={len(results)} failed={sum(r['failure'] is not None for r in results)} "
          f"healthy_lane_steps={steps}")
    print(f"runtime_s={time.perf_counter() - started:.0f}")
    print(f"wrong_layer={sum(r['wrong_layer'] for r in results)}")
    _figures("fp16_", [r for r in results if r["format"] == "fp16"])
    _figures("e4m3_", [r for r in results if r["format"] == "e4m3"])
    _, errors, missed = _figures("", results)
    print(f"lead_error_median={statistics.median(errors):.3f}" if errors else "lead_error_median=none")
    print(f"missed={missed}")
    print(f"false_alarms_per_1k_steps={1000 * alarms / max(steps, 1):.3f}")


if __name__ == "__main__":
    main()
