"""Op-trace figures: the module tree coloured by dtype, and where each trace's FLOPs ran."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from amp_core.probes.optrace import COMPUTE_DTYPES, LOSS, OUTSIDE, ROOT, STEP, OpTrace

DTYPE_COLOURS = {"fp32": "#4c78a8", "bf16": "#f58518", "fp16": "#e45756", "fp64": "#54a24b", "": "#bab0ac"}
"""Treemap colour per compute dtype ("" = no floating-point compute)."""


def module_treemap(trace: OpTrace, size_by: str = "ops") -> go.Figure:
    """The module tree, each box coloured by the dtype its compute ran in; sized by op count or FLOPs."""
    if size_by not in ("ops", "flops"):
        raise ValueError(f"size_by must be 'ops' or 'flops', got {size_by!r}")
    modules = trace.module_frame()
    ids = [STEP, *modules["module"]]
    parents = ["", *modules["parent"]]
    values = [0, *modules[size_by]]
    dtypes = ["", *modules["compute_dtype"]]
    labels = [trace.label, *(m.rpartition(".")[2] if m not in (ROOT, LOSS, OUTSIDE) else m for m in modules["module"])]
    hover = ["", *(
        f"{row.module}<br>forward: {row.forward_dtype or '—'} · backward: {row.backward_dtype or '—'}"
        f"<br>{row.ops} ops · {row.flops:,} FLOPs · {row.casts} casts"
        for row in modules.itertuples()
    )]
    figure = go.Figure(go.Treemap(
        ids=ids, parents=parents, values=values, labels=labels, branchvalues="remainder",
        text=[d or "no compute" for d in dtypes], texttemplate="%{label}<br>%{text}",
        customdata=hover, hovertemplate="%{customdata}<extra></extra>",
        marker={"colors": [DTYPE_COLOURS.get(d, "#72b7b2") for d in dtypes]}, root={"color": "white"},
    ))
    key = " · ".join(f"<span style='color:{DTYPE_COLOURS[d]}'>■</span> {d}" for d in COMPUTE_DTYPES)
    figure.update_layout(title={"text": f"{trace.label}: dtype per module<br>{key}", "font": {"size": 13}},
                         margin={"t": 55, "l": 5, "r": 5, "b": 5}, height=400)
    return figure


def flop_share_figure(traces: Sequence[OpTrace]) -> go.Figure:
    """Stacked bars: the share of each trace's FLOPs that ran in fp32, bf16 and fp16."""
    summaries = [(t.label, t.summary()) for t in traces]
    figure = go.Figure([
        go.Bar(name=dtype, y=[label for label, _ in summaries], x=[s.flop_share(dtype) for _, s in summaries],
               orientation="h", marker_color=DTYPE_COLOURS[dtype])
        for dtype in COMPUTE_DTYPES
    ])
    figure.update_layout(barmode="stack", legend={"traceorder": "normal"},
                         xaxis={"tickformat": ".0%", "range": [0, 1], "title": "share of FLOPs"},
                         height=120 + 40 * len(traces), margin={"t": 30, "l": 5, "r": 5, "b": 5},
                         title={"text": "Where the FLOPs ran", "font": {"size": 13}})
    return figure
