"""Which precision to train this model in, here: a recommendation measured on this device, with its evidence.

`advise` composes the tools that exist, within a time budget: (1) the candidates, every mode and recipe this device
can run as precision/ enumerates them (`recipe_candidates`), each refused one with its reason; (2) the cost probe
ranks them (a real race through the runner, kept in the store); (3) a seeded race of the promising ones against
32-true, replicates per recipe; (4) stability from that race's records: skipped steps after warm-up, non-finite
losses, diverged lanes, the final loss against 32-true's beyond seed noise (views.summary's DIFFERENCE_RULE), and the
first inf/NaN module of a lane that failed (a replay of its first failed step, recorded as the race's `replayed`
event), the layers to keep of one that fails in a few (advise_fix), and a per-layer plan for one with a matmul format
that failed or trained worse (advise_plan), each raced beside 32-true as a candidate; (5) memory (each lane's own
peak) and the largest batch (diagnostics.maxbatch).

The budget is planned before anything runs (`plan_budget`): every runnable candidate is probed when the budget allows
it (recipe options in chunks, each option on its fastest base mode first), every promising candidate races with seeds
for as long as the budget leaves (the slowest dropped only when the race would be too short for a verdict), and the
failed candidates keep a share for their bisects and fix races. The advice records how much of the budget it used and
why it stopped (`stop_reason`): under USED_ENOUGH of it only because the answer was decided sooner.

Every figure comes from runs it made, kept in the store as ordinary runs (Compare and the report show them); the
race run carries an `advised` event that links the advice to its evidence (the probe runs, the candidates and their
notes, the largest batches). `gather` reads that evidence back from the store and `decide` — a pure function of it —
gives the recommendation: the fastest candidate that trains like fp32 within seed noise, the runner-up, what each
saves against 32-true, every rejected candidate with the reason and the figure, and what could not be told here.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from amp_core import background
from amp_core.config import FINAL_LOSS_WINDOW, ConfigError, RunConfig
from amp_core.diagnostics import cost
from amp_core.diagnostics.advise_fix import keep_fixes, keep_line
from amp_core.diagnostics.advise_plan import plan_fixes, plan_line, plan_note, plan_targets
from amp_core.diagnostics.configs import AdviseConfig
from amp_core.diagnostics.plan_search import plan_hint
from amp_core.diagnostics.seednoise import difference_verdict
from amp_core.precision import (
    BASELINE_MODE,
    RECIPE_OPTIONS,
    device_name,
    get_precision,
    recipe_candidates,
    recipe_mode,
    resolve_device,
)
from amp_core.runs import RunReader
from amp_core.workloads import WORKLOADS, check_launch

ADVISED_EVENT = "advised"
"""The race run's event that links an advice to its evidence (its data: see `record_advice`)."""
MIN_RACE_STEPS = 40
"""A race shorter than this gives no verdict: the final loss is the mean of the last LAST_K steps, after warm-up."""
MAX_RACE_STEPS = 3000
"""A race longer than this is not needed for the verdicts it gives: its step-time and final-loss means are steady long
before (a race that reaches it ends the advice early, and the advice says so)."""
LAST_K = FINAL_LOSS_WINDOW
"""Final loss: the mean of each lane's last LAST_K losses (the Compare page's default)."""
WARMUP_SHARE = 0.2
"""Steps before this share of the race are its warm-up: the GradScaler finds its scale there (skips are expected)."""
SKIP_TOLERANCE = 0.02
"""A candidate skipping more than this share of its steps after warm-up (each seed's lane alike) is unstable: the
GradScaler skips now and then by design (a step whose scale just grew), not steadily."""
MIN_BUDGET_S = 20.0
"""Less than this cannot probe and race anything: refused, saying what it could do."""
PROBE_SHARE = 0.15
"""The modes' cost probe: this share of the budget (at least MIN_PROBE_S)."""
MIN_PROBE_S = 10.0
"""The modes' cost probe gets at least this long: on a loaded machine setting up five lanes takes seconds."""
OPTION_PROBE_MAX_SHARE = 0.35
"""The recipe options' cost probes: at most this share of the budget (what they do not use goes to the race)."""
OPTION_LANE_S = 15.0
"""An option lane's probe costs about this long on a CPU (an option built on torchao converts or compiles its step
first): the plan gives the options OPTION_LANE_S each, within OPTION_PROBE_MAX_SHARE."""
OPTION_CHUNK = 4
"""Option lanes per probe race (beside their own 32-true lane): the lanes of a race step in turn, so one lane that
compiles holds up only its chunk."""
OPTION_CHUNK_MIN_S = 60.0
"""A probe race of option lanes gets at least this long, less is not started (the options left are counted): a lane
that compiles its step takes seconds to a minute on a CPU before its first step (a 42 s probe of 8 option lanes on a
loaded 2-core machine timed none of them)."""
RESERVE_SHARE = 0.1
"""Kept back for the largest-batch search and the advice's own bookkeeping."""
FIX_SHARE = 0.35
"""Of what is left after the probes (less the reserve), the failed candidates' replays, bisects and fix races may
take this share; the seeded race takes the rest."""
USED_ENOUGH = 0.7
"""Below this share of the budget used, the advice says why it stopped sooner."""
REPLAYS_AT_MOST = 3
"""Failed candidates whose first inf/NaN module is looked for (a replay of the first failed step each)."""


