"""The Workshop page's drawing helpers: a scenario's charts sized for a room (presenter view), its checks and its
table as text a projector shows whole."""

from __future__ import annotations

import numbers

import pandas as pd
import plotly.graph_objects as go

from amp_core.workshop import CheckResult, Verdict

PRESENTER_HEIGHT = 540
"""A chart's height in the presenter view: one chart fills most of a 1280 x 720 projector, under a title line."""
PRESENTER_FONT = 20
"""Axis, tick and legend text in the presenter view (px); titles a third larger."""


def presenter_figure(figure: go.Figure) -> go.Figure:
    """The figure with large text and a projector's height (in place; returned for chaining)."""
    figure.update_layout(height=PRESENTER_HEIGHT, font={"size": PRESENTER_FONT},
                         title={"font": {"size": round(PRESENTER_FONT * 1.3)}},
                         legend={"font": {"size": PRESENTER_FONT}},
                         margin={"l": 90, "r": 30, "t": 70, "b": 90}, hoverlabel={"font": {"size": PRESENTER_FONT}})
    # Each axis names its own sizes (a log axis sets its tick font; Streamlit's theme sets the rest): set them all.
    for update in (figure.update_xaxes, figure.update_yaxes):
        update(tickfont={"size": PRESENTER_FONT}, title={"font": {"size": PRESENTER_FONT}})
    return figure


LANE_DASHES = (("solid", 4.0), ("dash", 3.0), ("dot", 2.5), ("dashdot", 2.0))
"""Line style and width of the 1st, 2nd, ... lane's curve: lanes that train alike draw the same curve, and a thinner,
broken line on top of a thicker one keeps every colour in sight (else the last lane drawn hides the others)."""


def distinguish_lanes(figure: go.Figure) -> go.Figure:
    """Each lane's line (a trace drawn as lines and listed in the legend) in its own dash and width (in place)."""
    lines = [trace for trace in figure.data if trace.mode == "lines" and trace.showlegend is not False]
    for index, trace in enumerate(lines):
        dash, width = LANE_DASHES[index % len(LANE_DASHES)]
        trace.line.dash, trace.line.width = dash, width
    return figure


MARK_COLOURS = {Verdict.HELD: "green", Verdict.FAILED: "red", Verdict.CANNOT_TELL: "orange"}


def check_markdown(result: CheckResult) -> str:
    """One check as Markdown: its mark, title and figure, then what was expected here (and why not, or why it cannot
    be told here)."""
    mark = ":gray[…]" if result.waiting and not result.final else f":{MARK_COLOURS[result.verdict]}[{result.mark}]"
    lines = [f"{mark} **{result.title}** — {result.figure}", f"*expected:* {result.expectation}"]
    if result.explanation:
        lines.append(f"*{result.label}:* {result.explanation}")
    return "  \n".join(lines)


def table_text(frame: pd.DataFrame) -> pd.DataFrame:
    """A scenario's table as text: shares (floats) as percentages, counts with thousands separators."""
    def cell(value) -> str:
        if isinstance(value, float):
            return "–" if value != value else f"{value:.1%}"
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return f"{value:,}"
        return str(value)
    return frame.map(cell)
