"""The advice (amp_core.diagnostics.advise) for people: its table, its sentences, the CLI's text and the HTML report
(the race run's charts with it, through views/report.py's machinery). Each function takes an `Advice` made by the
caller (`decide(gather(reader, race_run))`): views read run sources, and the advisor's module drives the runner."""

from __future__ import annotations

import html
import math
import time
from typing import TYPE_CHECKING, Any

import pandas as pd
from plotly.offline import get_plotlyjs

from amp_core.diagnostics.seednoise import DIFFERENCE_RULE
from amp_core.views import report

if TYPE_CHECKING:
    from amp_core.runs import RunReader

Advice = Any
"""amp_core.diagnostics.advise.Advice (not imported: that module drives the runner, which views never reach)."""
TABLE_COLUMNS = ("recipe", "verdict", "time vs 32-true", "final loss − 32-true", "peak MiB", "max batch", "reason",
                 "layers to keep", "figure")


def _ratio(value: float) -> str:
    return "—" if value is None or not math.isfinite(value) else f"x{value:.2f}"


UNMEASURED = ("not measured", "refused")
"""Verdicts of candidates with no figure of their own: counted in `unmeasured_lines`, not given a row each."""


def advice_table(advice: Advice) -> pd.DataFrame:
    """One row per measured candidate, the decision first (the recommendation, the runner-up, the others that train
    like fp32, 32-true, then every rejected one with its reason): its step time and final loss against 32-true, its
    memory peak and largest batch, why, and the figure that decided it. Candidates with no figure are
    `unmeasured_lines`."""
    rows = [{"recipe": v.recipe, "verdict": v.verdict, "time vs 32-true": _ratio(v.time_ratio),
             "final loss − 32-true": "—" if not math.isfinite(v.loss_delta) else f"{v.loss_delta:+.3g}",
             "peak MiB": "—" if not math.isfinite(v.peak_mib) else f"{v.peak_mib:,.2f}",
             "max batch": "—" if v.max_batch is None else f"{v.max_batch:,}", "reason": v.reason,
             "layers to keep": _keep_cell(v.keep), "figure": v.figure}
            for v in advice.verdicts if v.verdict not in UNMEASURED]
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def unmeasured_lines(advice: Advice) -> list[str]:
    """The candidates without a figure, one line each kind: the runnable ones not measured (how many were not
    probed, not raced, or gave no figure, and about how much more budget would probe them), and those this device
    refuses (with the reasons)."""
    out = []
    missing = [v for v in advice.verdicts if v.verdict == "not measured"]
    if missing:
        kinds: dict[str, int] = {}
        for v in missing:
            kinds[v.reason] = kinds.get(v.reason, 0) + 1
        evidence = advice.evidence
        unprobed = kinds.get("not probed within the budget", 0)
        more = (f"; about {evidence.unprobed_s:.0f} s more of cost probes would measure the {unprobed} not probed "
                f"(--budget-min {math.ceil(evidence.budget_for_all_s / 60)} plans them all)"
                if unprobed and math.isfinite(evidence.unprobed_s) else "")
        out.append(f"not measured: {len(missing)} runnable candidates (" + ", ".join(
            f"{count} {reason}" for reason, count in kinds.items()) + f"){more}")
    refused = [v for v in advice.verdicts if v.verdict == "refused"]
    if refused:
        reasons: dict[str, int] = {}
        for v in refused:
            reasons[v.reason] = reasons.get(v.reason, 0) + 1
        out.append(f"refused here: {len(refused)} candidates (" + "; ".join(
            f"{count}: {reason}" for reason, count in reasons.items()) + ")")
    return out


KEEP_CELL = 60
"""The table's keep cell is cut to this many characters (a long set is whole in keep_lines)."""


def _keep_cell(keep: str) -> str:
    """The table's short form of a keep line: the set (or 'not bisected'); keep_lines gives it whole."""
    cell = keep.split(":", 1)[0] if keep.startswith("not ") else keep.split(" — ", 1)[0]
    return cell if len(cell) <= KEEP_CELL else cell[:KEEP_CELL - 1] + "…"


def keep_lines(advice: Advice) -> list[str]:
    """The layer bisect's and the plan search's answer for each candidate they looked at (`RECIPE: keep N modules in
    fp32: … — price …`, `RECIPE: a plan: N of M layers promoted to …`, or why there is none), and for each fixed
    recipe or plan lane what it fixes."""
    return [f"{v.recipe}: {v.keep}" for v in advice.verdicts if v.keep]


def figure_lines(advice: Advice) -> list[str]:
    """The figure that decided each candidate measured, one line each (`RECIPE: figure`)."""
    return [f"{v.recipe}: {v.figure}" for v in advice.verdicts if v.figure not in ("—", "not raced")]


