"""Replay views: the steps worth replaying (skipped steps, loss spikes against the robust band), the loss chart that
marks them, and a replay's table and verdict as a page and the CLI show them."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from amp_core.probes.replay import ReplayReport
from amp_core.probes.spikes import SpikeRule, band_upper, spike_steps
from amp_core.views.plots import chart_layout, mode_color

REPLAY_COLUMNS = ["mode", "role", "loss", "above band", "grads finite", "skipped", "first inf/NaN", "scale",
                  "scale after", "update ‖Δ‖/‖Δfp32‖", "cosine vs fp32"]
VERDICT_ICONS = {"precision": "🎯", "data": "📦", "unclear": "❔"}


def replay_frame(report: ReplayReport) -> pd.DataFrame:
    """One row per mode replayed, references last, as the table shows it."""
    rows = []
    for row in report.rows:
        role = "reference" if row.reference else "lane's mode" if row.mode == report.mode else "mode of the run"
        first = row.first_nonfinite or (f"grad of {', '.join(row.nonfinite_params[:2])}" if row.nonfinite_params
                                        else "—")
        rows.append({
            "mode": row.mode, "role": role, "loss": row.loss, "above band": "yes" if row.loss_above_band else "no",
            "grads finite": "yes" if row.grads_finite else "NO", "skipped": "yes" if row.skipped else "no",
            "first inf/NaN": first, "scale": row.scale, "scale after": row.scale_after,
            "update ‖Δ‖/‖Δfp32‖": row.update_rel_norm, "cosine vs fp32": row.update_cosine})
    return pd.DataFrame(rows, columns=REPLAY_COLUMNS)


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def replay_text(report: ReplayReport) -> str:
    """The CLI's print-out: what was replayed and from where, the table, the notes, and the verdict line last."""
    frame = replay_frame(report)
    shown = frame.map(_cell)
    lines = [f"run {report.run_id} · lane {report.lane} ({report.mode}) · step {report.step}",
             f"from: {report.source} (steps {report.start_step}-{report.step})",
             report.reproduction_line()]
    if report.faults:
        lines.append(f"planted on step {report.step}, replayed in every mode: {'; '.join(report.faults)}")
    band = report.band
    lines.append(f"loss band: ≤ {band.upper:.6g} ({report.rule.describe()})" if band is not None
                 else f"loss band: none yet ({report.rule.describe()})")
    lines += ["", shown.to_string(index=False), ""]
    for row in report.rows:
        if row.first_nonfinite_why:
            lines.append(f"{row.mode}: first inf/NaN in {row.first_nonfinite}: {row.first_nonfinite_why}")
    lines += [f"note: {note}" for note in report.notes]
    lines.append(report.verdict.line())
    return "\n".join(lines)


def steps_to_review(steps: pd.DataFrame, lane: int, rule: SpikeRule) -> pd.DataFrame:
    """A lane's skipped steps, non-finite losses and loss spikes (step order): step, what, loss, band upper edge."""
    columns = ["step", "what", "loss", "band ≤"]
    mine = steps[steps["lane"] == lane].sort_values("step") if not steps.empty else steps
    if mine.empty:
        return pd.DataFrame(columns=columns)
    losses = mine["loss"].to_numpy(dtype=float)
    rows = [{"step": step, "what": "spike", "loss": loss, "band ≤": upper}
            for step, loss, upper in spike_steps(mine["step"].to_numpy(), losses, rule)]
    for step, loss, skipped in zip(mine["step"], losses, mine["skipped"].astype(bool), strict=True):
        if skipped:
            rows.append({"step": int(step), "what": "skipped", "loss": loss, "band ≤": math.nan})
        elif not math.isfinite(loss):
            rows.append({"step": int(step), "what": "non-finite loss", "loss": loss, "band ≤": math.nan})
    frame = pd.DataFrame(rows, columns=columns)
    return frame.sort_values("step", kind="stable", ignore_index=True)


def spike_loss_figure(steps: pd.DataFrame, lane: int, mode: str, rule: SpikeRule) -> go.Figure:
    """The lane's loss with its rolling band's upper edge, spikes as open circles and skipped steps as x."""
    mine = steps[steps["lane"] == lane].sort_values("step") if not steps.empty else steps
    figure = go.Figure()
    if mine.empty:
        figure.update_layout(**chart_layout(f"Loss · lane {lane} ({mode}) · no steps yet", "loss"))
        return figure
    x, losses = mine["step"].to_numpy(), mine["loss"].to_numpy(dtype=float)
    color = mode_color(mode)
    figure.add_trace(go.Scatter(x=x, y=losses, mode="lines", name=f"{mode} loss", line={"color": color, "width": 1.5}))
    figure.add_trace(go.Scatter(x=x, y=band_upper(losses, rule), mode="lines", name=f"band: median + {rule.k:g}·MAD",
                                line={"color": "#888", "width": 1, "dash": "dot"}))
    review = steps_to_review(steps, lane, rule)
    spikes = review[review["what"] == "spike"]
    if len(spikes):
        figure.add_trace(go.Scatter(x=spikes["step"], y=spikes["loss"], mode="markers", name="spike",
                                    marker={"symbol": "circle-open", "size": 12, "color": "#d62728",
                                            "line": {"width": 2}},
                                    hovertemplate="step %{x}: spike, loss %{y:.4g}<extra></extra>"))
    skipped = mine[mine["skipped"].astype(bool)]
    if len(skipped):
        figure.add_trace(go.Scatter(x=skipped["step"], y=skipped["loss"], mode="markers", name="skipped",
                                    marker={"symbol": "x", "size": 9, "color": color},
                                    hovertemplate="step %{x}: skipped<extra></extra>"))
    figure.update_layout(**chart_layout(f"Loss · lane {lane} ({mode}) · spikes against {rule.describe()}", "loss"))
    return figure
