"""The workshop's "Does compile change the answer?": eager and compiled lanes of one mode race from the same weights
and batches; the checks read the records as they are on this device — compiled against eager speed (a paired
interval that says "cannot tell here" when it includes 1x, whatever this machine's speed), drift of the loss, and
compile time kept out of the step times."""

from __future__ import annotations

import math

import numpy as np

from amp_core.race.compiled import COMPILED_EVENT
from amp_core.workshop.evidence import Evidence, Waiting
from amp_core.workshop.speed import INTERVAL_Z, MIN_STEPS, WARMUP_STEPS, SpeedRatio, _cannot_decide
from amp_core.workshop.verdicts import CannotTell

EAGER_LANE = "bf16-mixed"
COMPILED_LANE = "bf16-mixed+compile"
MODES = ("32-true", EAGER_LANE, COMPILED_LANE)
DRIFT_MATCH = 0.05
"""Compiled and eager agree when the median |relative loss difference| per step is within this (as FP8 vs bf16)."""


def compiled_vs_eager(evidence: Evidence) -> SpeedRatio:
    """The compiled lane's speed over the eager lane's: per step, eager's step time over compiled's (the same step,
    so the machine's load hits both), the warm-up left out; the median and its 95% interval (order statistics)."""
    part = evidence.part(0)
    eager, compiled = part.lane(EAGER_LANE, at_least=MIN_STEPS), part.lane(COMPILED_LANE, at_least=MIN_STEPS)
    paired = eager[["step", "step_ms"]].merge(compiled[["step", "step_ms"]], on="step", suffixes=("_eager", "_comp"))
    paired = paired[paired["step"] >= WARMUP_STEPS]
    ratios = np.sort((paired["step_ms_eager"] / paired["step_ms_comp"]).to_numpy(dtype=float))
    ratios = ratios[np.isfinite(ratios)]
    count = len(ratios)
    if count == 0:
        raise Waiting(f"{MIN_STEPS} paired steps of {EAGER_LANE} and {COMPILED_LANE}")
    spread = INTERVAL_Z * math.sqrt(count) / 2
    low_rank, high_rank = max(1, math.floor(count / 2 - spread)), min(count, math.ceil(1 + count / 2 + spread))
    return SpeedRatio(float(np.median(ratios)), float(ratios[low_rank - 1]), float(ratios[high_rank - 1]), count)


def speed_told(evidence: Evidence) -> tuple[bool, str, str]:
    """Held when the interval decides it either way (faster or slower is this device's answer, not a failure); cannot
    tell here when the interval includes 1x."""
    ratio = compiled_vs_eager(evidence)
    figure = f"{COMPILED_LANE} vs {EAGER_LANE}: {ratio.text()}"
    if ratio.low <= 1 <= ratio.high:
        raise CannotTell(figure, _cannot_decide("its interval includes 1×"))
    verdict = "faster" if ratio.low > 1 else "slower"
    return True, figure, f"Compiled is {verdict} than eager here, at this size: a measured answer for this device."


def drift(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    eager, compiled = part.lane(EAGER_LANE, at_least=MIN_STEPS), part.lane(COMPILED_LANE, at_least=MIN_STEPS)
    base = part.lane("32-true", at_least=MIN_STEPS)
    joined = eager[["step", "loss"]].merge(compiled[["step", "loss"]], on="step", suffixes=("_eager", "_comp")).merge(
        base[["step", "loss"]].rename(columns={"loss": "loss_fp32"}), on="step")
    with np.errstate(divide="ignore", invalid="ignore"):
        vs_eager = np.abs((joined["loss_comp"] - joined["loss_eager"]) / joined["loss_eager"].abs()).to_numpy(float)
        vs_fp32 = np.abs((joined["loss_comp"] - joined["loss_fp32"]) / joined["loss_fp32"].abs()).to_numpy(float)
        eager_fp32 = np.abs((joined["loss_eager"] - joined["loss_fp32"]) / joined["loss_fp32"].abs()).to_numpy(float)
    median = float(np.nanmedian(vs_eager))
    held = median <= DRIFT_MATCH
    figure = (f"median |drift| vs eager {median:.2%} (largest {np.nanmax(vs_eager):.2%}) over {len(joined)} steps; "
              f"vs 32-true: compiled {np.nanmedian(vs_fp32):.2%}, eager {np.nanmedian(eager_fp32):.2%}")
    return held, figure, "" if held else (
        "The compiled lane drifted from eager: inductor fuses casts and may round a fused chain once (pytorch#150638);"
        " look at the op inspector's compiled view, and race seeds to tell drift from noise.")


def compile_time_apart(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    compiled = part.lane(COMPILED_LANE, at_least=1)
    if evidence.reader is None:
        raise Waiting("the run's events")
    lane = part.lane_index(COMPILED_LANE)
    events = evidence.reader.events(part.run_id)
    compiles = events[(events["kind"] == COMPILED_EVENT) & (events["lane"] == lane)] if len(events) else events
    if not len(compiles):
        if part.lane_info(COMPILED_LANE).status == "failed":
            return False, f"{COMPILED_LANE} failed: {part.lane_info(COMPILED_LANE).error}", ""
        raise Waiting(f"the {COMPILED_LANE} lane's compile")
    data = compiles.iloc[0]["data"]
    compile_ms, slowest = float(data["compile_ms"]), float(compiled["step_ms"].max())
    held = slowest < compile_ms
    figure = (f"compiled in {compile_ms / 1e3:.2f} s ({data.get('graphs')} graph(s), {data.get('graph_breaks')} "
              f"graph break(s)); slowest step {slowest:.2f} ms")
    return held, figure, "" if held else "A step took longer than the compile: it may hold a recompile (see events)."
