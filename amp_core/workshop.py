"""Workshop scenarios: prepared races that make one point each, launched through the RunManager, and checks that read
the run's own records to say whether the point showed on this device.

A check states its expectation, measures it from the records (step records, lane statuses, gradient statistics;
for the op policy one traced step of the run's lane) and, when it does not hold, says why in words that do not
mislead. Nothing here hard-codes an outcome: where the answer depends on the device (is mixed precision faster?) the
expectation is derived from what the device has (native 16-bit math or not), and the figure is whatever the run
measured.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from amp_core import background
from amp_core.config import FaultSpec, RunConfig, ScalerConfig
from amp_core.precision import cpu_has_native, resolve_device
from amp_core.probes.gradstats import combine

FINAL_WINDOW = 20
"""A lane's final loss: the mean of its last this many finite losses."""
WARMUP_STEPS = 3
"""Steps left out of a lane's median step time (first-call allocations, caches)."""
LOSS_MATCH = 0.05
"""16-mixed "keeps up" when its final loss is within this fraction of 32-true's."""
STALL_GAP = 0.10
"""A lane "stalls" when its final loss ends this fraction or more above 32-true's."""


class Waiting(Exception):
    """A check cannot be measured yet: the records it reads are not there (the message says which)."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check of a scenario, measured from a run's records."""

    title: str
    """What is checked, in a few words."""
    held: bool
    """The expectation held in the records read."""
    figure: str
    """What was measured, as text ("3 of 3 spike steps skipped")."""
    expectation: str
    """What the check expects, and why."""
    explanation: str = ""
    """Why it did not hold (or what the figure does not mean), in words that do not mislead."""
    final: bool = True
    """The runs have ended: the figure no longer changes (False: measured so far)."""
    waiting: bool = False
    """The records it needs were not there (yet)."""

    @property
    def mark(self) -> str:
        return "✓" if self.held else "✗"


@dataclass(frozen=True, slots=True)
class Check:
    """A check of a scenario: a title, the expectation, and how to measure it."""

    title: str
    expectation: str
    measure: Callable[[Evidence], tuple[bool, str, str]]
    """evidence -> (held, figure, explanation); raises Waiting when the records are not there yet."""

    def evaluate(self, evidence: Evidence) -> CheckResult:
        try:
            held, figure, explanation = self.measure(evidence)
        except Waiting as waiting:
            why = f"the run ended before {waiting}" if evidence.ended else f"waiting for {waiting}"
            return CheckResult(self.title, False, why, self.expectation, why if evidence.ended else "",
                               final=evidence.ended, waiting=True)
        return CheckResult(self.title, bool(held), figure, self.expectation, explanation, final=evidence.ended)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A prepared race that makes one point, with the checks that say whether the point showed."""

    name: str
    """Short name for the CLI (`workshop run NAME`)."""
    title: str
    """The question it answers, as a room reads it."""
    watch: str
    """Two sentences: what to watch on the charts."""
    caveat: str
    """What the charts do not mean (shown next to them)."""
    build: Callable[[str], tuple[RunConfig, ...]]
    """device ('cpu' | 'cuda') -> the runs to launch, one after another (sizes that finish within a minute on a
    2-core CPU; larger ones on a GPU where the point needs them)."""
    checks: tuple[Check, ...]
    """What the records must show."""
    table: Callable[[Evidence], pd.DataFrame] | None = None
    """A table the scenario shows beside its checks (per-layer lost updates, the per-op table), or None."""
    table_title: str = ""
    """What the table is."""
    charts: tuple[str, ...] = ("loss", "scale")
    """Which of the Train page's charts tell the story (keys of views.plots.train_figures)."""

    def configs(self, device: str = "auto") -> tuple[RunConfig, ...]:
        """The runs for `device` ('auto': CUDA when there is a GPU, else the CPU)."""
        device = resolve_device(device)
        return self.build("cuda" if device.startswith("cuda") else "cpu")


# --- evidence: what a scenario's runs recorded ------------------------------------------------------------------
@dataclass(slots=True)
class Part:
    """One run of a scenario as its records stand."""

    run_id: str
    config: RunConfig
    info: dict
    """RunManager.run_info: status, lanes (status, error)."""
    steps: pd.DataFrame
    """Every step record of the run so far."""

    def lane_index(self, mode: str) -> int:
        for lane in self.info["lanes"]:
            if lane["mode"] == mode:
                return int(lane["lane"])
        raise KeyError(f"run {self.run_id} has no {mode} lane")

    def lane_status(self, mode: str) -> dict:
        return next(lane for lane in self.info["lanes"] if lane["mode"] == mode)

    def lane(self, mode: str, *, at_least: int = 1) -> pd.DataFrame:
        """The lane's step records by step; Waiting until it has `at_least` of them (a lane that diverged or failed
        has what it has: its early end is what a check reads)."""
        frame = self.steps[self.steps["lane"] == self.lane_index(mode)].sort_values("step").reset_index(drop=True)
        ended_early = self.lane_status(mode)["status"] in ("diverged", "failed")
        if len(frame) < at_least and not (ended_early and len(frame)):
            raise Waiting(f"{at_least} steps of {mode}")
        return frame


