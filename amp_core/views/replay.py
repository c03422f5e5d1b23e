"""Replay views: the steps worth replaying (skipped steps, loss spikes against the robust band), the loss chart that
marks them, and a replay's table and verdict as a page and the CLI show them."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.diagnostics.replay_modes import ReplayReport
from amp_core.probes.spikes import SpikeRule, band_upper
from amp_core.views.plots import chart_layout, empty_figure, log_axis, mode_color, spike_trace

REPLAY_COLUMNS = ["mode", "loss", "what broke", "first inf/NaN", "scale", "update vs fp32"]
"""What a replay's table shows: each mode (▶ the lane's own, `ref` the references), its loss, what broke (`band`: the
loss is above the band, `loss`: the loss itself is inf/NaN, `inf/NaN`: gradients, `skip`: the scaler skipped the
step), the first module that held inf/NaN, the scaler's scale before → after the step, and its update against fp32's
(×: norm ratio, cos: cosine)."""


def _broke(row) -> str:
    parts = []
    if not math.isfinite(row.loss):
        parts.append("loss")
    elif row.loss_above_band:
        parts.append("band")
    if not row.grads_finite:
        parts.append("inf/NaN")
    if row.skipped:
        parts.append("skip")
    return " · ".join(parts) or "—"


def _first(row) -> str:
    if row.first_nonfinite:
        return row.first_nonfinite
    if row.nonfinite_params:
        more = f" +{len(row.nonfinite_params) - 1}" if len(row.nonfinite_params) > 1 else ""
        return f"grad {row.nonfinite_params[0]}{more}"
    return "—"


def _update(row) -> str:
    if not math.isfinite(row.update_rel_norm):
        return "—"
    cosine = "—" if math.isnan(row.update_cosine) else f"{row.update_cosine:.3f}"
    return f"×{row.update_rel_norm:.3g} cos {cosine}"


def replay_frame(report: ReplayReport) -> pd.DataFrame:
    """One row per mode replayed, the run's modes first, then the references (32-true, float64)."""
    rows = []
    for row in report.rows:
        name = f"▶ {row.mode}" if row.mode == report.mode else row.mode
        name += " ref" if row.reference else ""
        scale = "—" if row.scale is None else f"{row.scale:g} → {row.scale_after:g}"
        rows.append({"mode": name, "loss": row.loss, "what broke": _broke(row), "first inf/NaN": _first(row),
                     "scale": scale, "update vs fp32": _update(row)})
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
    """A lane's loss spikes, skipped steps and non-finite losses (step order): step, what, loss, and the band's upper
    edge at that step (NaN before enough steps)."""
    columns = ["step", "what", "loss", "band ≤"]
    mine = steps[steps["lane"] == lane].sort_values("step") if not steps.empty else steps
    if mine.empty:
        return pd.DataFrame(columns=columns)
    losses = mine["loss"].to_numpy(dtype=float)
    upper = band_upper(losses, rule)
    rows = []
    for at, (step, loss, skipped) in enumerate(zip(mine["step"], losses, mine["skipped"].astype(bool), strict=True)):
        if math.isfinite(loss) and loss > upper[at]:
            rows.append({"step": int(step), "what": "spike", "loss": loss, "band ≤": upper[at]})
        if skipped:
            rows.append({"step": int(step), "what": "skipped", "loss": loss, "band ≤": upper[at]})
        elif not math.isfinite(loss):
            rows.append({"step": int(step), "what": "non-finite loss", "loss": loss, "band ≤": upper[at]})
    return pd.DataFrame(rows, columns=columns)


def first_to_replay(review: pd.DataFrame, default: int) -> int:
    """The step the Replay picker opens on: the first spike, else the first skipped step or non-finite loss."""
    if review.empty:
        return default
    spikes = review[review["what"] == "spike"]
    return int((spikes if len(spikes) else review)["step"].iloc[0])


def sentence(text: str) -> str:
    """`text` with its first letter capitalised and a full stop (the rest as written: mode names keep their case)."""
    return f"{text[:1].upper()}{text[1:]}."


def spike_loss_figure(steps: pd.DataFrame, lane: int, mode: str, rule: SpikeRule) -> go.Figure:
    """The lane's loss with its rolling band's upper edge, spikes as open circles and skipped steps as x."""
    mine = steps[steps["lane"] == lane].sort_values("step") if not steps.empty else steps
    if mine.empty:  # a note where the points would be, not an empty pair of axes
        return empty_figure(f"Loss · lane {lane} ({mode})", "no steps yet")
    figure = go.Figure()
    x, losses = mine["step"].to_numpy(), mine["loss"].to_numpy(dtype=float)
    color = mode_color(mode)
    figure.add_trace(go.Scatter(x=x, y=losses, mode="lines", name=f"{mode} loss", line={"color": color, "width": 1.5}))
    figure.add_trace(go.Scatter(x=x, y=band_upper(losses, rule), mode="lines", name=f"band: median + {rule.k:g}·MAD",
                                line={"color": "#888", "width": 1, "dash": "dot"}))
    review = steps_to_review(steps, lane, rule)
    spikes = review[review["what"] == "spike"]
    if len(spikes):
        figure.add_trace(spike_trace(spikes["step"], spikes["loss"], "spike"))
    skipped = mine[mine["skipped"].astype(bool)]
    if len(skipped):
        figure.add_trace(go.Scatter(x=skipped["step"], y=skipped["loss"], mode="markers", name="skipped",
                                    marker={"symbol": "x", "size": 9, "color": color},
                                    hovertemplate="step %{x}: skipped<extra></extra>"))
    finite = losses[np.isfinite(losses)]
    axis = log_axis("loss") if len(finite) and finite.min() > 0 else {"title": {"text": "loss"}}
    figure.update_layout(**chart_layout(f"Loss · lane {lane} ({mode}) · spikes ○ · skipped steps ×", "loss",
                                        yaxis=axis))
    return figure