# --- the evidence, as the store holds it ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class CandidateEvidence:
    """What the advice's runs recorded about one candidate recipe (NaN / None / 0: not measured)."""

    recipe: str
    runnable: bool
    """Whether this device can run it (precision.availability)."""
    note: str
    """Why not, or a caveat (emulated, converts, compiles its step)."""
    probe_ratio: float = math.nan
    """Cost probe: its median ms/step ÷ 32-true's in the same probe race."""
    probe_ms: float = math.nan
    probe_run: str = ""
    probe_error: str = ""
    """Why its probe lane gave no figure (failed, no step within the probe's time)."""
    raced: bool = False
    seeds: int = 0
    """Lanes (seeds) it raced with."""
    steps: int = 0
    """Steps each lane made (the fewest of its seeds)."""
    loss_mean: float = math.nan
    loss_sd: float = math.nan
    loss_n: int = 0
    ms_mean: float = math.nan
    ms_sd: float = math.nan
    ms_n: int = 0
    diverged: int = 0
    """Seeds whose lane ended with a non-finite loss."""
    nonfinite_steps: int = 0
    """Steps after warm-up with a non-finite loss, all seeds together."""
    skipped_after_warmup: int = 0
    """Steps the GradScaler skipped after warm-up, all seeds together."""
    steps_after_warmup: int = 0
    """Steps after warm-up, all seeds together."""
    first_nonfinite: str = ""
    """The first module that held inf/NaN in its first failed step (a replay), with why."""
    peak_mib: float = math.nan
    """The largest of its lanes' own memory peaks."""
    max_batch: int | None = None
    max_batch_modelled: bool = False
    keep: str = ""
    """For a candidate that failed: the layers to keep in fp32 and their price (the bisect), or why none was found or
    looked for; for a fixed recipe: which candidate it fixes and how."""
    fixes: str = ""
    """For a fixed recipe (`MODE+keep:…`, raced because a bisect found a few layers to keep): the recipe it fixes."""
    yardstick: CandidateEvidence | None = None
    """For a fixed recipe: the 32-true lanes raced beside it in the fix's own race (its verdicts are held against
    them: the same machine at the same time)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Evidence:
    """Everything an advice is decided from, read back from the store (`gather`)."""

    workload: str
    size: str
    device: str
    device_name: str
    race_run: str
    probe_runs: tuple[str, ...]
    candidates: tuple[CandidateEvidence, ...]
    race_steps: int
    warmup_steps: int
    budget_s: float = math.nan
    spent_s: float = math.nan
    notes: tuple[str, ...] = ()
    """What the orchestrator could not do, in words (a probe cut by the budget, a replay that failed)."""
    plan: str = ""
    """How it planned the budget (BudgetPlan.words)."""
    stopped: str = ""
    """Why it stopped where it did, in words (the budget spent, or the answer decided sooner)."""
    unprobed_s: float = math.nan
    """About how many seconds more of cost probes would measure the runnable candidates not probed (the modes' probe
    time per mode measured; OPTION_LANE_S per recipe option)."""
    budget_for_all_s: float = math.nan
    """A budget whose plan probes every runnable candidate."""

    def candidate(self, recipe: str) -> CandidateEvidence | None:
        return next((c for c in self.candidates if c.recipe == recipe), None)


# --- the decision (pure) -------------------------------------------------------------------------------------------
VERDICT_ORDER = ("recommended", "runner-up", "trains like fp32", "baseline", "cannot tell", "rejected", "not measured",
                 "refused")


@dataclass(frozen=True, kw_only=True, slots=True)
class CandidateVerdict:
    """One candidate's place in the advice."""

    recipe: str
    verdict: str
    """One of VERDICT_ORDER."""
    reason: str
    """Why, in words (for a rejected one: the check it failed)."""
    figure: str
    """The figure that decided it."""
    time_ratio: float = math.nan
    """Its race ms/step ÷ 32-true's (else the cost probe's)."""
    loss_delta: float = math.nan
    """Its mean final loss − 32-true's."""
    peak_mib: float = math.nan
    max_batch: int | None = None
    keep: str = ""
    """The layers to keep in fp32 and their price (CandidateEvidence.keep)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Advice:
    """The recommendation and everything said with it."""

    recommended: str
    why: str
    runner_up: str | None
    verdicts: tuple[CandidateVerdict, ...]
    cannot_tell: tuple[str, ...]
    """What could not be told here, and why."""
    decided: bool
    """False: the evidence could not tell (exit 3): the recommendation is 32-true by default, not by measurement."""
    evidence: Evidence

    @property
    def exit_code(self) -> int:
        return 0 if self.decided else 3

    def line(self) -> str:
        return f"recommend: {self.recommended} — {self.why}"

    def verdict(self, recipe: str) -> CandidateVerdict | None:
        return next((v for v in self.verdicts if v.recipe == recipe), None)


def _stability(c: CandidateEvidence) -> tuple[str, str] | None:
    """(reason, figure) when the candidate's race lanes broke; None when they trained cleanly."""
    where = f"; first inf/NaN: {c.first_nonfinite}" if c.first_nonfinite else ""
    if c.diverged:
        return ("unstable: its loss went non-finite and the lane stopped",
                f"{c.diverged} of {c.seeds} seeds diverged{where}")
    if c.nonfinite_steps:
        return ("unstable: non-finite losses after warm-up",
                f"{c.nonfinite_steps} of {c.steps_after_warmup} steps{where}")
    if c.steps_after_warmup and c.skipped_after_warmup > SKIP_TOLERANCE * c.steps_after_warmup:
        return ("unstable: the GradScaler kept skipping steps after warm-up",
                f"{c.skipped_after_warmup} of {c.steps_after_warmup} steps skipped (tolerance "
                f"{SKIP_TOLERANCE:.0%}){where}")
    return None