def savings(advice: Advice) -> list[str]:
    """What the recommended recipe and the runner-up save against 32-true: step time, memory, batch."""
    base = advice.verdict("32-true")
    out = []
    for label, recipe in (("recommended", advice.recommended), ("runner-up", advice.runner_up)):
        v = advice.verdict(recipe) if recipe else None
        if v is None or recipe == "32-true":
            continue
        parts = []
        if math.isfinite(v.time_ratio):
            parts.append(f"step time x{v.time_ratio:.2f} ({(v.time_ratio - 1):+.0%})")
        if base is not None and math.isfinite(v.peak_mib) and math.isfinite(base.peak_mib) and base.peak_mib > 0:
            parts.append(f"memory peak {v.peak_mib:,.2f} vs {base.peak_mib:,.2f} MiB "
                         f"({v.peak_mib / base.peak_mib - 1:+.0%})")
        if base is not None and v.max_batch is not None and base.max_batch:
            parts.append(f"largest batch {v.max_batch:,} vs {base.max_batch:,} ({v.max_batch / base.max_batch:.2f}x)")
        out.append(f"{label} {recipe}: " + ("; ".join(parts) if parts else "no figure against 32-true"))
    return out


def evidence_lines(advice: Advice) -> list[str]:
    evidence = advice.evidence
    spent = f", {evidence.spent_s:.0f} s of a {evidence.budget_s:.0f} s budget" if math.isfinite(
        evidence.spent_s) else ""
    return [f"race run {evidence.race_run} ({evidence.race_steps} steps, warm-up {evidence.warmup_steps}{spent})",
            *(f"cost probe run {run_id}" for run_id in evidence.probe_runs)]


def budget_lines(advice: Advice) -> list[str]:
    """How the advice planned its budget, how much of it it used and why it stopped there."""
    evidence = advice.evidence
    return [line for line in (evidence.stopped, evidence.plan) if line]


def advice_text(advice: Advice) -> str:
    """The CLI's output: the table, savings, what could not be told, the evidence runs, and last the line
    `recommend: RECIPE — why`."""
    evidence = advice.evidence
    table = advice_table(advice).drop(columns=["figure"])
    lines = [f"advice for {evidence.workload} ({evidence.size}) on {evidence.device_name}", advice.line()]
    if advice.runner_up:
        lines.append(f"runner-up: {advice.runner_up}")
    lines += [*(f"budget: {line}" for line in budget_lines(advice)), "",
              table.to_string(index=False, max_colwidth=70), *unmeasured_lines(advice), ""]
    lines += [f"figure · {line}" for line in figure_lines(advice)]
    lines += [f"keep · {line}" for line in keep_lines(advice)]
    lines += ["", *savings(advice), "", "could not be told here:", *(f"  - {line}" for line in advice.cannot_tell),
              "", "evidence (runs in the store):", *(f"  {line}" for line in evidence_lines(advice)),
              f"  seed noise: {DIFFERENCE_RULE}", "", advice.line()]
    return "\n".join(lines)


def advice_report_html(reader: RunReader, advice: Advice) -> str:
    """The advice as one self-contained HTML page: the recommendation, the table, savings, what could not be told,
    the evidence runs, and the race run's charts (views/report.py's, read through `reader`)."""
    evidence = advice.evidence
    race_run = evidence.race_run
    esc = html.escape
    info = reader.run_info(race_run)
    parts = [f"<h1>AMP Lab advice · {esc(evidence.workload)} ({esc(evidence.size)})</h1>",
             f'<p class="meta">{esc(evidence.device_name)} · report written '
             f'{esc(time.strftime("%Y-%m-%d %H:%M:%S %Z"))}</p>',
             f"<h2>Recommendation</h2><p><b>{esc(advice.line())}</b></p>",
             "<ul>" + "".join(f"<li>{esc(line)}</li>" for line in savings(advice)) + "</ul>",
             "<h2>Every candidate</h2>" + report._table(advice_table(advice))
             + "".join(f"<p>{esc(line)}</p>" for line in (*unmeasured_lines(advice), *budget_lines(advice))),
             *(["<h2>Layers to keep or promote (the layer bisect, the plan search)</h2><ul>"
                + "".join(f"<li>{esc(line)}</li>" for line in keep_lines(advice)) + "</ul>"] if keep_lines(advice)
               else []),
             "<h2>What could not be told here</h2><ul>"
             + "".join(f"<li>{esc(line)}</li>" for line in advice.cannot_tell) + "</ul>",
             "<h2>Evidence</h2><ul>" + "".join(f"<li><code>{esc(line)}</code></li>" for line in evidence_lines(advice))
             + f'</ul><p class="note">Each is an ordinary run in the store (Compare shows it). Seed noise: '
               f"{esc(DIFFERENCE_RULE)}.</p>"]
    figures = report.report_figures(reader, race_run, info) if info is not None else []
    parts.append("<h2>The race</h2>")
    parts += [report._figure_block(i, figure) for i, figure in enumerate(figures)] or ["<p>No steps to chart.</p>"]
    title = esc(f"AMP Lab advice · {evidence.workload}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{title}</title><style>{report.STYLE}</style>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n<body>\n"
            + "\n".join(parts)
            + f"\n<script type=\"text/javascript\">{report.DRAW_SCRIPT}</script>\n</body></html>\n")
