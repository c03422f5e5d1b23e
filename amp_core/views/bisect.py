"""Bisect views: a bisect's trials and price race as tables, and the report as the CLI prints it (the set, every
trial, the price line, the fix as code)."""

from __future__ import annotations

import pandas as pd

from amp_core.diagnostics.bisect import BisectReport
from amp_core.fixes import fix_code
from amp_core.precision import keep_output_note


def _kept_text(kept: tuple[str, ...], limit: int = 4) -> str:
    if not kept:
        return "(none: the lane as it is)"
    shown = ", ".join(kept[:limit])
    return f"{shown} … ({len(kept)} modules)" if len(kept) > limit else shown


def trials_frame(report: BisectReport) -> pd.DataFrame:
    """One row per trial: its number, the modules kept, the outcome, seconds."""
    return pd.DataFrame([{"trial": index + 1, "kept in fp32": _kept_text(trial.kept), "modules": len(trial.kept),
                          "outcome": trial.outcome + (f" (first inf/NaN: {trial.first_nonfinite})"
                                                      if trial.first_nonfinite else ""),
                          "s": round(trial.seconds, 2)} for index, trial in enumerate(report.trials)],
                        columns=["trial", "kept in fp32", "modules", "outcome", "s"])


def price_frame(report: BisectReport) -> pd.DataFrame:
    """The price race: each lane's ms/step (median), memory held (MiB), last loss and skipped steps."""
    return pd.DataFrame([{"lane": row.recipe, "ms/step": round(row.ms_per_step, 3),
                          "held MiB": round(row.memory_bytes / 2**20, 3), "loss": row.loss_text,
                          "skipped": row.skipped}
                         for row in report.price], columns=["lane", "ms/step", "held MiB", "loss", "skipped"])


def bisect_text(report: BisectReport) -> str:
    """The CLI's print-out: what was bisected, every trial, the set, the price race, the fix as code, and the price
    line last."""
    steps = f"step {report.first_step}" if report.first_step == report.last_step else \
        f"window {report.first_step}:{report.last_step + 1}"
    lines = [f"run {report.run_id} · lane {report.lane} ({report.recipe}) · {steps}",
             f"from: {report.source}",
             f"{len(report.trials)} trials in {report.seconds:.1f} s over {report.candidates} candidate modules", "",
             trials_frame(report).to_string(index=False), ""]
    if report.evidence:
        lines.append("evidence (layer numerics on the failing step): " + "; ".join(
            f"{name}: {words}" for name, words in list(report.evidence.items())[:5]))
    if report.verdict == "fixed":
        lines += [f"set: {', '.join(report.kept)}" + ("" if report.minimal else " (perhaps not minimal)")]
        lines += [f"  1-minimal: without {name}: {outcome}" for name, outcome in report.without.items()]
        lines += [f"fixed lane: {report.fixed_recipe}", f"keep: {keep_output_note(report.recipe)}", "",
                  price_frame(report).to_string(index=False), "", fix_code(report.kept, report.recipe), ""]
    elif report.price:  # a set that failed its price race: the race, never the set as a fix
        lines += ["", price_frame(report).to_string(index=False), ""]
    lines += [f"note: {note}" for note in report.notes]
    lines.append(report.price_line())
    return "\n".join(lines)
