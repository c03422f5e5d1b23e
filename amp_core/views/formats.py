"""Format figures: every format's range on one number line (facts from amp_core.probes.formats)."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from amp_core.probes.formats import FORMAT_NAMES, format_info


def number_line_figure(value: float | None = None) -> go.Figure:
    """All formats' positive ranges on one log axis: subnormal range, normal range, max; `value` as a line."""
    fig = go.Figure()
    names = list(FORMAT_NAMES)
    for index, name in enumerate(names):
        info = format_info(name)
        fig.add_trace(go.Scatter(
            x=[info.smallest_subnormal, info.smallest_normal], y=[name, name], mode="lines+markers",
            line={"width": 6, "color": "rgba(99, 110, 250, 0.35)"}, marker={"size": 7},
            name="subnormal range", legendgroup="subnormal", showlegend=index == 0,
            hovertemplate=f"{name} subnormal: %{{x:.4g}}<extra></extra>",
        ))
        fig.add_trace(go.Scatter(
            x=[info.smallest_normal, info.max], y=[name, name], mode="lines",
            line={"width": 16, "color": "rgb(99, 110, 250)"}, name="normal range", legendgroup="normal",
            showlegend=index == 0, hovertemplate=f"{name} normal: %{{x:.4g}}<extra></extra>",
        ))
        fig.add_trace(go.Scatter(
            x=[info.max], y=[name], mode="markers+text", marker={"symbol": "line-ns-open", "size": 22,
                                                                 "color": "rgb(239, 85, 59)"},
            text=[f"max {info.max:.4g}"], textposition="middle right", name="max", legendgroup="max",
            showlegend=index == 0, hovertemplate=f"{name} max: %{{x:.6g}}<extra></extra>",
        ))
    if value is not None and math.isfinite(value) and value != 0:
        fig.add_trace(go.Scatter(
            x=[abs(value), abs(value)], y=[names[0], names[-1]], mode="lines",
            line={"color": "rgb(0, 160, 90)", "dash": "dash", "width": 2}, name=f"|value| = {abs(value):.4g}",
            hovertemplate="|value| = %{x:.6g}<extra></extra>",
        ))
    infos = [format_info(name) for name in names]
    # Log axes take their range in decades; leave room on the right for the "max" labels.
    lowest = math.floor(math.log10(min(info.smallest_subnormal for info in infos))) - 1
    highest = math.ceil(math.log10(max(info.max for info in infos))) + 8
    fig.update_xaxes(type="log", range=[lowest, highest], title="positive magnitude (log scale)",
                     exponentformat="power")
    fig.update_yaxes(categoryorder="array", categoryarray=names[::-1])
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.0})
    return fig
