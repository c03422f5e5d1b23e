"""One step replayed in every mode from the state before it, and the verdict: was it the precision or the data?

The loop that forks a state before step S into each mode, steps every fork once from the same random state, and
compares each update with fp32's (`replay_modes`), the verdict with the figures that decided it (`judge`), and the
report as records (`report_data`, a `replayed` event). What is replayed is a ReplaySubject: a lane of the race
(diagnostics.replay, from its snapshots) or a user's own loop (diagnostics.attached_replay, from a Monitor's kept
copy). This module imports neither the race's step nor the Monitor: both sides build on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from amp_core.config import ConfigError
from amp_core.precision import (
    BASELINE_MODE,
    FLOAT64_REFERENCE,
    Precision,
    availability,
    compile_option,
    float64_reference,
    get_precision,
)
from amp_core.probes import gradstats
from amp_core.probes.spikes import LossBand, SpikeRule

VERDICTS = ("precision", "data", "unclear")
EAGER_TWIN = " (eager)"
"""A compiled recipe is replayed twice: compiled, under its own name (the program the run ran), and eagerly, as
`<recipe> (eager)` — the same recipe, its model not compiled — so a report says whether compiling changed the step."""
# --- the replay ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ModeReplay:
    """Step S replayed in one mode (or reference), from the lane's weights before S."""

    mode: str
    reference: bool
    """32-true or float64: what the other modes are judged against."""
    loss: float
    grads_finite: bool
    skipped: bool
    """The GradScaler skipped the optimizer step."""
    first_nonfinite: str
    """`module (forward|backward)` of the first module that held inf/NaN (Layer numerics' probe), or ''."""
    first_nonfinite_why: str
    nonfinite_params: tuple[str, ...]
    """Parameters whose gradient held inf/NaN (an overflow inside a weight gradient's own sum shows only here)."""
    scale: float | None
    """The loss scale this mode's GradScaler used (None: no scaler)."""
    scale_after: float | None
    scale_source: str
    """Where the scale came from: the lane's own scaler, another lane's record of this step, or the initial scale."""
    update_norm: float
    """‖w_after − w_before‖ over all parameters (fp64)."""
    update_rel_norm: float
    """The update's norm over the fp32 reference's update norm (1: the same size; 0: no step)."""
    update_cosine: float
    """Cosine between this mode's update and the fp32 update (NaN when either is zero or non-finite)."""
    loss_above_band: bool
    """The loss is above the lane's robust band (a spike)."""
    compiled: bool = False
    """The step ran compiled (inductor, the recipe's compile options); a compiled recipe's `(eager)` row did not."""

    def broke(self) -> bool:
        return not math.isfinite(self.loss) or not self.grads_finite or self.loss_above_band


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str
    """precision | data | unclear."""
    why: str

    def line(self) -> str:
        return f"verdict: {self.kind} — {self.why}"


@dataclass(slots=True)
class ReplayReport:
    run_id: str
    lane: int
    mode: str
    step: int
    source: str
    """Where the state before S came from, in words (a snapshot of step K in this process, or a re-run from 0)."""
    start_step: int
    """The step the lane's own mode re-trained from (the snapshot's; 0 for a re-run)."""
    rows: list[ModeReplay]
    recorded_loss: float | None
    """The run's record of the lane's loss at S (None: not recorded)."""
    band: LossBand | None
    rule: SpikeRule
    faults: list[str]
    """Faults that fired on S in the replay (in every mode)."""
    verdict: Verdict
    notes: list[str] = field(default_factory=list)
    replay_s: float = 0.0

    @property
    def own(self) -> ModeReplay:
        return next(row for row in self.rows if row.mode == self.mode)

    @property
    def reproduced(self) -> bool | None:
        """Whether the replay's loss of S in the lane's own mode equals the recorded one bit for bit (None: no
        record). NaN equals NaN here: a step that broke is reproduced when it breaks again."""
        if self.recorded_loss is None:
            return None
        mine = self.own.loss
        return mine == self.recorded_loss or (math.isnan(mine) and math.isnan(self.recorded_loss))

    def reproduction_line(self) -> str:
        if self.recorded_loss is None:
            return "the run recorded no loss for this step"
        if self.reproduced:
            return f"reproduced: the lane's {self.mode} loss {self.own.loss!r} equals the recorded one bit for bit"
        return (f"NOT reproduced: the replay's {self.mode} loss {self.own.loss!r} differs from the recorded "
                f"{self.recorded_loss!r}")