@dataclass(slots=True)
class Evidence:
    """A scenario's runs read through a RunManager: each part's config, status and step records; gradient statistics
    on demand."""

    manager: object
    parts: list[Part]
    expected_parts: int
    ended: bool
    """Every run of the scenario has ended (and none is still to start)."""

    def part(self, index: int) -> Part:
        if index >= len(self.parts):
            raise Waiting(f"run {index + 1} of {self.expected_parts} to start")
        return self.parts[index]

    def grad_stats(self, part: Part, mode: str) -> list[tuple[int, list]]:
        """(step, [GradStats per parameter]) of a lane's sampled steps, in step order."""
        lane = part.lane_index(mode)
        return [(step, self.manager.grad_stats(part.run_id, lane, step))
                for step in self.manager.grad_stat_steps(part.run_id, lane)]


def gather(manager, run_ids: list[str], expected_parts: int | None = None, going: bool | None = None) -> Evidence:
    """The evidence of runs `run_ids` (a scenario's, in order) as the manager holds them now. `going` says whether
    more is to come (a ScenarioLaunch knows: a run still to start, or none when it was stopped); by default, whether
    any of the runs is still going or fewer than `expected_parts` exist."""
    parts = []
    for run_id in run_ids:
        info = manager.run_info(run_id)
        if info is None:
            continue
        steps = manager.steps(run_id)  # after the status: a run it calls ended has every record here
        parts.append(Part(run_id, RunConfig.from_dict(info["config"]), info, steps))
    expected = len(run_ids) if expected_parts is None else expected_parts
    if going is None:
        going = len(parts) < expected or any(p.info["live"] or p.info["status"] in ("pending", "running", "paused")
                                             for p in parts)
    return Evidence(manager, parts, expected, ended=not going)


def evaluate(scenario: Scenario, evidence: Evidence) -> list[CheckResult]:
    """Every check of the scenario against the evidence."""
    return [check.evaluate(evidence) for check in scenario.checks]


# --- reading figures from records -------------------------------------------------------------------------------
def final_loss(lane: pd.DataFrame, window: int = FINAL_WINDOW) -> float:
    """Mean of the lane's last `window` finite losses (NaN when none is finite)."""
    losses = lane["loss"].to_numpy(dtype=float)
    finite = losses[np.isfinite(losses)]
    return float(finite[-window:].mean()) if finite.size else math.nan


def median_ms(lane: pd.DataFrame) -> float:
    """The lane's median step time, its first WARMUP_STEPS steps left out."""
    times = lane.loc[lane["step"] >= WARMUP_STEPS, "step_ms"].to_numpy(dtype=float)
    return float(np.median(times)) if times.size else math.nan


def power_of_two(value: float) -> str:
    """65536 -> '2^16'; other values as they are."""
    if not (value > 0 and math.isfinite(value)):
        return f"{value:g}"
    exponent = math.log2(value)
    return f"2^{int(exponent)}" if exponent.is_integer() else f"{value:.3g}"


def fault_of(config: RunConfig, kind: str) -> FaultSpec:
    for fault in config.faults:
        if fault.kind == kind:
            return fault
    raise KeyError(f"the run has no {kind} fault")


def scale_at(lane: pd.DataFrame, step: int) -> float:
    row = lane[lane["step"] == step]
    if row.empty:
        raise Waiting(f"step {step}")
    return float(row["scale"].iat[0])


def first_nonfinite(lane: pd.DataFrame) -> tuple[int, float] | None:
    bad = lane[~np.isfinite(lane["loss"].to_numpy(dtype=float))]
    return None if bad.empty else (int(bad["step"].iat[0]), float(bad["loss"].iat[0]))


def diverged(part: Part, lane: pd.DataFrame, mode: str) -> bool:
    return part.lane_status(mode)["status"] == "diverged" or first_nonfinite(lane) is not None


def native_16bit(dtype: torch.dtype, device: str) -> tuple[bool, str]:
    """(has native math, in words) for fp16/bf16 on `device`: tensor cores on a GPU, AVX-512/AMX on a CPU."""
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return False, "no GPU here"
        major, minor = torch.cuda.get_device_capability()
        need = (8, 0) if dtype == torch.bfloat16 else (7, 0)
        ok = (major, minor) >= need
        return ok, (f"this GPU (compute capability {major}.{minor}) has {name} tensor cores" if ok else
                    f"this GPU (compute capability {major}.{minor}) has no {name} tensor cores")
    if cpu_has_native(dtype):
        return True, f"this CPU has native {name} instructions"
    return False, f"this CPU has no native {name} math (it converts to fp32 and back)"


