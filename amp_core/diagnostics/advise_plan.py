"""The advisor's step (4) for a candidate with a matmul format (FP8, MXFP8, NVFP4, ...) that failed or trained worse
than 32-true: the plan search (amp_core.diagnostics.plan_search) promotes its most-hurt layers until it trains like
32-true, then a seeded race of the plan lane beside 32-true, so the decision weighs the plan like any candidate by its
own rules. A whole-model format that fails often fails in a few layers (an outlier channel, gradients under the
format's range); a plan keeps the rest of the model in the cheap format. Skipped with its reason when the advice's
budget has no room for a search."""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from pathlib import Path

from amp_core.precision import BASELINE_MODE

PLANS_AT_MOST = 1
"""Failed candidates searched for a plan (each search is several seeded races): the fastest first."""
TRIALS_EST = 6
"""A search costs about this many seeded races of the candidate (the target as it is, every layer one rung up, two
groups of promoted layers, two demotions) plus one of 32-true: the estimate the budget is held to."""
PLAN_REASONS = ("trains worse than fp32", "unstable")
"""The rejections a plan may cure (a slower candidate stays slower with layers promoted)."""


def plan_targets(evidence, advice) -> list[str]:
    """The candidates a plan may save, fastest first: raced, rejected for their loss or stability, with a matmul format
    and no keep or plan of their own (plan_search.plan_hint's test)."""
    from amp_core.diagnostics.plan_search import plan_hint

    rejected = [v for v in advice.verdicts if v.verdict == "rejected" and v.reason.startswith(PLAN_REASONS)]
    out = [v for v in rejected if evidence.candidate(v.recipe).raced and not evidence.candidate(v.recipe).fixes
           and plan_hint(v.recipe, evidence.workload, evidence.size, BASELINE_MODE)]
    return [v.recipe for v in sorted(out, key=lambda v: v.time_ratio if math.isfinite(v.time_ratio) else math.inf)]


def plan_fixes(manager, run, targets: list[str], clock, notes: list[str], say, *, seeds: int, race_steps: int,
               reserve_s: float, plan_dir: str = "", stop: threading.Event | None = None,
               min_steps: int = 40) -> list[dict]:
    """For each candidate of `run` (the advice's seeded race) a plan may save (`targets`: `plan_targets` of the race's
    evidence and decision; PLANS_AT_MOST of them):
    the plan search against 32-true with the race's own settings, then — when it found layers to promote and the
    budget allows — a seeded race of the plan lane beside 32-true. Returns the records the `advised` event keeps
    (one per candidate: the plan, the search's trials, the plan race's run, or why a step was skipped); `reserve_s` is
    kept for what comes after; plan files are written in `plan_dir` (default: here)."""
    from amp_core.config import ConfigError
    from amp_core.diagnostics.plan_report import PlanSearchConfig
    from amp_core.diagnostics.plan_search import Stopped, lane_format, search

    frame = run.frame()
    base_ms = float(frame.loc[frame["mode"] == BASELINE_MODE, "step_ms"].median())
    plans = []
    for recipe in targets[:PLANS_AT_MOST]:
        record: dict = {"recipe": recipe, "kind": "plan", "plan": {}, "why": ""}
        plans.append(record)
        ms = float(frame.loc[frame["mode"] == recipe, "step_ms"].median())
        round_s = (ms + base_ms) * seeds * race_steps / 1e3 * 1.5  # 1.5: records, memory, building the lanes
        need = round_s * TRIALS_EST + round_s  # the trials (and 32-true once), then the plan raced beside 32-true
        left = clock.left() - reserve_s
        if not math.isfinite(need) or left < need:
            record["why"] = (f"no plan searched: the budget left {max(left, 0):.0f} s, a plan search of {recipe} here "
                             f"needs about {need:.0f} s (a larger --budget-min runs it)")
            notes.append(f"a per-layer plan for {recipe} was not looked for: {record['why']}")
            continue
        say(f"plan search for {recipe}: the layers to promote until it trains like {BASELINE_MODE}", 0.84)
        config = run.config
        target_format = lane_format(recipe)
        search_config = PlanSearchConfig(workload=config.workload, target=recipe, baseline=BASELINE_MODE,
                                         size=config.size, budget_s=left - round_s, device=config.device, seeds=seeds,
                                         steps=race_steps, batch_size=config.batch_size, lr=config.lr,
                                         plan_path=str(Path(plan_dir or ".") / f"advise-plan-{config.workload}-"
                                                                               f"{target_format}.toml"))
        try:
            report = search(search_config, manager.store, progress=lambda message, fraction: say(message, 0.85),
                            stop=stop)
        except ConfigError as error:  # a search that cannot be made costs this figure, not the advice
            record["why"] = f"no plan searched: {error.field}: {error.why}"
            continue
        except Stopped:
            record["why"] = "the plan search was stopped"
            break
        record.update(plan=dict(report.plan), candidates=len(report.candidates), trials=len(report.trials),
                      seconds=report.seconds, minimal=not report.stopped, plan_file=report.plan_file,
                      rung=next(iter(report.plan.values()), ""), trial_runs=[t.figures.run_id for t in report.trials])
        if not report.found or not report.plan:
            record["why"] = (f"no plan: {report.why}" if not report.found else
                             f"the search's own race found {recipe} within seed noise as it is: nothing to promote")
            continue
        left = clock.left() - reserve_s
        steps = min(race_steps, int(left / (round_s / race_steps)))
        fewest = min(min_steps, race_steps)
        if steps < fewest:
            record["why"] = (f"the plan was not raced beside {BASELINE_MODE}: {fewest} steps x {seeds} seeds need "
                             f"about {round_s * fewest / race_steps:.0f} s, the budget left {max(left, 0):.0f} s")
            notes.append(f"{report.plan_recipe} (the plan for {recipe}) was not raced: whether it trains like fp32 "
                         "within seed noise is not told here")
            continue
        say(f"seeded race of the plan: {report.plan_recipe} beside {BASELINE_MODE}, {steps} steps", 0.88)
        plan_run = manager.launch(replace(config, modes=(BASELINE_MODE, report.plan_recipe), seeds=seeds, steps=steps,
                                          name=f"{config.name} · plan for {recipe}"))
        plan_run.join(max(left, 1.0))
        if plan_run.alive:
            notes.append(f"the race of {report.plan_recipe} was cut by the budget after "
                         f"{min(entry.steps_done for entry in plan_run.lanes)} of {steps} steps")
            plan_run.stop()
        record.update(fixed_recipe=report.plan_recipe, race_run=plan_run.run_id)
    return plans


def plan_line(record: dict) -> str:
    """'a plan: 2 of 7 layers promoted to mxfp8 (blocks.1.linear, blocks.4.linear), found in 6 trials; raced as
    RECIPE', or why there is none."""
    if not record.get("plan"):
        return record.get("why") or "no plan searched"
    names = list(record["plan"])
    line = (f"a plan: {len(names)} of {record.get('candidates', '?')} layers promoted to {record.get('rung', '?')} "
            f"({', '.join(names)}), found in {record.get('trials', '?')} trials")
    if not record.get("minimal", True):
        line += " (the search's budget ran out: perhaps not the smallest set)"
    if record.get("race_run"):
        line += f"; raced as {record['fixed_recipe']}"
    return line + (f"; {record['why']}" if record.get("why") else "")


def plan_note(record: dict) -> str:
    """A plan candidate's note: what it is and where it came from."""
    return (f"{record['recipe']} with {len(record['plan'])} of {record.get('candidates', '?')} layers promoted to "
            f"{record.get('rung', '?')}, found by the plan search")