REPLAYED_EVENT = "replayed"
"""Event kind: a replay's report (`report_data`), recorded in the run it replayed (an attached run's own replays, and a
race's replays asked from a page, the CLI or a workshop scenario)."""


def report_data(report: ReplayReport) -> dict[str, Any]:
    """The report as plain data for an event (`report_from_data` reads it back)."""
    data = {name: getattr(report, name) for name in ReplayReport.__slots__ if name not in ("rows", "band", "rule",
                                                                                           "verdict")}
    data["rows"] = [{name: getattr(row, name) for name in ModeReplay.__slots__} for row in report.rows]
    band = report.band
    data["band"] = None if band is None else {name: getattr(band, name) for name in LossBand.__slots__}
    data["rule"] = {name: getattr(report.rule, name) for name in SpikeRule.__slots__}
    data["verdict"] = {"kind": report.verdict.kind, "why": report.verdict.why}
    return data


def report_from_data(data: dict[str, Any]) -> ReplayReport:
    """A report recorded by `report_data` (a `replayed` event's data)."""
    fields = {key: value for key, value in data.items() if key in ReplayReport.__slots__}
    fields["rows"] = [ModeReplay(**{**row, "nonfinite_params": tuple(row["nonfinite_params"])})
                      for row in data["rows"]]
    fields["band"] = LossBand(**data["band"]) if data.get("band") else None
    fields["rule"] = SpikeRule(**data["rule"])
    fields["verdict"] = Verdict(**data["verdict"])
    return ReplayReport(**fields)


def judge(rows: list[ModeReplay], band: LossBand | None, rule: SpikeRule, faults: list[str]) -> Verdict:
    """precision: fp32 is finite and in the band and only narrower formats break; data: fp32 breaks too (the batch's
    loss is an outlier, or non-finite, in the reference); unclear: no mode breaks on replay."""
    reference = next(row for row in rows if row.mode == BASELINE_MODE)
    others = [row for row in rows if not row.reference and row.mode != BASELINE_MODE]
    band_text = (f"band ≤ {band.upper:.4g} (median {band.median:.4g}, {band.points} steps)" if band is not None
                 else f"no band yet (fewer than {rule.min_history} finite losses before this step)")
    planted = f"planted on this step in every mode: {'; '.join(faults)}. " if faults else ""
    broken = [row for row in others if row.broke()]

    def what(row: ModeReplay) -> str:
        parts = []
        if not math.isfinite(row.loss):
            parts.append(f"loss {row.loss}")
        elif row.loss_above_band:
            parts.append(f"loss {row.loss:.4g} above the band")
        if not row.grads_finite:
            parts.append("inf/NaN gradients" + (" (step skipped)" if row.skipped else ""))
        if row.first_nonfinite:
            parts.append(f"first non-finite {row.first_nonfinite}")
        elif row.nonfinite_params:
            parts.append(f"inf/NaN first in the gradient of {', '.join(row.nonfinite_params[:3])}")
        return f"{row.mode}: {', '.join(parts)}"

    if reference.broke():
        how = (f"loss {reference.loss:.4g} above the {band_text}" if reference.loss_above_band
               else f"loss {reference.loss}" if not math.isfinite(reference.loss) else "inf/NaN gradients")
        spread = f"; {len(broken)} of {len(others)} other modes break too" if others else ""
        return Verdict("data", f"{planted}fp32 breaks too on this batch ({how}){spread}")
    if broken:
        return Verdict("precision", f"{planted}fp32 is finite (loss {reference.loss:.4g}, {band_text}) and only the "
                                    f"narrower formats break: {'; '.join(what(row) for row in broken)}")
    losses = ", ".join(f"{row.mode} {row.loss:.4g}" for row in rows)
    return Verdict("unclear", f"{planted}no mode breaks on replay ({losses}; {band_text})")



