"""Format figures: every format's range on one number line (facts from amp_core.probes.formats)."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from amp_core.probes.formats import FORMAT_NAMES, format_info, readable_number

SUBNORMAL_COLOR = "rgba(99, 110, 250, 0.35)"
NORMAL_COLOR = "rgb(99, 110, 250)"
MAX_COLOR = "rgb(239, 85, 59)"


def max_label(value: float) -> str:
    """The number line's label at a format's max: "max 65504", "max 3.4×10<sup>38</sup>" (HTML, for plotly)."""
    text = readable_number(value)
    if " × 10" in text:
        mantissa, power = text.split(" × 10")
        exponent = power.translate(str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789"))
        text = f"{mantissa}×10<sup>{exponent}</sup>"
    return f"max {text}"


def number_line_figure(value: float | None = None) -> go.Figure:
    """All formats' positive ranges on one log axis: subnormal range, normal range, max (labelled in full, outside
    the plot area if need be); `value` as a dashed line."""
    names = list(FORMAT_NAMES)
    data = []
    for index, name in enumerate(names):
        info = format_info(name)
        data += [
            {"type": "scatter", "x": [info.smallest_subnormal, info.smallest_normal], "y": [name, name],
             "mode": "lines+markers", "line": {"width": 6, "color": SUBNORMAL_COLOR}, "marker": {"size": 7},
             "name": "subnormal range", "legendgroup": "subnormal", "showlegend": index == 0,
             "hovertemplate": f"{name} subnormal: %{{x:.4g}}<extra></extra>"},
            {"type": "scatter", "x": [info.smallest_normal, info.max], "y": [name, name], "mode": "lines",
             "line": {"width": 16, "color": NORMAL_COLOR}, "name": "normal range", "legendgroup": "normal",
             "showlegend": index == 0, "hovertemplate": f"{name} normal: %{{x:.4g}}<extra></extra>"},
            # cliponaxis off: the label of the largest max reads whole past the plot's right edge, in the margin.
            {"type": "scatter", "x": [info.max], "y": [name], "mode": "markers+text", "cliponaxis": False,
             "marker": {"symbol": "line-ns-open", "size": 22, "color": MAX_COLOR}, "text": [max_label(info.max)],
             "textposition": "middle right", "name": "max", "legendgroup": "max", "showlegend": index == 0,
             "hovertemplate": f"{name} max: %{{x:.17g}}<extra></extra>"},
        ]
    if value is not None and math.isfinite(value) and value != 0:
        data.append({"type": "scatter", "x": [abs(value), abs(value)], "y": [names[0], names[-1]], "mode": "lines",
                     "line": {"color": "rgb(0, 160, 90)", "dash": "dash", "width": 2},
                     "name": f"|value| = {readable_number(abs(value))}",
                     "hovertemplate": "|value| = %{x:.17g}<extra></extra>"})
    infos = [format_info(name) for name in names]
    # Log axes take their range in decades: a decade of room either side.
    lowest = math.floor(math.log10(min(info.smallest_subnormal for info in infos))) - 1
    highest = math.ceil(math.log10(max(info.max for info in infos))) + 1
    layout = {"height": 380, "margin": {"l": 10, "r": 110, "t": 30, "b": 10},
              "xaxis": {"type": "log", "range": [lowest, highest], "exponentformat": "power",
                        "title": {"text": "positive magnitude (log scale)"}},
              "yaxis": {"categoryorder": "array", "categoryarray": names[::-1], "automargin": True},
              "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.0}}
    return go.Figure({"data": data, "layout": layout})