def decide(evidence: Evidence) -> Advice:
    """The recommendation from `evidence` alone (no torch, no store): see the module's docstring. A candidate trains
    like fp32 when its race lanes stayed finite, skipped no more than SKIP_TOLERANCE after warm-up, and its mean final
    loss is not above 32-true's by more than the spread across seeds allows; it is faster when its mean ms/step is
    below 32-true's by more than that spread. The recommendation is the fastest such candidate that is faster, else
    32-true."""
    base = evidence.candidate(BASELINE_MODE)
    verdicts: dict[str, CandidateVerdict] = {}
    unknowns: list[str] = []
    acceptable: list[tuple[float, str, bool]] = []  # (ms/step against its 32-true, recipe, measurably faster)
    raced_told = raced_any = False
    base_raced = base is not None and base.raced and base.loss_n > 0

    def yardstick(c: CandidateEvidence) -> tuple[CandidateEvidence | None, bool]:
        """The 32-true a candidate is held against (a fixed recipe's own race's), and whether it raced."""
        if c.yardstick is None:
            return base, base_raced
        return c.yardstick, c.yardstick.raced and c.yardstick.loss_n > 0

    def ratio(c: CandidateEvidence) -> float:
        b, b_raced = yardstick(c)
        if c.raced and b_raced and b.ms_mean > 0:
            return c.ms_mean / b.ms_mean
        return c.probe_ratio

    for c in evidence.candidates:
        b, b_raced = yardstick(c)
        common = {"recipe": c.recipe, "time_ratio": ratio(c), "peak_mib": c.peak_mib, "max_batch": c.max_batch,
                  "loss_delta": c.loss_mean - b.loss_mean if b_raced and c.raced else math.nan, "keep": c.keep}
        if c.recipe == BASELINE_MODE:
            figure = (f"{c.ms_mean:.3g} ± {c.ms_sd:.2g} ms/step, final loss {c.loss_mean:.4g} ± {c.loss_sd:.2g} over "
                      f"{c.seeds} seeds" if c.raced else "not raced")
            verdicts[c.recipe] = CandidateVerdict(verdict="baseline", reason="the yardstick (fp32 weights and math)",
                                                  figure=figure, **common)
            continue
        if not c.runnable:
            verdicts[c.recipe] = CandidateVerdict(verdict="refused", reason=c.note, figure="—", **common)
            continue
        if not c.raced:
            if c.probe_error:
                verdict, reason, figure = "not measured", "its cost probe gave no figure", c.probe_error
            elif math.isnan(c.probe_ratio):
                verdict, reason, figure = "not measured", "not probed within the budget", "—"
            elif c.probe_ratio >= cost.SLOW_FACTOR:
                verdict, reason = "rejected", f"far slower than 32-true in the cost probe (≥ {cost.SLOW_FACTOR:g}x)"
                figure = f"x{c.probe_ratio:.2f} of 32-true's ms/step"
            else:
                verdict, reason = "not measured", "not raced within the budget"
                figure = f"cost probe x{c.probe_ratio:.2f} of 32-true's ms/step"
            verdicts[c.recipe] = CandidateVerdict(verdict=verdict, reason=reason, figure=figure, **common)
            continue
        raced_any = True
        broke = _stability(c)
        if broke is not None:
            raced_told = True
            verdicts[c.recipe] = CandidateVerdict(verdict="rejected", reason=broke[0], figure=broke[1], **common)
            continue
        loss_verdict, loss_threshold = (difference_verdict(b.loss_mean, b.loss_sd, b.loss_n, c.loss_mean,
                                                           c.loss_sd, c.loss_n) if b_raced else ("cannot tell",
                                                                                                    math.nan))
        ms_verdict, ms_threshold = (difference_verdict(b.ms_mean, b.ms_sd, b.ms_n, c.ms_mean, c.ms_sd,
                                                       c.ms_n) if b_raced else ("cannot tell", math.nan))
        loss_figure = (f"final loss {c.loss_mean:.4g} vs 32-true {b.loss_mean:.4g} ({common['loss_delta']:+.3g}; "
                       f"seed noise allows ±{loss_threshold:.3g})" if b_raced else "")
        if loss_verdict == "cannot tell":
            verdicts[c.recipe] = CandidateVerdict(
                verdict="cannot tell", reason="fewer than 2 seeds with a finite final loss: no seed noise to hold the "
                                              "loss against", figure=f"{c.loss_n} and {b.loss_n if b else 0} "
                                                                     "seeds", **common)
            continue
        raced_told = True
        if loss_verdict == "different" and c.loss_mean > b.loss_mean:
            # A matmul format that trains worse everywhere may train like fp32 with a few layers promoted.
            common["keep"] = common["keep"] or plan_hint(c.recipe, evidence.workload, evidence.size, BASELINE_MODE)
            verdicts[c.recipe] = CandidateVerdict(verdict="rejected", reason="trains worse than fp32 beyond seed noise",
                                                  figure=loss_figure, **common)
            continue
        speed_figure = (f"{c.ms_mean:.3g} vs {b.ms_mean:.3g} ms/step (x{common['time_ratio']:.2f}; seed noise "
                        f"allows ±{ms_threshold:.2g} ms)" if ms_verdict != "cannot tell" else
                        f"{c.ms_mean:.3g} vs {b.ms_mean:.3g} ms/step (x{common['time_ratio']:.2f})")
        if ms_verdict == "different" and c.ms_mean > b.ms_mean:
            verdicts[c.recipe] = CandidateVerdict(verdict="rejected", reason="slower than 32-true beyond seed noise",
                                                  figure=speed_figure, **common)
            continue
        faster = ms_verdict == "different"
        if not faster:
            unknowns.append(f"{c.recipe} trains like fp32, but its speed differs from 32-true's by less than the "
                            f"seed noise ({speed_figure}): not told apart here")
        better = " (lower than fp32's beyond seed noise)" if loss_verdict == "different" else ""
        verdicts[c.recipe] = CandidateVerdict(verdict="trains like fp32", reason="stable; final loss within seed noise"
                                              + better, figure=f"{loss_figure}; {speed_figure}", **common)
        acceptable.append((ratio(c), c.recipe, faster))

    faster = sorted((ms, recipe) for ms, recipe, quick in acceptable if quick)
    runnable = [c for c in evidence.candidates if c.runnable and c.recipe != BASELINE_MODE]
    probed = [c for c in runnable if math.isfinite(c.probe_ratio)]
    # Decided: a raced candidate gave a verdict, or the probe alone settled it (nothing was promising enough to race),
    # or there is nothing but 32-true to choose.
    settled_by_probe = bool(probed) and all(c.probe_ratio >= cost.SLOW_FACTOR for c in probed)
    decided = base is not None and (raced_told or (not raced_any and settled_by_probe) or not runnable)
    if faster:
        recommended = faster[0][1]
        rest = [recipe for _, recipe in faster[1:]] or [recipe for _, recipe, _ in sorted(acceptable)
                                                         if recipe != recommended] or [BASELINE_MODE]
        runner_up = rest[0]
        v = verdicts[recommended]
        chosen = evidence.candidate(recommended)
        fix = f" ({chosen.note})" if chosen.fixes else ""
        why = (f"the fastest candidate that trains like fp32 within seed noise{fix}: x{v.time_ratio:.2f} of 32-true's "
               f"ms/step over {chosen.seeds} seeds, {v.figure.split(';')[0]}")
    else:
        recommended = BASELINE_MODE
        runner_up = sorted(acceptable)[0][1] if acceptable else None
        if not runnable:
            why = f"this device ({evidence.device_name}) can run only 32-true among the candidates"
        elif not decided:
            why = "cannot tell: " + ("no raced candidate gave a verdict" if raced_any else
                                     "no candidate was raced within the budget") + " (see what could not be told)"
        elif acceptable:
            why = ("no candidate is measurably faster here; " + ", ".join(r for _, r, _ in sorted(acceptable))
                   + " train like fp32 but are not faster beyond seed noise")
        elif raced_any:
            why = "every candidate raced was unstable, trained worse, or was slower than 32-true here"
        else:
            best = min(probed, key=lambda c: c.probe_ratio)
            unmeasured = len(runnable) - len(probed)
            why = (f"every candidate the cost probe measured took at least x{cost.SLOW_FACTOR:g} of 32-true's ms/step "
                   f"(the best, {best.recipe}, x{best.probe_ratio:.2f})"
                   + (f"; {unmeasured} others gave no figure within the budget" if unmeasured else ""))
    if runner_up is None and recommended != BASELINE_MODE:
        runner_up = BASELINE_MODE
    for recipe, label in ((recommended, "recommended"), (runner_up, "runner-up")):
        if recipe is not None and recipe != BASELINE_MODE:
            verdicts[recipe] = replace(verdicts[recipe], verdict=label)
    unknowns += _cannot_tell(evidence, verdicts)
    ordered = sorted(verdicts.values(), key=lambda v: (VERDICT_ORDER.index(v.verdict),
                                                        v.time_ratio if not math.isnan(v.time_ratio) else math.inf))
    return Advice(recommended=recommended, why=why, runner_up=runner_up, verdicts=tuple(ordered),
                  cannot_tell=tuple(unknowns), decided=decided, evidence=evidence)


