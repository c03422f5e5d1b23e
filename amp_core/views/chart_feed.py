"""Send what changed: a live chart's update as the points since its last draw, not the whole figure again.

A live figure grows at its end: each lane's trace gains the steps recorded since the last draw, and the summary's
bucket still filling (the last point or two) changes in place; finished buckets never change. A ChartFeed remembers
what one chart was sent and turns the next figure into the smallest update that draws it: per trace, how
many points to keep and the points after them (Plotly's extendTraces when nothing is dropped); a trace whose style
changed, or that no longer begins as it did (the summary went a level coarser), is sent whole; a figure whose traces
came or went is a reset (the whole figure, Plotly.react). The layout is sent only when it changed (an axis range that
followed the data), the template only in a reset.

`figure_spec` makes the JSON-ready form of a figure once per tick; a live run's publisher (views.live_feed) keeps a
ChartFeed per chart of each feed, shared by every browser that fetches it, its work in proportion to the new points.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go

POINT_KEYS = ("x", "y", "customdata", "text", "hovertext")
"""A trace's per-point arrays (top level); everything else of a trace is its style."""
TAIL_POINTS = 64
"""How far back from its end a trace may have changed in place (the summary's bucket still filling) and still be
extended; a change earlier than that sends the trace whole."""


def _plain(value: Any) -> Any:
    """`value` as JSON can carry it: arrays as lists, NaN and infinities as None (JSON has none; a chart leaves a
    gap), numpy scalars as Python numbers."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "iub":  # integers and flags: nothing to replace
            return value.tolist()
        if value.dtype.kind == "f":  # the common case: one vectorised check, a pass over the items only for gaps
            if np.isfinite(value).all():
                return value.tolist()
            if value.ndim == 1:
                return [None if not math.isfinite(item) else item for item in value.tolist()]
        return _plain(value.tolist())
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def figure_spec(figure: go.Figure) -> dict:
    """{'data': [trace, ...], 'layout': {...}, 'template': {...}}: the figure JSON-ready, its template apart."""
    if hasattr(figure, "_data") and hasattr(figure, "_layout"):
        data, layout = figure._data, dict(figure._layout)  # the spec as built (plots.ChartFigure: no copies)
    else:
        whole = figure.to_plotly_json()
        data, layout = whole["data"], dict(whole["layout"])
    template = _plain_template(layout.pop("template", None))
    return {"data": _plain(list(data)), "layout": _plain(layout), "template": template}


_templates: list[tuple[Any, dict]] = []
"""The last template made JSON-ready, with its source: every figure carries a copy of the same one (plotly's
default), and making it plain again for each figure at every tick was an eighth of a live view's tick."""


def _plain_template(template: Any) -> dict:
    known = _templates[0] if _templates else None
    if known is not None and (known[0] is template or known[0] == template):
        return known[1]
    plain = _plain(template) or {}
    _templates[:] = [(template, plain)]
    return plain


def _split(trace: dict) -> tuple[dict[str, list], dict]:
    """(the trace's per-point arrays by key, the rest of it)."""
    points = {key: trace[key] for key in POINT_KEYS if isinstance(trace.get(key), list)}
    return points, {key: value for key, value in trace.items() if key not in points}


def _kept(old: dict[str, list], new: dict[str, list]) -> int | None:
    """How many leading points `new` shares with `old` (None: it changed earlier than the tail, or its arrays)."""
    if set(old) != set(new):
        return None
    n_old = len(next(iter(old.values()), []))
    n_new = len(next(iter(new.values()), []))
    if any(len(values) != n_new for values in new.values()):
        return None
    kept = min(n_old, n_new)
    floor = max(0, kept - TAIL_POINTS)
    while kept > floor and any(old[key][kept - 1] != new[key][kept - 1] for key in new):
        kept -= 1
    if kept == floor and floor > 0:
        return None
    # A figure whose earlier points all moved (a coarser summary level) may still end alike: its first and middle
    # points tell it apart at no cost.
    for probe in {0, kept // 2} if kept else ():
        if any(old[key][probe] != new[key][probe] for key in new):
            return None
    return kept


def changes(old: dict, new: dict) -> dict:
    """What turns the chart drawn from `old` into `new` (figure_spec's, with as many traces):
    {'extend': [{'trace', 'keep', 'points'}], 'replace': [{'trace', 'data'}], 'layout'?: {...}}. A pure function of
    the two specs."""
    extend, replace = [], []
    for index, (old_trace, new_trace) in enumerate(zip(old["data"], new["data"], strict=True)):
        (old_points, old_style), (points, style) = _split(old_trace), _split(new_trace)
        kept = _kept(old_points, points) if style == old_style else None
        if kept is None:
            replace.append({"trace": index, "data": new_trace})
            continue
        n_old, n_new = len(next(iter(old_points.values()), [])), len(next(iter(points.values()), []))
        if kept < n_old or n_new > kept:
            extend.append({"trace": index, "keep": kept, "points": {key: values[kept:]
                                                                     for key, values in points.items()}})
    found = {"extend": extend, "replace": replace}
    if new["layout"] != old["layout"]:
        found["layout"] = new["layout"]
    return found


class ChartFeed:
    """What one live chart was sent, and the next update. `seq` numbers the updates: an update applies to the chart
    drawn at `base` (a board that holds something else fetches the whole board, views.live_feed)."""

    def __init__(self) -> None:
        self.seq = 0
        self._sent: dict | None = None
        """The spec last sent (None: the next update is a reset)."""

    def update(self, spec: dict) -> dict:
        """The update that turns what was sent into `spec` (figure_spec's):
        {'kind': 'reset', 'seq', 'figure': {data, layout}} or
        {'kind': 'extend', 'seq', 'base', 'extend': [{'trace', 'keep', 'points'}], 'replace': [{'trace', 'data'}],
        'layout'?: {...}}."""
        base, self.seq = self.seq, self.seq + 1
        sent, self._sent = self._sent, spec
        if sent is None or len(spec["data"]) != len(sent["data"]):
            return self.whole(spec)
        return {"kind": "extend", "seq": self.seq, "base": base, **changes(sent, spec)}

    def whole(self, spec: dict) -> dict:
        """`spec` (the one last updated to) as a reset at this feed's seq: what a chart that holds nothing, or
        something too old, draws before the next update applies to it."""
        layout = dict(spec["layout"], template=spec["template"])
        return {"kind": "reset", "seq": self.seq, "figure": {"data": spec["data"], "layout": layout}}


def new_points(update: dict) -> int:
    """How many points an update carries (every trace's, counted along x): what a chart receives per redraw."""
    if update["kind"] == "reset":
        return sum(len(trace.get("x") or []) for trace in update["figure"]["data"])
    return (sum(len(item["points"].get("x", [])) for item in update["extend"])
            + sum(len(item["data"].get("x") or []) for item in update["replace"]))
