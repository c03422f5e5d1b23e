"""The advisor's step (4) for a candidate that fails in a few layers: the layer bisect on the race's failing lane
(amp_core.diagnostics.bisect, recorded as the race run's `bisected` event), its price, and a seeded race of the fixed
recipe (`MODE+keep:…`) beside 32-true, so the decision can weigh the fix like any candidate — its figures measured on
this device, not modelled. Each step is skipped with its reason when the advice's budget is short."""

from __future__ import annotations

import math
from dataclasses import replace

from amp_core.precision import BASELINE_MODE

BISECTS_AT_MOST = 2
"""Failed candidates bisected (each costs a few replays of one step and a short price race)."""
FEW_LAYERS = 0.25
"""A set of more than this share of the model's modules is not "a few layers": reported, not raced as a candidate
(keeping most of the model is fp32 with extra casts)."""
PRICE_STEPS = 8
"""Steps of the bisect's price race (the failing lane, the fixed lane and 32-true from the same snapshot)."""
BISECT_STEPS_EST = 30
"""A bisect costs about this many lane steps of the mode (the 32-true reference, ~5 trials, a re-train from the
snapshot to the failing step and 3 x PRICE_STEPS): with layer numerics' probes, the estimate the budget is held to."""
MIN_BISECT_S = 5.0
"""... and at least this long (copies of the model, layer numerics' probes)."""


def bisect_estimate_s(ms_per_step: float, snapshot_every: int) -> float:
    steps = BISECT_STEPS_EST + snapshot_every
    return max(MIN_BISECT_S, 3 * steps * ms_per_step / 1e3) if math.isfinite(ms_per_step) else MIN_BISECT_S


def keep_fixes(manager, run, broken: dict[str, tuple[int, int]], clock, notes: list[str], say, *, seeds: int,
               race_steps: int, reserve_s: float, min_steps: int = 40) -> list[dict]:
    """For each failed candidate (`broken`: recipe -> (lane, first failed step), BISECTS_AT_MOST of them) whose lanes
    lost their loss to inf/NaN or kept skipping: the bisect from its snapshot, then — when the set is a few layers
    and the budget allows — a seeded race of the fixed recipe beside 32-true. Returns the records the `advised` event
    keeps (one per candidate: what was found, its price, the fix race's run, or why a step was skipped); `reserve_s`
    is kept for what comes after; a fix race shorter than `min_steps` (the advice's shortest race) is not run."""
    from amp_core.config import ConfigError
    from amp_core.diagnostics.bisect import BisectConfig, bisect_run

    frame = run.frame()
    fixes = []
    for recipe, (lane, step) in list(broken.items())[:BISECTS_AT_MOST]:
        record: dict = {"recipe": recipe, "step": step, "verdict": "", "kept": [], "why": ""}
        fixes.append(record)
        ms = float(frame.loc[frame["lane"] == lane, "step_ms"].median())
        need = bisect_estimate_s(ms, run.config.snapshot_every)
        left = clock.left() - reserve_s
        if left < need:
            record["why"] = (f"not bisected: the budget left {max(left, 0):.0f} s, a bisect of {recipe} here needs "
                             f"about {need:.0f} s (a larger --budget-min runs it)")
            notes.append(f"the layers to keep for {recipe} were not looked for: {record['why']}")
            continue
        say(f"bisecting {recipe}'s step {step}: the fewest modules to keep in fp32", 0.82)
        try:
            report = bisect_run(manager, run.run_id, lane, step=step, record=True,
                                check=BisectConfig(price_steps=PRICE_STEPS))
        except ConfigError as error:  # a bisect that cannot be made costs this figure, not the advice
            record["why"] = f"not bisected: {error.field}: {error.why}"
            continue
        rows = {row.recipe: row for row in report.price}
        record.update(verdict=report.verdict, kept=list(report.kept), candidates=report.candidates,
                      trials=len(report.trials), seconds=report.seconds, minimal=report.minimal,
                      fixed_recipe=report.fixed_recipe if report.verdict == "fixed" else "",
                      price_line=report.price_line(), why="" if report.verdict == "fixed" else report.why,
                      **_price(rows, recipe, report.fixed_recipe))
        if report.verdict != "fixed":
            continue
        if len(report.kept) > FEW_LAYERS * report.candidates:
            record["why"] = (f"the set is {len(report.kept)} of {report.candidates} modules, more than a few layers: "
                             "not raced as a candidate")
            continue
        fixed = rows.get(report.fixed_recipe)
        base = frame.loc[frame["mode"] == BASELINE_MODE, "step_ms"].median()
        round_s = (float(base) + (fixed.ms_per_step if fixed else ms)) * seeds / 1e3 * 1.5  # 1.5: records, memory
        left = clock.left() - reserve_s
        steps = min(race_steps, int(left / round_s)) if round_s > 0 else race_steps  # its own 32-true: fewer is fair
        fewest = min(min_steps, race_steps)
        if steps < fewest:
            detail = (f"{fewest} steps x {seeds} seeds beside 32-true need about {round_s * fewest:.0f} s, the budget "
                      f"left {max(left, 0):.0f} s")
            record["why"] = f"the fixed recipe was not raced: {detail}"
            notes.append(f"{report.fixed_recipe} (the fix of {recipe}) was not raced ({detail}): whether it trains "
                         "like fp32 within seed noise is not told here")
            continue
        say(f"seeded race of the fix: {report.fixed_recipe} beside 32-true, {steps} steps", 0.86)
        fix_config = replace(run.config, modes=(BASELINE_MODE, report.fixed_recipe), seeds=seeds, steps=steps,
                             name=f"{run.config.name} · fix of {recipe}")
        fix_run = manager.launch(fix_config)
        fix_run.join(max(left, 1.0))
        if fix_run.alive:
            notes.append(f"the race of {report.fixed_recipe} was cut by the budget after "
                         f"{min(entry.steps_done for entry in fix_run.lanes)} of {steps} steps")
            fix_run.stop()
        record["race_run"] = fix_run.run_id
    return fixes


def _price(rows: dict, recipe: str, fixed_recipe: str) -> dict:
    """The fix's price from the bisect's price race: ms/step against the failing lane's, and held bytes against it —
    or against 32-true's when the failing lane skipped its steps (it then never made its optimizer state)."""
    own, fixed, base = rows.get(recipe), rows.get(fixed_recipe), rows.get(BASELINE_MODE)
    if own is None or fixed is None or not own.ms_per_step > 0:
        return {}
    against = own if not own.skipped or base is None else base
    return {"speed_pct": 100 * (fixed.ms_per_step / own.ms_per_step - 1),
            "memory_mib": (fixed.memory_bytes - against.memory_bytes) / 2**20, "memory_against": against.recipe}


def keep_line(fix: dict) -> str:
    """'keep 1 module in fp32: blocks.2.gain — price +5% ms/step, +0.00 MiB held (vs 32-true; measured)', or why
    there is none."""
    if fix.get("verdict") != "fixed":
        return fix.get("why") or "not bisected"
    kept = fix["kept"]
    line = f"keep {len(kept)} module{'s' if len(kept) != 1 else ''} in fp32: {', '.join(kept)}"
    if "speed_pct" in fix:
        line += (f" — price {fix['speed_pct']:+.0f}% ms/step against {fix['recipe']}, {fix['memory_mib']:+.2f} MiB "
                 f"held (against {fix['memory_against']}; measured)")
    if not fix.get("minimal", True):
        line += " (the trial budget ran out: perhaps not the smallest set)"
    return line + (f"; {fix['why']}" if fix.get("why") else "")