def _emulated_block_scaled(recipe: str, device: str) -> bool:
    """Whether `recipe` runs a block-scaled format (MXFP8, NVFP4, blockwise FP8) emulated on `device`."""
    option = get_precision(recipe, device).block_scaled
    return option is not None and not option.native(device)


def _cannot_tell(evidence: Evidence, verdicts: dict[str, CandidateVerdict]) -> list[str]:
    """The limits of this advice that come from the device or the budget, in words."""
    out = []
    cpu = evidence.device == "cpu"
    fp8 = [c.recipe for c in evidence.candidates if c.runnable and "+fp8-" in c.recipe]
    if cpu and fp8:
        out.append(f"FP8 on a CPU is emulated (real float8 casts, no FP8 tensor cores): {', '.join(fp8)} tell nothing "
                   "of their speed on a GPU here")
    block = [c.recipe for c in evidence.candidates if c.runnable and _emulated_block_scaled(c.recipe, evidence.device)]
    if block:
        out.append(f"{', '.join(block)} are emulated here (each GEMM operand quantised and dequantised as the format, "
                   "the products in fp32): judge them on their numerics, not their speed")
    told = [v.recipe for v in verdicts.values() if v.verdict == "cannot tell"]
    if told:
        out.append(f"{', '.join(told)}: the race left fewer than 2 finite seeds, so seed noise could not be measured")
    if any(c.max_batch is not None and c.max_batch_modelled for c in evidence.candidates):
        out.append("the largest batch is modelled on a CPU (bytes measured at two batch sizes), not tried")
    out += list(evidence.notes)
    return out


# --- reading the evidence back --------------------------------------------------------------------------------------
def _probe_figures(reader: RunReader, run_ids: tuple[str, ...]) -> dict[str, tuple[float, float, str, str]]:
    """recipe -> (ms/step, ratio to the same race's 32-true, run id, error), later probe runs over earlier ones."""
    out: dict[str, tuple[float, float, str, str]] = {}
    for run_id in run_ids:
        info = reader.run_info(run_id)
        if info is None:
            continue
        frame = reader.steps(run_id)
        medians: dict[str, float] = {}
        for lane in info.lanes:
            rows = frame[frame["lane"] == lane.lane]
            timed = rows.loc[rows["step"] >= cost.WARMUP_STEPS, "step_ms"].to_numpy(dtype=float)
            if timed.size == 0:
                timed = rows["step_ms"].to_numpy(dtype=float)
            medians[lane.mode] = float(np.median(timed)) if timed.size else math.nan
            if lane.status == "failed" or not timed.size:
                out[lane.mode] = (math.nan, math.nan, run_id, lane.error or "no step finished within the probe's time")
        base = medians.get(BASELINE_MODE, math.nan)
        for mode, ms in medians.items():
            if math.isfinite(ms):
                out[mode] = (ms, ms / base if base > 0 else math.nan, run_id, "")
    return out


def gather(reader: RunReader, race_run: str) -> Evidence:
    """The evidence of the advice anchored on `race_run` (its `advised` event links the rest), from the store or
    this process. A race run without that event is read alone: its lanes are the candidates. ValueError for an
    unknown run."""
    info = reader.run_info(race_run)
    if info is None:
        raise ValueError(f"no run {race_run!r}")
    config = info.settings
    events = reader.events(race_run)
    advised = events[events["kind"] == ADVISED_EVENT]
    data = advised["data"].iloc[-1] if not advised.empty else {}
    data = data if isinstance(data, dict) else {}
    listed = data.get("candidates") or [{"recipe": mode, "runnable": True, "note": ""} for mode in config.modes]
    probe_runs = tuple(data.get("probe_runs", ()))
    probes = _probe_figures(reader, probe_runs)
    batches = data.get("max_batch", {})
    steps_frame = reader.steps(race_run)
    race_steps = int(config.steps)
    warmup = int(data.get("warmup_steps", max(1, round(WARMUP_SHARE * race_steps))))
    series = {lane.lane: lane for lane in reader.lane_series(race_run) if lane.rank == 0}
    firsts = _first_nonfinite(events)
    fixes = {fix["recipe"]: fix for fix in data.get("fixes", ()) if isinstance(fix, dict)}
    plans = {plan["recipe"]: plan for plan in data.get("plans", ()) if isinstance(plan, dict)}
    out = []
    for entry in listed:
        recipe = entry["recipe"]
        fields: dict = {"recipe": recipe, "runnable": bool(entry["runnable"]), "note": str(entry.get("note", ""))}
        if recipe in probes:
            ms, ratio, run_id, error = probes[recipe]
            fields.update(probe_ms=ms, probe_ratio=ratio, probe_run=run_id, probe_error=error)
        lanes = [lane for lane in info.lanes if lane.mode == recipe]
        if lanes:
            fields.update(_race_figures(lanes, series, steps_frame, warmup), first_nonfinite=firsts.get(recipe, ""))
        if recipe in batches:
            fields.update(max_batch=int(batches[recipe]["batch"]), max_batch_modelled=bool(batches[recipe]["modelled"]))
        if recipe in fixes:
            fields["keep"] = keep_line(fixes[recipe])
        if recipe in plans:
            fields["keep"] = "; ".join(filter(None, (fields.get("keep"), plan_line(plans[recipe]))))
        out.append(CandidateEvidence(**fields))
    out += [_fixed_candidate(reader, fix, warmup) for fix in fixes.values() if fix.get("race_run")]
    out += [_fixed_candidate(reader, plan, warmup, note=plan_note(plan)) for plan in plans.values()
            if plan.get("race_run")]
    device = str(data.get("device") or resolve_device(config.device))
    return Evidence(workload=config.workload, size=config.size, device=device,
                    device_name=str(data.get("device_name") or device), race_run=race_run, probe_runs=probe_runs,
                    candidates=tuple(out), race_steps=race_steps, warmup_steps=warmup,
                    budget_s=float(data.get("budget_s", math.nan)), spent_s=float(data.get("spent_s", math.nan)),
                    notes=tuple(data.get("notes", ())), plan=str(data.get("plan", "")),
                    stopped=str(data.get("stopped", "")),
                    unprobed_s=float(data.get("unprobed_s", math.nan)),
                    budget_for_all_s=float(data.get("budget_for_all_s", math.nan)))