# --- the checks -------------------------------------------------------------------------------------------------
def _mixed_keeps_up(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    ref, mixed = final_loss(part.lane("32-true", at_least=FINAL_WINDOW)), final_loss(
        part.lane("16-mixed", at_least=FINAL_WINDOW))
    gap = mixed / ref - 1
    held = abs(gap) <= LOSS_MATCH
    figure = f"final loss: 16-mixed {mixed:.4g}, 32-true {ref:.4g} ({gap:+.1%})"
    why = "" if held else ("16-mixed ended farther from 32-true than expected: look at its skipped steps on the scale "
                           "chart (a skipped step is a step not taken).")
    return held, figure, why


def _pure_fp16_fails(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    lane = part.lane("16-true", at_least=FINAL_WINDOW)
    if diverged(part, lane, "16-true"):
        bad = first_nonfinite(lane)
        at = f"its loss became {bad[1]} at step {bad[0]}" if bad else "it stopped"
        error = part.lane_status("16-true")["error"]
        cause = error.split(" — ", 1)[1] if " — " in error else ""
        return True, f"16-true diverged: {at}", (f"Why: {cause}. fp16's tiny range underflows (squared gradients, "
                                                 "eps) where fp32 master weights and optimizer state would not." if
                                                 cause else "")
    ref = final_loss(part.lane("32-true", at_least=FINAL_WINDOW))
    gap = final_loss(lane) / ref - 1
    held = gap >= STALL_GAP
    figure = f"16-true final loss {final_loss(lane):.4g} vs 32-true {ref:.4g} ({gap:+.1%})"
    return held, figure, "" if held else ("16-true trained about as well as 32-true here: with this optimizer and LR "
                                          "its updates were large enough for fp16 weights to hold. Smaller ones (a "
                                          "lower LR, later in training) round away: see \"Pure 16-bit weights lose "
                                          "updates\".")


def _scale_lifts_underflow(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    sampled = [(step, stats) for step, stats in evidence.grad_stats(part, "16-mixed") if stats]
    if not sampled:
        raise Waiting("the first gradient statistics of 16-mixed")
    step, stats = sampled[-1]
    whole = combine(stats)
    lost = {label: whole.fractions.get(f"fp16.zero.{label}", 0.0) + whole.fractions.get(f"fp16.subnormal.{label}",
                                                                                             0.0)
            for label in ("unscaled", "scaled")}
    held = lost["unscaled"] >= 0.01 and lost["scaled"] <= lost["unscaled"] / 10
    figure = (f"step {step}: without the scale {lost['unscaled']:.1%} of the gradient's non-zero values would be "
              f"subnormal or 0 in fp16; times the scale {power_of_two(whole.scale)}: {lost['scaled']:.2%}")
    why = "" if held else ("This model's gradients sit well inside fp16's normal range here, so scaling has little "
                           "to rescue; the scaler matters once gradients get small (later in training, deeper "
                           "models).")
    return held, figure, why


def _spike_window(part: Part) -> tuple[int, int]:
    fault = fault_of(part.config, "loss_scale")
    return fault.step, fault.step + fault.duration


def _spike_hits_every_lane(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    start, _ = _spike_window(part)
    jumps = {}
    for mode in part.config.modes:
        lane = part.lane(mode, at_least=start + 1)
        before = lane.loc[(lane["step"] < start) & (lane["step"] >= start - 10), "loss"].median()
        jumps[mode] = float(lane.loc[lane["step"] == start, "loss"].iat[0]) / before
    held = all(jump >= 1000 for jump in jumps.values())
    figure = "loss at the spike vs the 10 steps before: " + ", ".join(f"{mode} ×{jump:.3g}"
                                                                      for mode, jump in jumps.items())
    return held, figure, "" if held else "A lane's recorded loss did not jump with the injected spike."


def _no_skips(mode: str) -> Callable[[Evidence], tuple[bool, str, str]]:
    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        part = evidence.part(0)
        _, end = _spike_window(part)
        lane = part.lane(mode, at_least=end + 1)
        skipped = int(lane["skipped"].sum())
        return skipped == 0, f"{mode}: {skipped} of {len(lane)} steps skipped", "" if skipped == 0 else (
            f"{mode} skipped steps: it has no GradScaler, so something else is wrong; see the Overflow debugger.")
    return measure


def _spike_skipped(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    start, end = _spike_window(part)
    lane = part.lane("16-mixed", at_least=end)
    window = lane[(lane["step"] >= start) & (lane["step"] < end)]
    skipped = int(window["skipped"].sum())
    held = skipped == end - start
    return held, f"16-mixed skipped {skipped} of the {end - start} spike steps", "" if held else (
        "The scale had fallen so low that a spike step no longer overflowed fp16: that step was taken, spike and all.")


def _backoff(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    start, end = _spike_window(part)
    lane = part.lane("16-mixed", at_least=end + 1)
    before, after = scale_at(lane, start), scale_at(lane, end)
    skipped = int(lane[(lane["step"] >= start) & (lane["step"] < end)]["skipped"].sum())
    factor = part.config.scaler.backoff_factor
    expected = before * factor**skipped
    held = skipped > 0 and after == expected
    figure = f"scale {power_of_two(before)} before the spike → {power_of_two(after)} after {skipped} skipped steps"
    return held, figure, "" if held else (f"Expected {power_of_two(expected)}: one back-off (×{factor:g}) per skipped "
                                          "step.")


def _regrowth(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    start, end = _spike_window(part)
    lane = part.lane("16-mixed", at_least=end + 1)
    before = scale_at(lane, start)
    skipped = int(lane[(lane["step"] >= start) & (lane["step"] < end)]["skipped"].sum())
    interval = part.config.scaler.growth_interval
    back = lane[(lane["step"] >= end) & (lane["scale"] >= before)]
    if back.empty:
        if not evidence.ended:
            raise Waiting(f"the scale to climb back to {power_of_two(before)}")
        return False, f"the scale stayed below {power_of_two(before)} to the end", (
            f"It needs about {skipped} × {interval} clean steps to climb back; the run ended first, or the scale kept "
            "overflowing on its own.")
    step = int(back["step"].iat[0])
    return True, (f"back at {power_of_two(before)} at step {step}, {step - end} steps after the spike "
                  f"({skipped} halvings × growth interval {interval} = {skipped * interval} clean steps expected)"), ""


def _lost_fraction(evidence: Evidence, part: Part, mode: str) -> tuple[float, dict[str, float]]:
    """(whole-model lost-update fraction averaged over sampled steps, per-parameter averages)."""
    sampled = [stats for _, stats in evidence.grad_stats(part, mode) if stats]
    whole = [combine(stats).lost_update_fraction for stats in sampled]
    whole = [value for value in whole if value is not None]
    if not whole:
        raise Waiting(f"gradient statistics of {mode}")
    per_param: dict[str, list[float]] = {}
    for stats in sampled:
        for item in stats:
            if item.lost_update_fraction is not None:
                per_param.setdefault(item.param, []).append(item.lost_update_fraction)
    return float(np.mean(whole)), {name: float(np.mean(values)) for name, values in per_param.items()}


def _loses_updates(mode: str, at_least: float) -> Callable[[Evidence], tuple[bool, str, str]]:
    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        part = evidence.part(0)
        whole, layers = _lost_fraction(evidence, part, mode)
        worst = max(layers, key=layers.get)
        held = whole >= at_least
        return held, f"{mode}: {whole:.1%} of updates lost (most in {worst}: {layers[worst]:.1%})", "" if held else (
            f"Fewer updates rounded away than expected: this LR's steps are large next to {mode}'s spacing here.")
    return measure


def _more_bits_fewer_losses(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    bf16, _ = _lost_fraction(evidence, part, "bf16-true")
    fp16, _ = _lost_fraction(evidence, part, "16-true")
    held = bf16 > fp16
    return held, f"bf16-true {bf16:.1%} vs 16-true {fp16:.1%} of updates lost", "" if held else (
        "fp16 lost as many updates as bf16 here: its weights sat where its spacing is as coarse (or its gradients "
        "underflowed to 0, which counts as no update, not a lost one).")


def _fp32_keeps_updates(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    whole, _ = _lost_fraction(evidence, part, "32-true")
    held = whole < 0.01
    return held, f"32-true: {whole:.2%} of updates lost", "" if held else (
        "Even fp32 rounded updates away: the LR is tiny next to the weights.")


def lost_update_table(evidence: Evidence) -> pd.DataFrame:
    """Per parameter (rows) and mode (columns): the share of its updates rounded away, averaged over sampled steps."""
    part = evidence.part(0)
    columns = {}
    for mode in part.config.modes:
        try:
            columns[mode] = _lost_fraction(evidence, part, mode)[1]
        except Waiting:
            continue
    table = pd.DataFrame(columns)
    table.index.name = "parameter"
    return table.reset_index()


@functools.lru_cache(maxsize=4)
def _autocast_rows(device: str) -> tuple[dict, ...]:
    from amp_core.probes.optrace import autocast_demo

    return tuple(autocast_demo(device))


def _autocast_result(expression: str) -> Callable[[Evidence], tuple[bool, str, str]]:
    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        device = evidence.part(0).config.device
        rows = [row for row in _autocast_rows(device) if row["expression"] == expression and row["y"] == "float32"]
        results = {row["autocast"]: row["result"] for row in rows}
        if expression == "x + y":
            held = all(result == "float32" for result in results.values())
        else:
            held = all(result == autocast for autocast, result in results.items())
        figure = "; ".join(f"under {autocast} autocast: {expression} → {result}" for autocast, result in
                           results.items())
        return held, figure, "" if held else f"This torch build's autocast policy for {expression} differs here."
    return measure


@functools.lru_cache(maxsize=16)
def step_trace(workload: str, mode: str, size: str, device: str, seed: int, batch_size: int):
    """One traced step of a run's lane: its initial weights and first batch (the run's seed), forward + backward."""
    from amp_core.probes.optrace import trace_workload

    return trace_workload(workload, mode, size=size, device=device, seed=seed, batch_size=batch_size)


def _trace_of(part: Part, mode: str):
    config = part.config
    return step_trace(config.workload, mode, config.size, resolve_device(config.device), config.seed,
                      config.batch_size)


def _step_policy(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    parts, held = [], True
    for mode in (m for m in part.config.modes if m.endswith("-mixed")):
        trace = _trace_of(part, mode)
        summary = trace.summary()
        frame = trace.to_frame()
        loss_ops = frame[(frame["module"] == "(loss)") & ~frame["is_view"] & ~frame["is_cast"]]
        loss_fp32 = bool(len(loss_ops)) and (loss_ops["compute_dtype"] == "fp32").all()
        held &= summary.low_precision_share >= 0.99 and loss_fp32
        parts.append(f"{mode}: {summary.low_precision_share:.0%} of {summary.flops / 1e6:.3g} MFLOP in 16 bits, the "
                     f"loss's ops in {'fp32' if loss_fp32 else 'mixed dtypes'}")
    return held, "; ".join(parts), "" if held else "Autocast left a matmul in fp32 or ran the loss in 16 bits here."


def op_table(evidence: Evidence) -> pd.DataFrame:
    """The ops of one traced step of the run's first mixed lane (views left out): phase, module, op, dtypes."""
    part = evidence.part(0)
    mode = next(m for m in part.config.modes if m.endswith("-mixed"))
    frame = _trace_of(part, mode).to_frame()
    frame = frame[~frame["is_view"]]
    return frame[["phase", "module", "op", "in_dtypes", "out_dtypes", "compute_dtype", "flops"]].assign(
        mode=mode).reset_index(drop=True)


def _speeds(evidence: Evidence, index: int) -> dict[str, float]:
    part = evidence.part(index)
    base = median_ms(part.lane("32-true", at_least=20))
    return {mode: base / median_ms(part.lane(mode, at_least=20)) for mode in part.config.modes}


def _gains_with_size(evidence: Evidence) -> tuple[bool, str, str]:
    small, large = _speeds(evidence, 0), _speeds(evidence, 1)
    mode = "bf16-mixed"
    held = large[mode] > small[mode]
    sizes = [p.config.size for p in evidence.parts]
    figure = f"{mode} vs 32-true: {small[mode]:.2f}× at {sizes[0]}, {large[mode]:.2f}× at {sizes[-1]}"
    return held, figure, "" if held else ("The larger size did not amortise the casts here: each matmul is still "
                                          "small for this device, or its 16-bit math is no faster than fp32.")


def _faster_at_large(mode: str) -> Callable[[Evidence], tuple[bool, str, str]]:
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float16

    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        part = evidence.part(1)
        native, words = native_16bit(dtype, resolve_device(part.config.device))
        speed = _speeds(evidence, 1)[mode]
        held = speed > 1.0 if native else speed < 1.0
        expected = "faster than 32-true" if native else "slower than 32-true"
        figure = f"{mode} at {part.config.size}: {speed:.2f}× the speed of 32-true (expected {expected}: {words})"
        return held, figure, "" if held else (
            f"Measured the other way round from what {words} suggests: on a machine shared with other work a step's "
            "time is noisy; run it again, and trust the figure you see twice.")
    return measure


def _init_scale_settles(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    lane = part.lane("16-mixed", at_least=45)
    skipped = lane["skipped"].to_numpy(dtype=bool)
    leading = int(np.argmin(skipped)) if not skipped.all() else len(skipped)
    start = fault_of(part.config, "init_scale").factor
    if leading == len(skipped):
        return False, f"every one of {leading} steps skipped from {power_of_two(start)}", (
            "The scale never came down to a working level: the gradients overflow at any scale (NaN from the model).")
    settled = scale_at(lane, leading)
    held = 0 < leading <= 40
    return held, (f"{leading} skipped steps from step 0: the scale halved from {power_of_two(start)} to "
                  f"{power_of_two(settled)}, then trained"), "" if held else (
        "No step was skipped: this initial scale was not too high for this model." if leading == 0 else
        "It took longer than 40 steps to come down.")


def _nan_collapses_scale(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    fault = fault_of(part.config, "grad_nan")
    end = fault.step + fault.duration
    lane = part.lane("16-mixed", at_least=min(end, part.config.steps))
    during = lane[(lane["step"] >= fault.step) & (lane["step"] < end)]
    skipped = int(during["skipped"].sum())
    before, last = scale_at(lane, fault.step), float(during["scale"].iat[-1])
    held = skipped == len(during) and last <= before * 2.0**-20
    return held, (f"{skipped} of {len(during)} steps with a NaN gradient skipped; scale {power_of_two(before)} → "
                  f"{last:.3g}"), "" if held else "The scale did not keep falling: some NaN step was not skipped."


def _weights_kept(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    fault = fault_of(part.config, "grad_nan")
    lane = part.lane("16-mixed", at_least=min(fault.step + fault.duration, part.config.steps))
    finite = bool(np.isfinite(lane["loss"].to_numpy(dtype=float)).all())
    during = lane.loc[lane["step"] >= fault.step, "loss"].to_numpy(dtype=float)
    halves = np.array_split(during, 2)
    held = finite and not diverged(part, lane, "16-mixed")
    flat = (f"; over the NaN steps its loss stays flat (mean {halves[0].mean():.3g} in the first half, "
            f"{halves[1].mean():.3g} in the second): no step taken, no learning" if len(during) >= 2 else "")
    return held, f"16-mixed's loss finite at all {len(lane)} steps{flat}", "" if held else (
        "A NaN reached 16-mixed's weights.")


def _unscaled_applies_nan(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    fault = fault_of(part.config, "grad_nan")
    mode = next(m for m in part.config.modes if m != "16-mixed")
    lane = part.lane(mode, at_least=fault.step + 2)
    bad = first_nonfinite(lane)
    held = diverged(part, lane, mode) and bad is not None and bad[0] > fault.step
    figure = f"{mode}: loss {bad[1]} at step {bad[0]}, lane stopped" if bad else f"{mode}: loss finite throughout"
    return held, figure, "" if held else f"{mode} did not take the NaN into its weights."


# --- the scenarios ----------------------------------------------------------------------------------------------
def _config(device: str, name: str, **settings) -> RunConfig:
    return RunConfig(workload=settings.pop("workload", "digits_mlp"), device=device, name=f"workshop: {name}",
                     **settings)


def _spike(step: int, duration: int) -> tuple[FaultSpec, ...]:
    return (FaultSpec(kind="loss_scale", step=step, duration=duration, factor=1e6),)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        name="fp16-scaler", title="Why fp16 needs a GradScaler",
        watch="32-true, 16-mixed (fp16 math, fp32 weights, a GradScaler) and 16-true (everything fp16, no scaler) "
              "race from the same weights on the same batches. Watch 16-mixed trace 32-true while 16-true falls out "
              "of the race.",
        caveat="16-true lacks two things at once: a scaler and fp32 master weights (its Adam state is fp16 too). "
               "Its failure is fp16's small range; the scaler alone fixes that only in the backward of 16-mixed.",
        build=lambda device: (_config(device, "fp16 needs a GradScaler", modes=("32-true", "16-mixed", "16-true"),
                                      steps=200, gradstats_every=25),),
        checks=(
            Check("16-mixed keeps up with 32-true",
                  f"final losses within {LOSS_MATCH:.0%}: fp32 weights and the scale keep fp16 math on track",
                  _mixed_keeps_up),
            Check("16-true stalls or diverges",
                  f"diverges, or ends {STALL_GAP:.0%} or more above 32-true: fp16 weights and optimizer state "
                  "underflow or round updates away", _pure_fp16_fails),
            Check("The scale lifts gradients out of fp16's underflow zone",
                  "without the scale at least 1% of the gradient would be subnormal or 0 in fp16; with it, under a "
                  "tenth of that (measured by casting the real gradients)", _scale_lifts_underflow),
        )),
    Scenario(
        name="bf16-no-skip", title="bf16 never skips",
        watch="The same loss spike (loss × 10^6 for 3 steps) hits a bf16-mixed and a 16-mixed lane. Watch the ✕ "
              "marks: fp16's scaled gradients overflow and its GradScaler skips those steps; bf16 has fp32's range, "
              "so it takes them.",
        caveat="The spike hits both lanes; only the scaled lane skips it. bf16 took three steps with 10^6-times "
               "gradients, and Adam's second-moment estimate remembers them, which shrinks its next steps: a lower "
               "loss in 16-mixed afterwards is not \"fp16 trains better\", it is the skipped steps.",
        build=lambda device: (_config(device, "bf16 never skips", modes=("bf16-mixed", "16-mixed"), steps=150,
                                      faults=_spike(60, 3), gradstats_every=0),),
        checks=(
            Check("The spike hits every lane", "both lanes' recorded loss jumps ×1000 or more at the spike",
                  _spike_hits_every_lane),
            Check("bf16-mixed skips nothing", "0 skipped steps: bf16 has no scaler and fp32's range",
                  _no_skips("bf16-mixed")),
            Check("16-mixed skips the spike", "every spike step skipped: the scaled gradients overflow fp16",
                  _spike_skipped),
        )),
    Scenario(
        name="spike-recovery", title="A loss spike: skip, back off, grow back",
        watch="A 16-mixed lane meets a 4-step loss spike with a GradScaler whose growth interval is 10 steps. Watch "
              "the scale chart: it halves on each skipped step, then doubles after every 10 clean steps until it is "
              "back.",
        caveat="With a growth interval this short the scale also probes upward on its own and overflows now and then "
               "(an odd ✕ away from the spike): that is the scaler finding the largest scale that fits, not a fault. "
               "PyTorch's default interval is 2000 steps.",
        build=lambda device: (_config(device, "spike, back-off, regrowth", modes=("16-mixed",), steps=150,
                                      faults=_spike(40, 4), scaler=ScalerConfig(growth_interval=10),
                                      gradstats_every=0),),
        checks=(
            Check("Skip", "every spike step skipped", _spike_skipped),
            Check("Back off", "the scale halves on each skipped step (backoff factor 0.5)", _backoff),
            Check("Grow back", "after the spike the scale climbs back to where it was, one doubling per growth "
                  "interval of clean steps", _regrowth),
        )),
    Scenario(
        name="lost-updates", title="Pure 16-bit weights lose updates",
        watch="32-true, bf16-true and 16-true train with SGD at a small LR. Watch the table: the share of each "
              "layer's updates that rounded away because the step was smaller than half the spacing of the "
              "weight's format.",
        caveat="A lost update is a weight that did not move although its gradient was not 0; it is sampled every 10 "
               "steps. Mixed modes keep fp32 master weights for exactly this reason.",
        build=lambda device: (_config(device, "pure 16-bit weights lose updates",
                                      modes=("32-true", "bf16-true", "16-true"), optimizer="sgd", lr=0.01, steps=150,
                                      gradstats_every=10),),
        checks=(
            Check("bf16 weights lose updates", "at least 5% of bf16-true's updates rounded away (8 significant bits)",
                  _loses_updates("bf16-true", 0.05)),
            Check("More bits, fewer losses", "bf16-true loses more than 16-true (11 significant bits)",
                  _more_bits_fewer_losses),
            Check("fp32 weights keep their updates", "under 1% lost in 32-true (24 significant bits)",
                  _fp32_keeps_updates),
        ),
        table=lost_update_table, table_title="Share of updates lost, per parameter (mean over sampled steps)",
        charts=("loss",)),
    Scenario(
        name="autocast-policy", title="Autocast's op policy",
        watch="Autocast does not cast everything: `x @ y` runs in 16 bits, `x + y` stays fp32, and the loss is "
              "computed in fp32. Watch the per-op table of one step: the casts (_to_copy) autocast inserted and the "
              "dtype each op computed in.",
        caveat="The op table is one traced step of this run's first mixed lane (its initial weights and first "
               "batch, the same seed). CPU autocast's lists differ from CUDA's in places; what you see is what ran "
               "here.",
        build=lambda device: (_config(device, "autocast op policy", modes=("32-true", "bf16-mixed", "16-mixed"),
                                      steps=100, gradstats_every=0),),
        checks=(
            Check("`x + y` stays fp32", "an add of fp32 tensors under fp16 and bf16 autocast gives fp32",
                  _autocast_result("x + y")),
            Check("`x @ y` runs in 16 bits", "a matmul of fp32 tensors under autocast gives the autocast dtype",
                  _autocast_result("x @ y")),
            Check("One step of this run", "every matmul FLOP of a mixed lane in 16 bits, the loss's ops in fp32",
                  _step_policy),
        ),
        table=op_table, table_title="Every op of one step (forward and backward), views left out",
        charts=("loss", "step_time")),
    Scenario(
        name="speed", title="Is mixed precision faster here?",
        watch="The same race runs twice on this device, first at a small size and then at a large one. Watch the "
              "step-time chart of each: whether a 16-bit mode is faster depends on the device and on the size.",
        caveat="Speeds are medians of the run's own interleaved steps (noise hits every lane alike). The expectation "
               "follows the device: native 16-bit math (tensor cores, AVX-512 bf16, AMX) can win at a large size; "
               "without it, a 16-bit mode converts and is slower.",
        build=lambda device: tuple(
            _config(device, f"is mixed precision faster here? ({size})", modes=("32-true", "bf16-mixed", "16-mixed"),
                    steps=60 if device == "cpu" else 200, gradstats_every=0, memory_every=1000, size=size,
                    workload="digits_mlp" if device == "cpu" else "tiny_transformer")
            for size in ("small", "large")),
        checks=(
            Check("bf16-mixed gains with size", "its speed vs 32-true is higher at the large size: bigger matmuls "
                  "amortise the casts", _gains_with_size),
            Check("bf16-mixed at the large size", "faster than 32-true where the device has native bf16 math, "
                  "slower where it has not", _faster_at_large("bf16-mixed")),
            Check("16-mixed at the large size", "faster than 32-true where the device has native fp16 math, "
                  "slower where it has not", _faster_at_large("16-mixed")),
        ),
        charts=("step_time",)),
    Scenario(
        name="scale-collapse", title="Scale collapse: what GradScaler can and cannot do",
        watch="16-mixed starts at scale 2^40, far too high, and from step 60 its model makes a NaN gradient every "
              "step (injected, as a bug would: a log of 0, a division by 0). Watch the scale chart: it halves down "
              "to a working scale, then collapses towards 0, while bf16-mixed takes the NaN and dies.",
        caveat="GradScaler can find a working scale, and it keeps NaN out of the weights by skipping. It cannot fix "
               "a model that makes NaN: 16-mixed's flat loss after step 60 is not training, it is every step "
               "skipped. A scale falling step after step means: find the op (Layer numerics page).",
        build=lambda device: (_config(device, "scale collapse", modes=("16-mixed", "bf16-mixed"), steps=120,
                                      gradstats_every=0,
                                      faults=(FaultSpec(kind="init_scale", factor=2.0**40, modes=("16-mixed",)),
                                              FaultSpec(kind="grad_nan", step=60, duration=60))),),
        checks=(
            Check("A too-high initial scale costs a few steps", "the first steps are skipped while the scale halves "
                  "to one that fits (at most 40), then it trains", _init_scale_settles),
            Check("NaN from the model collapses the scale", "every NaN step skipped; the scale falls 2^20-fold or "
                  "more", _nan_collapses_scale),
            Check("The scaler keeps the weights finite", "16-mixed's loss stays finite: no NaN step is applied",
                  _weights_kept),
            Check("Without a scaler the NaN is applied", "bf16-mixed's loss turns NaN after the first NaN step and "
                  "the lane stops", _unscaled_applies_nan),
        )),
)}


# --- launching ----------------------------------------------------------------------------------------------------
class ScenarioLaunch:
    """A scenario's runs launched through a RunManager (so they are in the store and on every page), one after the
    other: a second run starts when the first has ended, so each measures its steps on a machine it does not share
    with the other.

    Raises ConfigError (a RunLimitError when too many runs are going) if the first run cannot start.
    """

    def __init__(self, manager, scenario: Scenario, device: str = "auto"):
        self.manager = manager
        self.scenario = scenario
        self.configs = scenario.configs(device)
        self.error = ""
        """Why a later run could not start (the first one's error is raised)."""
        self._stop = threading.Event()
        self.run_ids: list[str] = [manager.launch(self.configs[0]).run_id]
        self._chain = None
        if len(self.configs) > 1:
            self._chain = background.start(self._launch_rest, f"amp-workshop-{scenario.name}", stop=self._stop.set)

    def _launch_rest(self) -> None:
        from amp_core.config import ConfigError

        for config in self.configs[1:]:
            run = self.manager.get(self.run_ids[-1])
            while run is not None and run.alive and not self._stop.is_set():
                run.join(0.2)
            if self._stop.is_set():
                return
            try:
                self.run_ids.append(self.manager.launch(config).run_id)
            except ConfigError as error:
                self.error = f"run {len(self.run_ids) + 1} of {len(self.configs)} did not start: {error}"
                return

    @property
    def going(self) -> bool:
        """A run of it still going, or one still to start."""
        if self._chain is not None and self._chain.is_alive():
            return True
        return any(run is not None and run.going for run in map(self.manager.get, self.run_ids))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every run has ended; False if `timeout_s` passed first."""
        if self._chain is not None:
            self._chain.join(timeout_s)
        for run_id in list(self.run_ids):
            run = self.manager.get(run_id)
            if run is not None:
                run.join(timeout_s)
        return not self.going

    def stop(self) -> None:
        self._stop.set()
        for run_id in list(self.run_ids):
            run = self.manager.get(run_id)
            if run is not None:
                run.stop()

    def evidence(self) -> Evidence:
        """What the runs recorded so far; ended once every run has ended and no other is to start (a launch that was
        stopped, or whose next run could not start, has ended with fewer runs: its checks say so)."""
        return gather(self.manager, list(self.run_ids), len(self.configs), going=self.going)

    def results(self) -> list[CheckResult]:
        return evaluate(self.scenario, self.evidence())


def unknown_scenario(name: str) -> str:
    """The message for a name that is not a scenario."""
    return f"no scenario {name!r}; choose from {', '.join(SCENARIOS)}"


__all__ = ["SCENARIOS", "Check", "CheckResult", "Evidence", "Scenario", "ScenarioLaunch", "Waiting", "evaluate",
           "gather"]
