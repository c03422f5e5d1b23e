"""The workshop's checks (all but the speed scenario's, in speed.py): each reads a scenario's records and says
whether its point showed, with the figure it measured and, when not, why in words that do not mislead; and the
tables some scenarios show beside their checks."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pandas as pd

from amp_core.precision import is_mixed, resolve_device
from amp_core.probes.gradstats import combine
from amp_core.workshop.evidence import (
    FINAL_WINDOW,
    Evidence,
    Part,
    Waiting,
    diverged,
    fault_of,
    final_loss,
    first_nonfinite,
    power_of_two,
    scale_at,
)

LOSS_MATCH = 0.05
"""16-mixed "keeps up" when its final loss is within this fraction of 32-true's."""
STALL_GAP = 0.10
"""A lane "stalls" when its final loss ends this fraction or more above 32-true's."""


def mixed_keeps_up(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    ref, mixed = final_loss(part.lane("32-true", at_least=FINAL_WINDOW)), final_loss(
        part.lane("16-mixed", at_least=FINAL_WINDOW))
    gap = mixed / ref - 1
    held = abs(gap) <= LOSS_MATCH
    figure = f"final loss: 16-mixed {mixed:.4g}, 32-true {ref:.4g} ({gap:+.1%})"
    why = "" if held else ("16-mixed ended farther from 32-true than expected: look at its skipped steps on the scale "
                           "chart (a skipped step is a step not taken).")
    return held, figure, why


def pure_fp16_fails(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    lane = part.lane("16-true", at_least=FINAL_WINDOW)
    if diverged(part, lane, "16-true"):
        bad = first_nonfinite(lane)
        at = f"its loss became {bad[1]} at step {bad[0]}" if bad else "it stopped"
        error = part.lane_info("16-true").error
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


def scale_lifts_underflow(evidence: Evidence) -> tuple[bool, str, str]:
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


def spike_hits_every_lane(evidence: Evidence) -> tuple[bool, str, str]:
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


def no_skips(mode: str) -> Callable[[Evidence], tuple[bool, str, str]]:
    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        part = evidence.part(0)
        _, end = _spike_window(part)
        lane = part.lane(mode, at_least=end + 1)
        skipped = int(lane["skipped"].sum())
        return skipped == 0, f"{mode}: {skipped} of {len(lane)} steps skipped", "" if skipped == 0 else (
            f"{mode} skipped steps: it has no GradScaler, so something else is wrong; see the Overflow debugger.")
    return measure


def spike_skipped(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    start, end = _spike_window(part)
    lane = part.lane("16-mixed", at_least=end)
    window = lane[(lane["step"] >= start) & (lane["step"] < end)]
    skipped = int(window["skipped"].sum())
    held = skipped == end - start
    return held, f"16-mixed skipped {skipped} of the {end - start} spike steps", "" if held else (
        "The scale had fallen so low that a spike step no longer overflowed fp16: that step was taken, spike and all.")


def backoff(evidence: Evidence) -> tuple[bool, str, str]:
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


def regrowth(evidence: Evidence) -> tuple[bool, str, str]:
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


def loses_updates(mode: str, at_least: float) -> Callable[[Evidence], tuple[bool, str, str]]:
    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        part = evidence.part(0)
        whole, layers = _lost_fraction(evidence, part, mode)
        worst = max(layers, key=layers.get)
        held = whole >= at_least
        return held, f"{mode}: {whole:.1%} of updates lost (most in {worst}: {layers[worst]:.1%})", "" if held else (
            f"Fewer updates rounded away than expected: this LR's steps are large next to {mode}'s spacing here.")
    return measure


def more_bits_fewer_losses(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    bf16, _ = _lost_fraction(evidence, part, "bf16-true")
    fp16, _ = _lost_fraction(evidence, part, "16-true")
    held = bf16 > fp16
    return held, f"bf16-true {bf16:.1%} vs 16-true {fp16:.1%} of updates lost", "" if held else (
        "fp16 lost as many updates as bf16 here: its weights sat where its spacing is as coarse (or its gradients "
        "underflowed to 0, which counts as no update, not a lost one).")


def fp32_keeps_updates(evidence: Evidence) -> tuple[bool, str, str]:
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


def autocast_result(expression: str) -> Callable[[Evidence], tuple[bool, str, str]]:
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


def step_policy(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    parts, held = [], True
    for mode in filter(is_mixed, part.config.modes):
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
    mode = next(filter(is_mixed, part.config.modes))
    frame = _trace_of(part, mode).to_frame()
    frame = frame[~frame["is_view"]]
    return frame[["phase", "module", "op", "in_dtypes", "out_dtypes", "compute_dtype", "flops"]].assign(
        mode=mode).reset_index(drop=True)

def init_scale_settles(evidence: Evidence) -> tuple[bool, str, str]:
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


def nan_collapses_scale(evidence: Evidence) -> tuple[bool, str, str]:
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


def weights_kept(evidence: Evidence) -> tuple[bool, str, str]:
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


def unscaled_applies_nan(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    fault = fault_of(part.config, "grad_nan")
    mode = next(m for m in part.config.modes if m != "16-mixed")
    lane = part.lane(mode, at_least=fault.step + 2)
    bad = first_nonfinite(lane)
    held = diverged(part, lane, mode) and bad is not None and bad[0] > fault.step
    figure = f"{mode}: loss {bad[1]} at step {bad[0]}, lane stopped" if bad else f"{mode}: loss finite throughout"
    return held, figure, "" if held else f"{mode} did not take the NaN into its weights."


FP8_LANE = "bf16-mixed+fp8-rowwise"
"""The FP8 scenario's recipe lane (raced against plain bf16-mixed)."""


def fp8_expected_here(device: str) -> str:
    """One line: whether FP8 matmuls run natively on `device` or emulated, and what that means for speed."""
    from amp_core.precision import availability

    note = availability(FP8_LANE, device)[1]
    if device == "cuda":
        return "Native FP8 tensor cores (compute capability 8.9+): the FP8 lane may be faster than bf16-mixed at a " \
               f"large size; it holds the same memory. ({note})"
    return ("Emulated on this CPU: real float8 matmuls (aten._scaled_mm), so the numerics are FP8's, but no speed-up "
            "is expected and none is checked.")


def fp8_matmuls_ran(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    frame = _trace_of(part, FP8_LANE).to_frame()
    scaled = frame[frame["op"] == "_scaled_mm"]
    operands = scaled["in_dtypes"].str.split(", ").str[:2]
    float8 = operands.map(lambda dtypes: all(d.startswith("float8") for d in dtypes)).all() if len(scaled) else False
    held = bool(len(scaled)) and bool(float8)
    figure = (f"{len(scaled)} float8 matmuls (_scaled_mm) in one traced step of {FP8_LANE}, operands "
              f"{', '.join(sorted({d for ds in operands for d in ds}))}")
    return held, figure, "" if held else "No Linear layer was converted to FP8 here: see the run's started event."


def fp8_keeps_up(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    ref = final_loss(part.lane("bf16-mixed", at_least=FINAL_WINDOW))
    fp8 = final_loss(part.lane(FP8_LANE, at_least=FINAL_WINDOW))
    gap = fp8 / ref - 1
    held = abs(gap) <= LOSS_MATCH
    return held, f"final loss: {FP8_LANE} {fp8:.4g}, bf16-mixed {ref:.4g} ({gap:+.1%})", "" if held else (
        "FP8 drifted from bf16 here: look at Layer numerics for a layer whose ranges exceed e4m3's (448).")


def fp8_saves_no_memory(evidence: Evidence) -> tuple[bool, str, str]:
    part = evidence.part(0)
    held_now = {mode: part.lane(mode).iloc[-1][["params_bytes", "grads_bytes", "optim_bytes"]].sum()
                for mode in ("bf16-mixed", FP8_LANE)}
    held = held_now["bf16-mixed"] == held_now[FP8_LANE]
    figure = f"held (parameters + gradients + optimizer state): {held_now[FP8_LANE] / 2**20:.2f} MiB with FP8, " \
             f"{held_now['bf16-mixed'] / 2**20:.2f} MiB with bf16-mixed"
    return held, figure, "" if held else "The FP8 lane holds a different amount: its weights should stay fp32."


# --- precision or data? (two failed steps of one run, replayed after it) ------------------------------------------
REPLAY_LANE = "16-mixed"
"""The lane whose failed steps the precision-or-data scenario replays."""


def replay_the_failures(manager, run_id: str) -> None:
    """After the run (on the scenario's launch thread, never the training thread): replay its 16-mixed lane's first
    skipped step before the outlier (the planted overflow) and the outlier's step, through the Replay button's own
    code, each report recorded in the run as a `replayed` event (what the checks read)."""
    from amp_core.config import RunConfig
    from amp_core.diagnostics.replay import replay_run

    info = manager.run_info(run_id)
    lane = next(entry.lane for entry in info.lanes if entry.mode == REPLAY_LANE)
    outlier = fault_of(RunConfig.from_dict(info.config), "batch_outlier").step
    steps = manager.steps(run_id)
    mine = steps[(steps["lane"] == lane) & steps["skipped"].astype(bool) & (steps["step"] < outlier)]
    for step in dict.fromkeys([*[int(s) for s in mine["step"].head(1)], outlier]):
        replay_run(manager, run_id, lane, step, record=True)


def _replays(evidence: Evidence) -> tuple[Part, dict[int, object]]:
    from amp_core.diagnostics.replay_modes import recorded_replays

    part = evidence.part(0)
    lane = part.lane_index(REPLAY_LANE)
    reports = {report.step: report for report in recorded_replays(evidence.reader.events(part.run_id), lane)}
    if not reports:
        raise Waiting("the replays, made when the run has ended")
    return part, reports


def _replay_at(reports: dict, step: int):
    if step not in reports:
        raise Waiting(f"the replay of step {step}")
    return reports[step]


def overflow_is_precision(evidence: Evidence) -> tuple[bool, str, str]:
    part, reports = _replays(evidence)
    lane = part.lane(REPLAY_LANE)
    outlier = fault_of(part.config, "batch_outlier").step
    skipped = lane[lane["skipped"].astype(bool) & (lane["step"] < outlier)]
    if skipped.empty:
        return False, f"{REPLAY_LANE} skipped no step before the outlier", (
            "The planted initial scale fit this model's gradients: nothing overflowed fp16, so there was no step to "
            "replay.")
    step = int(skipped["step"].iat[0])
    report = _replay_at(reports, step)
    own = report.own
    named = own.first_nonfinite or (f"the gradient of {own.nonfinite_params[0]}" if own.nonfinite_params else "")
    held = report.verdict.kind == "precision" and bool(named)
    figure = f"step {step}: verdict {report.verdict.kind}; {REPLAY_LANE}'s first inf/NaN: {named or 'none named'}"
    why = "" if held else (f"The replay says: {report.verdict.why}." if report.verdict.kind != "precision" else
                           "The replay judged it precision but named no module or parameter that held inf/NaN.")
    return held, figure, why


def outlier_is_data(evidence: Evidence) -> tuple[bool, str, str]:
    part, reports = _replays(evidence)
    step = fault_of(part.config, "batch_outlier").step
    report = _replay_at(reports, step)
    reference = next(row for row in report.rows if row.mode == "32-true")
    held = report.verdict.kind == "data"
    band = f"its band ≤ {report.band.upper:.4g}" if report.band is not None else "no band yet"
    figure = f"step {step}: verdict {report.verdict.kind}; fp32's loss {reference.loss:.4g} ({band})"
    why = "" if held else f"The replay says: {report.verdict.why}."
    return held, figure, why


def replays_reproduce(evidence: Evidence) -> tuple[bool, str, str]:
    _, reports = _replays(evidence)
    steps = sorted(reports)
    missed = [step for step in steps if reports[step].reproduced is False]
    figure = (f"{len(steps) - len(missed)} of {len(steps)} replayed steps (step {', '.join(map(str, steps))}) "
              f"reproduced bit for bit")
    why = "" if not missed else " ".join(f"Step {step}: {reports[step].reproduction_line()}." for step in missed)
    return not missed, figure, why