def _fixed_candidate(reader: RunReader, fix: dict, warmup: int, note: str = "") -> CandidateEvidence:
    """A fixed recipe (a bisect's keep, or a plan: `note` says which) as a candidate: its lanes and the 32-true lanes
    beside them in the fix's own seeded race."""
    recipe, run_id = fix["fixed_recipe"], fix["race_run"]
    info = reader.run_info(run_id)
    note = note or f"{fix['recipe']} with {', '.join(fix['kept'])} kept in fp32, found by the layer bisect"
    if info is None:
        return CandidateEvidence(recipe=recipe, runnable=True, note=note, fixes=fix["recipe"],
                                 keep=f"fixes {fix['recipe']}: its race run {run_id} is not in the store")
    series = {lane.lane: lane for lane in reader.lane_series(run_id) if lane.rank == 0}
    frame = reader.steps(run_id)

    def figures(mode: str) -> dict:
        lanes = [lane for lane in info.lanes if lane.mode == mode]
        return _race_figures(lanes, series, frame, warmup) if lanes else {}

    yardstick = CandidateEvidence(recipe=BASELINE_MODE, runnable=True, note="raced beside the fix",
                                  **figures(BASELINE_MODE))
    of = f"of {fix.get('candidates', '?')}"
    what = (f"{len(fix['plan'])} {of} layers promoted to {fix.get('rung', '?')}" if fix.get("kind") == "plan" else
            f"{len(fix['kept'])} {of} modules kept in fp32")
    return CandidateEvidence(recipe=recipe, runnable=True, note=note, fixes=fix["recipe"], yardstick=yardstick,
                             keep=f"fixes {fix['recipe']} ({what}); raced beside 32-true in run {run_id}",
                             **figures(recipe))


def _mean_sd(values: list[float]) -> tuple[float, float, int]:
    """(mean, sample standard deviation, n) of the finite values (sd NaN below two), as the seed summaries count."""
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return math.nan, math.nan, 0
    return float(finite.mean()), float(finite.std(ddof=1)) if finite.size > 1 else math.nan, int(finite.size)


def _race_figures(lanes: list, series: dict, steps_frame, warmup: int) -> dict:
    """One recipe's figures across its seeds' lanes in the race: final loss and median ms/step (mean, sd, n),
    stability after warm-up, its lanes' largest memory peak."""
    tracks = [series[lane.lane] for lane in lanes if lane.lane in series]
    loss_mean, loss_sd, loss_n = _mean_sd([track.final_loss(LAST_K) for track in tracks])
    ms_mean, ms_sd, ms_n = _mean_sd([track.stats.median_step_ms for track in tracks])
    mine = steps_frame[steps_frame["lane"].isin([lane.lane for lane in lanes])]
    after = mine[mine["step"] >= warmup]
    peaks = [track.stats.peak_bytes for track in tracks]
    return {"raced": True, "seeds": len(lanes), "steps": min(lane.steps_done for lane in lanes),
            "loss_mean": loss_mean, "loss_sd": loss_sd, "loss_n": loss_n, "ms_mean": ms_mean, "ms_sd": ms_sd,
            "ms_n": ms_n, "diverged": sum(lane.status == "diverged" for lane in lanes),
            "nonfinite_steps": int((~np.isfinite(after["loss"].to_numpy(dtype=float))).sum()),
            "skipped_after_warmup": int(after["skipped"].astype(bool).sum()), "steps_after_warmup": len(after),
            "peak_mib": max(peaks) / 2**20 if peaks else math.nan}


def _first_nonfinite(events) -> dict[str, str]:
    """recipe -> the first inf/NaN module of its replayed failed step (the race's `replayed` events)."""
    from amp_core.diagnostics.replay_modes import REPLAYED_EVENT

    out: dict[str, str] = {}
    for data in events.loc[events["kind"] == REPLAYED_EVENT, "data"]:
        data = data.get("report") if isinstance(data, dict) else None  # record_replay's event: {"report": ...}
        if not isinstance(data, dict):
            continue
        own = next((row for row in data.get("rows", ()) if row.get("mode") == data.get("mode")), None)
        if own is not None and own.get("first_nonfinite"):
            why = own.get("first_nonfinite_why") or ""
            out.setdefault(data["mode"], f"{own['first_nonfinite']} at step {data['step']}" + (f" ({why})" if why
                                                                                                  else ""))
    return out


# --- the orchestrator -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetPlan:
    """How an advice splits its budget, planned from the budget and the candidates before anything runs (each phase
    then gets what the ones before it left: time a probe did not use goes to the race)."""

    budget_s: float
    modes_probe_s: float
    """The cost probe of the modes (one race)."""
    options_probe_s: float
    """The cost probes of the recipe options (chunks of OPTION_CHUNK lanes); 0: none fits."""
    options_planned: int
    """How many recipe options those probes can measure (all of them when the budget allows)."""
    race_share: float
    """The seeded race's share of what is left after the probes and the reserve (the rest: replays, bisects, fixes)."""
    reserve_s: float

    def words(self) -> str:
        options = (f"{self.options_probe_s:.0f} s for {self.options_planned} recipe options" if self.options_planned
                   else "no recipe option")
        return (f"planned: {self.modes_probe_s:.0f} s probing the modes, {options}, {self.race_share:.0%} of the rest "
                f"racing with seeds, the remainder replaying, bisecting and racing fixes, {self.reserve_s:.0f} s "
                "kept for the largest batch")