def set_rng(rng: list[torch.Tensor] | None, device: str) -> None:
    if rng is None:
        return
    torch.set_rng_state(rng[0])
    if len(rng) > 1:
        torch.cuda.set_rng_state(rng[1], torch.device(device))


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.sum(t * t)) for t in tensors))


@dataclass(slots=True)
class Fork:
    """One mode's own copy of the state before S: its model and parameters, and how its one step runs."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    step: Callable[[], tuple[float, bool, float | None, float | None]]
    """Runs the step once: (loss, skipped, scale used, scale after)."""
    scale_source: str = ""
    """Where its loss scale came from (empty: the mode has no scaler)."""
    compiled: bool = False
    """Its model is compiled (the recipe's `+compile...`), so its step runs compiled."""


class ReplaySubject:
    """What a replay steps, in any precision: the state before S, its batch, and how one step of it runs. The race's
    lanes (`_LaneSubject`: the run's train_step and workload) and an attached loop (`AttachedSubject`: the user's
    model, optimizer and loss closure, kept by a Monitor) are the two kinds; `replay_modes` treats them alike."""

    device: str
    own_mode: str

    def fork(self, name: str, precision: Precision) -> Fork:
        """The state before S in `precision` (the own mode's may be the subject's own copy: it steps last)."""
        raise NotImplementedError

    def first_nonfinite(self, precision: Precision, scale: float | None) -> tuple[str, str]:
        """(`module (phase)`, why) of the first module that held inf/NaN in `precision` (Layer numerics' probe)."""
        raise NotImplementedError


def named_first(found) -> tuple[str, str]:
    return (f"{found.module} ({found.phase})", found.why) if found is not None else ("", "")


def replay_targets(modes, device: str, notes: list[str]) -> list[tuple[str, Precision, bool]]:
    """(name, Precision, is a reference) of `modes` and 32-true that this device runs (the others are left out with
    a note), then float64 where the device has it."""
    targets: list[tuple[str, Precision, bool]] = []
    for name in dict.fromkeys([*modes, BASELINE_MODE]):
        ok, reason = availability(name, device)
        if not ok:
            notes.append(f"{name} is left out: {reason}")
            continue
        precision = get_precision(name, device)
        targets.append((name, precision, name == BASELINE_MODE))
        if compile_option(precision) is not None:
            targets.append((name + EAGER_TWIN, precision, False))
    wide = float64_reference(device)
    if wide is not None:
        targets.append((FLOAT64_REFERENCE, wide, True))
    return targets


def replay_modes(subject: ReplaySubject, targets: list[tuple[str, Precision, bool]], band: LossBand | None,
                 devices: list) -> list[ModeReplay]:
    """Step S once in every target, each on its own fork of the subject's state before S, from the same random
    state; a row per target with what broke and the update against fp32's."""
    device = subject.device
    rng = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
    results: dict[str, tuple] = {}
    # The other modes first, on copies; the own mode's fork steps last (it may be the replay's own copy already).
    for name, precision, reference in sorted(targets, key=lambda target: target[0] == subject.own_mode):
        try:
            fork = subject.fork(name, precision)
            before = [p.detach().double().clone() for p in fork.params]
            set_rng(rng, device)
            loss, skipped, scale, scale_after = fork.step()
        except Exception as exc:  # a mode this state cannot be carried into: said, not a traceback
            raise ConfigError("replay", f"the step could not be replayed in {name}: {type(exc).__name__}: "
                                        f"{exc}") from exc
        grads = [p.grad for p in fork.params if p.grad is not None]
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        first, why = "", ""
        bad = tuple(entry["param"] for entry in gradstats.nonfinite_params(fork.model)) if not finite else ()
        if not (finite and math.isfinite(loss)):
            set_rng(rng, device)
            first, why = subject.first_nonfinite(precision, scale)
        update = [p.detach().double() - b for p, b in zip(fork.params, before, strict=True)]
        results[name] = (reference, loss, skipped, scale, scale_after, finite, first, why, bad, fork.scale_source,
                         fork.compiled, update)
    reference_update = results[BASELINE_MODE][-1]
    reference_norm = _norm(reference_update)
    rows = []
    for name, _precision, _reference in targets:
        reference, loss, skipped, scale, scale_after, finite, first, why, bad, source, compiled, update = results[name]
        norm = _norm(update)
        dot = sum(float(torch.sum(a * b)) for a, b in zip(update, reference_update, strict=True))
        cosine = dot / (norm * reference_norm) if norm > 0 and reference_norm > 0 else math.nan
        rows.append(ModeReplay(
            mode=name, reference=reference, loss=loss, grads_finite=finite, skipped=skipped, first_nonfinite=first,
            first_nonfinite_why=why, nonfinite_params=bad, scale=scale, scale_after=scale_after, scale_source=source,
            update_norm=norm, update_rel_norm=norm / reference_norm if reference_norm > 0 else math.nan,
            update_cosine=cosine if math.isfinite(cosine) else math.nan,
            loss_above_band=band is not None and math.isfinite(loss) and loss > band.upper, compiled=compiled))
    return rows


def as_run(rows: list[ModeReplay]) -> list[ModeReplay]:
    """The rows of the programs the run ran: a compiled recipe's compiled row, not its `(eager)` one."""
    return [row for row in rows if not row.mode.endswith(EAGER_TWIN)]


def compile_notes(rows: list[ModeReplay], band: LossBand | None, rule: SpikeRule, faults: list[str],
                  verdict: Verdict) -> list[str]:
    """Per compiled recipe replayed: its compiled and eager losses (bit for bit equal, or how far apart), whether
    compiling changes if the step breaks, and whether the verdict (`verdict`: judged on the compiled rows) would be
    another one judged on the eager rows."""
    by_name = {row.mode: row for row in rows}
    notes = []
    swapped = []
    for row in as_run(rows):
        twin = by_name.get(row.mode + EAGER_TWIN)
        swapped.append(twin if row.compiled and twin is not None else row)
        if not row.compiled or twin is None:
            continue
        if row.loss == twin.loss or (math.isnan(row.loss) and math.isnan(twin.loss)):
            apart = "bit for bit equal"
        elif math.isfinite(row.loss) and math.isfinite(twin.loss) and twin.loss != 0:
            apart = f"{abs(row.loss - twin.loss) / abs(twin.loss):.2e} apart (relative)"
        else:
            apart = "one of them not finite"
        said = {True: "breaks", False: "holds"}
        notes.append(f"compiled (inductor, the recipe's compile options) and eager replays of {row.mode}: loss "
                     f"{row.loss:.6g} compiled, {twin.loss:.6g} eager, {apart}; the step {said[row.broke()]} "
                     f"compiled and {said[twin.broke()]} eagerly")
    if notes:
        eager_verdict = judge([replace(row, mode=row.mode.removesuffix(EAGER_TWIN)) for row in swapped], band, rule,
                              faults)
        notes.append(f"judged on the eager rows instead, the verdict would be {eager_verdict.kind}"
                     + ("" if eager_verdict.kind == verdict.kind else f" (not {verdict.kind}): compiling changes it")
                     + "; where inf/NaN first appears is probed on an eager copy (layer numerics)")
    return notes


def recorded_replays(events, lane: int) -> list[ReplayReport]:
    """The replays recorded in a run's events for `lane` (an attached run's own, and a race's asked from a page, the
    CLI or a workshop scenario), oldest first."""
    if events.empty:
        return []
    mine = events[(events["kind"] == REPLAYED_EVENT) & (events["lane"] == lane)]
    return [report_from_data(data["report"]) for data in mine["data"] if isinstance(data, dict) and "report" in data]