def plan_budget(budget_s: float, modes: int, options: int) -> BudgetPlan:
    """The plan for `budget_s` seconds, `modes` runnable modes and `options` runnable mode+option recipes: probe every
    one when the budget allows (the options get OPTION_LANE_S each, at most OPTION_PROBE_MAX_SHARE of the budget,
    and nothing when that is under one chunk's OPTION_CHUNK_MIN_S), then race as many as fit with seeds."""
    reserve = RESERVE_SHARE * budget_s
    modes_s = max(MIN_PROBE_S, PROBE_SHARE * budget_s) if modes > 1 else 0.0
    cap = min(OPTION_PROBE_MAX_SHARE * budget_s, max(0.0, budget_s - reserve - modes_s) / 2)
    options_s = min(cap, max(OPTION_CHUNK_MIN_S, OPTION_LANE_S * options)) if options else 0.0
    if options_s < OPTION_CHUNK_MIN_S:
        options_s = 0.0
    planned = options if options_s >= OPTION_LANE_S * options else int(options_s / OPTION_LANE_S)
    return BudgetPlan(budget_s=budget_s, modes_probe_s=modes_s, options_probe_s=options_s,
                      options_planned=planned if options_s else 0, race_share=1 - FIX_SHARE, reserve_s=reserve)


class Stopped(Exception):
    """The advice was stopped from outside (a page's Stop button)."""


class BudgetClock:
    """Seconds spent and left of a budget, from its start."""

    def __init__(self, budget_s: float):
        self.started, self.budget_s = time.monotonic(), budget_s

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def spent(self) -> float:
        return time.monotonic() - self.started


def _refuse_unconvertible(found: list[tuple[str, bool, str]], base: RunConfig) -> list[tuple[str, bool, str]]:
    """The candidates, a block-scaled recipe none of whose layers the workload's model converts refused with why (a
    launch would refuse it: it would race plain bf16 under its name)."""
    model = None
    out = []
    for recipe, ok, note in found:
        option = get_precision(recipe, base.device).block_scaled if ok else None
        if option is not None:
            model = model if model is not None else WORKLOADS[base.workload].seeded_model_and_batch(base)[0]
            why = option.refuses_model(model, base.device)
            ok, note = (False, why) if why else (ok, note)
        out.append((recipe, ok, note))
    return out


def check(config: AdviseConfig) -> tuple[RunConfig, list[tuple[str, bool, str]]]:
    """(the runs' base config, the candidates) for `config`; ConfigError naming the field for bad input: an unknown
    workload or size, a candidate that is not a recipe, a budget too small to decide anything (it says what it could
    do in it)."""
    if config.workload not in WORKLOADS:
        raise ConfigError("workload", f"unknown workload {config.workload!r}; choose from {', '.join(WORKLOADS)}")
    device = resolve_device(config.device)
    base = RunConfig(workload=config.workload, size=config.size, device=device, modes=(BASELINE_MODE,),
                     batch_size=config.batch_size)
    check_launch(base)
    found = _refuse_unconvertible(recipe_candidates(device), base)
    if config.candidates:
        known = {recipe for recipe, _, _ in found}
        for recipe in config.candidates:
            if recipe not in known:
                raise ConfigError("candidates", f"{recipe!r} is not a candidate here; candidates are modes and a mode "
                                                f"with one option ({', '.join(RECIPE_OPTIONS)})")
        wanted = {BASELINE_MODE, *config.candidates}
        found = [entry for entry in found if entry[0] in wanted]
    if config.budget_s < MIN_BUDGET_S:
        runnable = sum(ok for _, ok, _ in found)
        raise ConfigError("budget", f"{config.budget_s / 60:.2g} min is too small to decide anything: in "
                                    f"{config.budget_s:.0f} s it could list the {len(found)} candidates ({runnable} "
                                    f"runnable here) but not probe and race them; give at least "
                                    f"{MIN_BUDGET_S / 60:.2g} min (--budget-min)")
    return base, found


Progress = Callable[[str, float], None]


def advise(config: AdviseConfig, store, *, progress: Progress | None = None,
           stop: threading.Event | None = None, on_run: Callable | None = None) -> Advice:
    """Measure and decide (see the module's docstring) within `config.budget_s`, every run kept in `store`.
    `progress(message, fraction)` is told what it does; `stop` set from another thread ends it at the next step of
    the run under way (Stopped); `on_run(run)` is called with each run it starts. ConfigError for bad input."""
    from amp_core.race.runner import RunManager

    base, found = check(config)
    clock = BudgetClock(config.budget_s)
    stop = stop or threading.Event()
    say = progress or (lambda message, fraction: None)
    manager = RunManager(store, max_running=1)
    notes: list[str] = []
    name = f"advise · {config.workload}"

    def started(run) -> None:
        if on_run is not None:
            on_run(run)
        if stop.is_set():
            run.stop(timeout=0)

    def check_stop() -> None:
        if stop.is_set():
            raise Stopped("stopped")

    runnable = [recipe for recipe, ok, _ in found if ok]
    modes = [recipe for recipe in runnable if "+" not in recipe]
    options = [recipe for recipe in runnable if "+" in recipe]
    probe_runs: list[str] = []
    ratios: dict[str, float] = {}
    """Each probed recipe's ms/step ÷ the 32-true lane's of the same probe race (as `gather` reads them back)."""

    def probe(recipes: list[str], cap_s: float, label: str) -> dict:
        probe_config = replace(base, modes=tuple(recipes), name=f"{name} · cost probe ({label})")
        seen: list = []

        def on_start(run) -> None:
            seen.append(run)
            started(run)

        out = cost.race(probe_config, time_cap_s=cap_s, min_timed_s=min(cost.MIN_TIMED_S, cap_s / 4),
                        on_start=on_start, store=store)
        probe_runs.extend(run.run_id for run in seen)
        yardstick = out.get(BASELINE_MODE)
        for recipe, result in out.items():  # each figure against the 32-true lane raced beside it
            if (isinstance(result, cost.ProbeResult) and isinstance(yardstick, cost.ProbeResult)
                    and recipe != BASELINE_MODE):
                ratios[recipe] = result.ms_per_step / yardstick.ms_per_step
        return out

    # (2) the cost probe ranks them: the modes first (cheap), then every recipe option the plan has time for, each
    # option on its fastest base mode first, in chunks (time a chunk did not use goes to the next, then to the race).
    plan = plan_budget(config.budget_s, len(modes), len(options))
    say(f"{len(found)} candidates, {len(runnable)} runnable here; {plan.words()}; cost probe of the modes", 0.02)
    figures: dict = {}
    probe_began = clock.spent()
    if len(modes) > 1:
        figures.update(probe(modes, plan.modes_probe_s, "modes"))
    check_stop()
    if options and plan.options_probe_s:
        picks = _option_picks(options, figures)
        queue = [*picks, *sorted((r for r in options if r not in picks), key=lambda r: _base_ms(r, figures))]
        until = clock.spent() + plan.options_probe_s
        while queue:
            chunks = math.ceil(len(queue) / OPTION_CHUNK)
            cap = (until - clock.spent()) / chunks
            if cap < OPTION_CHUNK_MIN_S and until - clock.spent() < OPTION_CHUNK_MIN_S:
                break
            chunk, queue = queue[:OPTION_CHUNK], queue[OPTION_CHUNK:]
            say(f"cost probe of {len(chunk)} recipe options ({len(queue)} more after them)", 0.1)
            figures.update(probe(chunk, max(cap, OPTION_CHUNK_MIN_S), "options"))
            check_stop()
        if queue:
            notes.append(f"{len(queue)} recipe options were not probed: the {plan.options_probe_s:.0f} s the plan "
                         f"gave the options ran out (about {len(queue) * OPTION_LANE_S:.0f} s more would probe them)")
    elif options:
        notes.append(f"recipe options were not probed: a budget of {config.budget_s:.0f} s leaves under "
                     f"{OPTION_CHUNK_MIN_S:.0f} s for them, and an option lane built on torchao converts or compiles "
                     "its step first")
    mode_s = (clock.spent() - probe_began) / max(1, sum(1 for recipe in modes if recipe in ratios))
    unprobed = [recipe for recipe in runnable if recipe not in figures and recipe != BASELINE_MODE]
    unprobed_s = sum(OPTION_LANE_S if "+" in recipe else mode_s for recipe in unprobed)
    budget_for_all = max(config.budget_s + unprobed_s, OPTION_LANE_S * len(options) / OPTION_PROBE_MAX_SHARE)
    check_stop()

    # (3) the seeded race of every promising candidate that fits: its length is what the budget leaves after the
    # reserve and the fixes' share; the slowest are dropped only when the race would be too short for a verdict.
    ranked = sorted((ratio, recipe) for recipe, ratio in ratios.items())
    promising = [recipe for ratio, recipe in ranked if ratio < cost.SLOW_FACTOR]
    race_share = plan.race_share * max(clock.left() - plan.reserve_s, 0.0)
    lanes_ms = {recipe: result.ms_per_step for recipe, result in figures.items()
                if isinstance(result, cost.ProbeResult)}
    base_ms = lanes_ms.get(BASELINE_MODE, 0.0)
    race_steps = 0
    while True:
        round_s = (base_ms + sum(lanes_ms[r] for r in promising)) * config.seeds / 1e3 * 1.5  # 1.5: records, memory
        # Without a probe figure (none came within its time) the race is as short as a verdict allows.
        race_steps = min(MAX_RACE_STEPS, int(race_share / round_s)) if round_s > 0 else MIN_RACE_STEPS
        if race_steps >= MIN_RACE_STEPS or not promising:
            break
        dropped = promising.pop()
        notes.append(f"{dropped} was not raced: the budget left too few steps for a verdict with it in the race")
    # 32-true alone (nothing promising) needs no long race: its figures are the yardstick of nothing here.
    race_steps = max(race_steps, MIN_RACE_STEPS) if promising else MIN_RACE_STEPS
    capped_race = race_steps >= MAX_RACE_STEPS
    recipes = (BASELINE_MODE, *promising)
    say(f"seeded race: {', '.join(recipes)} × {config.seeds} seeds × {race_steps} steps", 0.45)
    race_config = replace(base, modes=recipes, seeds=config.seeds, steps=race_steps, name=f"{name} · race")
    run = manager.launch(race_config)
    started(run)
    # At most a quarter over its share: a machine slower than the probe saw leaves the fixes their time all the same.
    run.join(max(min(clock.left() - plan.reserve_s, 1.25 * race_share), 1.0))
    if run.alive:
        notes.append(f"the race was cut by the budget after {max(lane.steps_done for lane in run.lanes)} of "
                     f"{race_steps} steps")
        run.stop()
    check_stop()
    warmup = max(1, round(WARMUP_SHARE * race_steps))

    # (4) stability: the first inf/NaN module of each candidate that broke (a replay of its first failed step), and
    # for one that fails in a few layers the layers to keep, their price and a seeded race of the fix (the bisect).
    broken = replay_failures(manager, run, warmup, clock, notes, say)
    check_stop()
    fixes = keep_fixes(manager, run, broken, clock, notes, say, seeds=config.seeds, race_steps=race_steps,
                       reserve_s=plan.reserve_s, min_steps=MIN_RACE_STEPS)
    check_stop()
    # ... and for one with a matmul format that failed or trained worse than 32-true, a per-layer plan and its race.
    raced = gather(manager, run.run_id)  # the race alone: its lanes are the candidates, judged by decide's rules
    plans = plan_fixes(manager, run, plan_targets(raced, decide(raced)), clock, notes, say, seeds=config.seeds,
                       race_steps=race_steps, reserve_s=plan.reserve_s, plan_dir=config.plan_dir, stop=stop,
                       min_steps=MIN_RACE_STEPS)
    check_stop()

    # (5) memory (in the race's records) and the largest batch of the recommended, the runner-up and 32-true.
    recorded = dict(found=found, probe_runs=probe_runs, warmup=warmup, budget_s=config.budget_s, notes=notes,
                    device=base.device, fixes=fixes, plans=plans, plan=plan.words(), unprobed_s=unprobed_s,
                    budget_for_all_s=budget_for_all)
    record_advice(manager, run.run_id, spent_s=clock.spent(), **recorded)
    advice = decide(gather(manager, run.run_id))
    wanted = [r for r in dict.fromkeys((advice.recommended, advice.runner_up, BASELINE_MODE)) if r]
    batches: dict = {}
    if clock.left() > 5:
        say(f"largest batch of {', '.join(wanted)}", 0.9)
        try:
            from amp_core.diagnostics.maxbatch import max_batches

            for entry in max_batches(config.workload, tuple(wanted), size=config.size, device=base.device):
                batches[entry.recipe] = {"batch": entry.batch, "modelled": entry.modelled,
                                         "budget_mib": entry.budget_bytes / 2**20}
        except Exception as error:  # a failed search costs the batch figures, not the advice
            notes.append(f"largest batch not found: {type(error).__name__}: {str(error).splitlines()[0]}")
    else:
        notes.append("largest batch not searched: the budget ran out")
    spent = clock.spent()
    stopped = stop_reason(config.budget_s, spent, advice.decided, unprobed=len(unprobed),
                          capped_race=capped_race, race_steps=race_steps, failed=len(broken))
    record_advice(manager, run.run_id, spent_s=spent, max_batch=batches, stopped=stopped, **recorded)
    advice = decide(gather(manager, run.run_id))
    say(advice.line(), 1.0)
    return advice


def stop_reason(budget_s: float, spent_s: float, decided: bool, *, unprobed: int, capped_race: bool,
                race_steps: int, failed: int) -> str:
    """Why the advice stopped where it did, in words: the budget spent, or — under USED_ENOUGH of it — what was
    complete (every runnable candidate probed, the race at the length no verdict needs more than, each failure looked
    at) and whether the answer was decided."""
    used = f"used {spent_s:.0f} s of its {budget_s:.0f} s budget ({spent_s / budget_s:.0%})"
    if spent_s >= USED_ENOUGH * budget_s:
        return f"{used}: the budget was spent as planned"
    done = ["every runnable candidate was probed" if not unprobed else f"{unprobed} candidates were left unprobed",
            f"the race reached {race_steps} steps" + (" (more change no verdict)" if capped_race else ""),
            f"{failed} failed candidate{'s' if failed != 1 else ''} looked at"]
    if decided and race_steps <= MIN_RACE_STEPS and not unprobed:
        return f"{used}: decided sooner — no candidate was promising enough to race against 32-true"
    if decided:
        return f"{used}: decided sooner — {', '.join(done)}"
    return f"{used}: stopped with the answer not decided — {', '.join(done)}; nothing planned was left to run"


def _base_ms(recipe: str, figures: dict) -> float:
    """The cost probe's ms/step of the mode `recipe` builds on (inf where it is not measured)."""
    result = figures.get(recipe_mode(recipe))
    return result.ms_per_step if isinstance(result, cost.ProbeResult) else math.inf


def _option_picks(options: list[str], figures: dict) -> list[str]:
    """Each recipe option once, on the fastest base mode it goes with (by the modes' cost probe; 32-true where that
    is not measured)."""
    picks: dict[str, str] = {}
    for recipe in sorted(options, key=lambda r: _base_ms(r, figures)):
        picks.setdefault(recipe.split("+", 1)[1], recipe)
    return list(picks.values())


def replay_failures(manager, run, warmup: int, clock: BudgetClock, notes: list[str],
                    say: Progress) -> dict[str, tuple[int, int]]:
    """(4) For each candidate whose lanes skipped a step or lost its loss to inf/NaN after warm-up (REPLAYS_AT_MOST),
    replay its first failed step in the run's process (from its snapshots) and record the report as the run's
    `replayed` event: its own mode's row names the first module that held inf/NaN. What could not be replayed is a
    note, not a failure. Returns each failed candidate's (lane, first failed step)."""
    from amp_core.diagnostics.replay import replay_run

    frame = run.frame()
    broken: dict[str, tuple[int, int]] = {}
    for lane in run.lanes:
        rows = frame[frame["lane"] == lane.index]  # a non-finite loss fails at any step; a skip only after warm-up
        failed = rows[(rows["skipped"].astype(bool) & (rows["step"] >= warmup))
                      | ~np.isfinite(rows["loss"].to_numpy(dtype=float))]
        if not failed.empty and lane.mode not in broken:
            broken[lane.mode] = (lane.index, int(failed["step"].iloc[0]))
    for mode, (lane, step) in list(broken.items())[:REPLAYS_AT_MOST]:
        if clock.left() < 0.1 * clock.budget_s:
            notes.append(f"the first inf/NaN module of {mode} was not looked for: the budget ran out")
            continue
        say(f"replaying {mode}'s first failed step ({step}) to find its first inf/NaN module", 0.8)
        try:
            replay_run(manager, run.run_id, lane, step, record=True)
        except Exception as error:  # the replay's failure costs one figure, not the advice
            notes.append(f"{mode}'s step {step} could not be replayed: {str(error).splitlines()[0]}")
    return broken


def record_advice(manager, race_run: str, *, found: list[tuple[str, bool, str]], probe_runs: list[str], warmup: int,
                  budget_s: float, spent_s: float, notes: list[str], device: str,
                  max_batch: dict | None = None, fixes: list[dict] | None = None, plan: str = "", stopped: str = "",
                  unprobed_s: float = math.nan, budget_for_all_s: float = math.nan,
                  plans: list[dict] | None = None) -> None:
    """The `advised` event on the race run: the links and figures the advice needs beyond the runs' records (`fixes`:
    advise_fix.keep_fixes's records: the layers to keep, their price, the fix race's run; `plans`:
    advise_plan.plan_fixes's: the plan, its search, the plan race's run)."""
    data = {"candidates": [{"recipe": recipe, "runnable": ok, "note": note} for recipe, ok, note in found],
            "probe_runs": list(probe_runs), "warmup_steps": warmup, "budget_s": budget_s, "spent_s": spent_s,
            "notes": list(notes), "device": device, "device_name": device_name(device),
            "max_batch": max_batch or {}, "fixes": list(fixes or []), "plans": list(plans or []), "plan": plan,
            "stopped": stopped,
            "unprobed_s": unprobed_s, "budget_for_all_s": budget_for_all_s}
    manager.record_event(race_run, ADVISED_EVENT, f"advice evidence: race {race_run}, cost probes "
                                                   f"{', '.join(probe_runs) or 'none'}", **data)


class AdviceJob:
    """`advise` off the caller's thread (the Advise page): the input is checked at once (ConfigError); `progress`
    lists what it did, `stop()` ends it within a lane step, `done` says when `advice` (or `error`, one line) is
    there; `run_ids` are the evidence runs made so far."""

    def __init__(self, config: AdviseConfig, store):
        check(config)
        self.config, self.store = config, store
        self.progress: list[tuple[float, str, float]] = []
        """(seconds since start, message, fraction done)."""
        self.advice: Advice | None = None
        self.error = ""
        self.run_ids: list[str] = []
        self._stop = threading.Event()
        self._runs: list = []
        self._started = time.monotonic()
        self._thread = background.start(self._work, "amp-advise", stop=self.stop)

    def _on_run(self, run) -> None:
        self._runs.append(run)
        self.run_ids.append(run.run_id)

    def _say(self, message: str, fraction: float) -> None:
        self.progress.append((time.monotonic() - self._started, message, fraction))

    def _work(self) -> None:
        try:
            self.advice = advise(self.config, self.store, progress=self._say, stop=self._stop, on_run=self._on_run)
        except Stopped:
            self.error = "stopped: the runs made so far are in the store"
        except Exception as error:  # a page shows one line, not a traceback
            self.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def stop(self) -> None:
        self._stop.set()
        for run in list(self._runs):
            run.stop(timeout=0)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def fraction(self) -> float:
        return self.progress[-1][2] if self.progress else 0.0

    def wait(self, timeout_s: float | None = None) -> bool:
        self._thread.join(timeout_s)
        return self.done
