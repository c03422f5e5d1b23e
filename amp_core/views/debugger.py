"""Overflow debugger data: scale timelines, skipped-step tables, gradient histograms against fp16/bf16 ranges, figures.

Pure pandas/plotly plus torch.finfo facts (through amp_core.formats); it reads the records the runner wrote
(step frames, event frames, GradStats) and never trains. The Overflow debugger page draws what this returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.config import FaultSpec
from amp_core.precision import uses_scaler
from amp_core.probes import formats
from amp_core.probes.gradstats import HIST_HI, HIST_LO, GradStats, combine
from amp_core.runs import StoredConfig
from amp_core.views import plots

if TYPE_CHECKING:
    from amp_core.runs import LaneInfo

BAND_FORMATS: tuple[str, ...] = ("fp16", "bf16")
REGIONS: tuple[str, ...] = ("flush to zero", "subnormal", "normal", "overflow")
REGION_COLORS: dict[str, str] = {
    "flush to zero": "rgba(127, 127, 127, 0.45)",
    "subnormal": "rgba(255, 187, 0, 0.55)",
    "normal": "rgba(44, 160, 44, 0.35)",
    "overflow": "rgba(214, 39, 40, 0.55)",
}
FAULT_FILL = "rgba(148, 103, 189, 0.15)"
MAX_ANNOTATIONS = 12
"""Scale-change annotations drawn at most (the largest groups); every change still has a hover marker."""
TIMELINE_EVENT_KINDS = ("scale_growth", "scale_backoff")
OVERVIEW_SCALES = ("scale now", "scale min", "scale max")
TIMELINE_DOMAINS = ((0.44, 0.94), (0.0, 0.36))
"""Vertical extent of the scale timeline's two plots (paper fractions): scale on top, loss below; room for titles."""


# ---- format ranges --------------------------------------------------------------------------------------

def format_bands(lo: float = HIST_LO, hi: float = HIST_HI + 1) -> pd.DataFrame:
    """fp16 and bf16 ranges as log2 bands clipped to [lo, hi): format, region, lo_log2, hi_log2, lo/hi value, rule.

    The bands are the formats' nominal ranges (torch.finfo). Rounding moves the edges by half a unit: the rule
    column says where values really turn into 0 or inf (the fractions tables come from real casts).
    """
    rows = []
    for name in BAND_FORMATS:
        info = formats.format_info(name)
        sub, tiny, top = info.smallest_subnormal, info.smallest_normal, info.max
        overflow_at = top + info.ulp_at_max / 2
        edges = {
            "flush to zero": (0.0, sub, f"|x| < {sub:.4g} (2^{math.log2(sub):g}) cannot be held: |x| <= {sub / 2:.4g} "
                                        f"(2^{math.log2(sub / 2):g}) rounds to 0, larger ones round up to {sub:.4g}"),
            "subnormal": (sub, tiny, f"{sub:.4g} <= |x| < {tiny:.4g} (2^{math.log2(sub):g} .. 2^{math.log2(tiny):g}):"
                                     " held with fewer significant bits"),
            "normal": (tiny, top, f"{tiny:.4g} <= |x| <= {top:.6g}: full {info.mantissa_bits}-bit precision"),
            "overflow": (top, math.inf, f"|x| > {top:.6g}: |x| >= {overflow_at:.6g} rounds to inf, "
                                        f"smaller ones round down to {top:.6g}"),
        }
        for region in REGIONS:
            low, high, rule = edges[region]
            lo_log2 = max(lo, math.log2(low)) if low > 0 else lo
            hi_log2 = min(hi, math.log2(high))
            if hi_log2 <= lo_log2:
                continue
            rows.append({"format": name, "region": region, "lo_log2": lo_log2, "hi_log2": hi_log2,
                         "lo_value": low, "hi_value": high, "rule": rule})
    return pd.DataFrame(rows, columns=["format", "region", "lo_log2", "hi_log2", "lo_value", "hi_value", "rule"])


# ---- gradient histograms --------------------------------------------------------------------------------

def stats_for(stats: list[GradStats], param: str | None = None) -> GradStats | None:
    """One parameter's GradStats, or every parameter combined (param None or '(all)'); None if there are none."""
    if not stats:
        return None
    if param in (None, "", "(all)"):
        return combine(stats)
    for s in stats:
        if s.param == param:
            return s
    return None


def scale_shift(scale: float) -> float:
    """log2 of the scale: how far a scaled histogram sits to the right of the unscaled one."""
    return math.log2(scale) if scale > 0 and math.isfinite(scale) else 0.0


def histogram_frame(stats: GradStats, scaled: bool | None = None) -> pd.DataFrame:
    """Non-empty log2 bins of |g|: series (unscaled | scaled), bin, x_lo, x_hi, count, share, clamped.

    Bin e holds 2^e <= |g| < 2^(e+1) and spans [x_lo, x_hi) = [e, e+1) on the log2 axis; the scaled series
    (|g| x scale, what the fp16 backward held) spans [e + log2(scale), e + 1 + log2(scale)). The end bins are
    clamped: the first also holds everything smaller, the last everything larger. `share` is of all elements
    (zeros, inf and NaN included), so the shares plus those of zero/inf/NaN add up to 1.
    """
    if scaled is None:
        scaled = stats.scale != 1.0
    total = stats.numel or 1
    series = [("unscaled", 0.0)] + ([("scaled", scale_shift(stats.scale))] if scaled else [])
    rows = []
    for name, shift in series:
        for index, count in enumerate(stats.hist):
            if count:
                exponent = HIST_LO + index
                rows.append({"series": name, "bin": exponent, "x_lo": exponent + shift, "x_hi": exponent + 1 + shift,
                             "count": int(count), "share": count / total,
                             "clamped": exponent in (HIST_LO, HIST_HI)})
    return pd.DataFrame(rows, columns=["series", "bin", "x_lo", "x_hi", "count", "share", "clamped"])


def special_counts(stats: GradStats) -> dict[str, int]:
    """Elements outside the histogram: exact zeros, inf, NaN, and the total."""
    return {"elements": stats.numel, "finite non-zero": sum(stats.hist), "zero": stats.zeros, "inf": stats.inf,
            "NaN": stats.nan}


FRACTION_COLUMNS: tuple[str, ...] = ("becomes 0", "subnormal", "overflows to inf")


def fractions_frame(stats: GradStats) -> pd.DataFrame:
    """Per format (fp16, bf16) and gradient: the share of the finite non-zero gradient that becomes 0, subnormal or inf.

    Columns: format, gradient ("unscaled", and for a scaled lane "x <scale>": the values times the scale, as the fp16
    backward held them), then FRACTION_COLUMNS; a row per format and gradient, so the table stays five columns wide
    whatever the scale. From real casts (gradstats); NaN when there is no finite non-zero element to share.
    """
    labels = [("unscaled", "unscaled")] + ([("scaled", f"x {stats.scale:g}")] if stats.scale != 1.0 else [])
    # No finite non-zero element (a step the overflow turned to NaN): a share of nothing is not 0 %.
    missing = 0.0 if sum(stats.hist) else math.nan
    rows = [{"format": fmt, "gradient": label,
             **{title: stats.fractions.get(f"{fmt}.{what}.{key}", missing)
                for what, title in zip(("zero", "subnormal", "overflow"), FRACTION_COLUMNS, strict=True)}}
            for fmt in BAND_FORMATS for key, label in labels]
    return pd.DataFrame(rows, columns=["format", "gradient", *FRACTION_COLUMNS])


def _log2_ticks(lo: float, hi: float, max_ticks: int = 14) -> tuple[list[int], list[str]]:
    lo, hi = math.floor(lo), math.ceil(hi)
    step = max(1, math.ceil((hi - lo) / max_ticks))
    # Multiples of the step, so 0 (|g| = 1) is always a tick when in range.
    first = math.ceil(lo / step) * step
    values = list(range(first, hi + 1, step))
    return values, [f"2^{v}" for v in values]


def histogram_range(hist: pd.DataFrame) -> tuple[float, float]:
    """The x window to open on: the data plus the fp16 edges (2^-25 .. 2^16), with a margin."""
    lo, hi = -26.0, 17.0
    if not hist.empty:
        lo, hi = min(lo, float(hist["x_lo"].min())), max(hi, float(hist["x_hi"].max()))
    return lo - 2, hi + 2


def gradient_histogram_figure(stats: GradStats, mode: str = "", title: str = "") -> go.Figure:
    """Histogram of log2|g| (and |g| x scale for scaled lanes) over fp16 / bf16 range strips.

    Axis y (top, 80 %): bars per log2 bin (unscaled solid in the mode's colour, scaled hatched) on a log count axis,
    with dotted lines at fp16's edges labelled above the plot; axes y2 and y3: each format's flush-to-zero /
    subnormal / normal / overflow bands. The three share one x axis (x2 and x3 match x).
    """
    hist = histogram_frame(stats)
    color = plots.mode_color(mode)
    data = []
    for series, frame in hist.groupby("series", sort=False):
        scaled = series == "scaled"
        name = f"|g| x {stats.scale:g} (scaled)" if scaled else "|g| (unscaled)"
        data.append({
            "type": "bar", "x": (frame["x_lo"] + 0.5).tolist(), "y": frame["count"].tolist(),
            "width": [1.0] * len(frame), "name": name, "xaxis": "x", "yaxis": "y",
            "marker": {"color": color, "opacity": 0.45 if scaled else 0.9, "pattern": {"shape": "/" if scaled else ""}},
            "customdata": np.column_stack([frame["x_lo"], frame["x_hi"], frame["share"]]).tolist(),
            "hovertemplate": f"{name}<br>2^%{{customdata[0]:.4g}} <= |g| < 2^%{{customdata[1]:.4g}}"
                             "<br>%{y} elements (%{customdata[2]:.2%})<extra></extra>"})
    bands = format_bands()
    shown: set[str] = set()
    for index, fmt in enumerate(BAND_FORMATS, start=2):
        for band in bands[bands["format"] == fmt].itertuples(index=False):
            data.append({
                "type": "bar", "y": [fmt], "x": [band.hi_log2 - band.lo_log2], "base": [band.lo_log2],
                "orientation": "h", "name": band.region, "legendgroup": band.region,
                "showlegend": band.region not in shown, "xaxis": f"x{index}", "yaxis": f"y{index}",
                "marker": {"color": REGION_COLORS[band.region]}, "customdata": [[band.rule]],
                "hovertemplate": f"{fmt} {band.region}: %{{customdata[0]}}<extra></extra>"})
            shown.add(band.region)
    fp16 = formats.format_info("fp16")
    # Labels sit above the plot, horizontal, each on the side of its line away from its neighbour: the subnormal
    # edge's to the left, the normal edge's to the right, max's to the left, so they never cover bars or each other.
    edges = ((math.log2(fp16.smallest_subnormal), "fp16 smallest subnormal 2^-24", "right"),
             (math.log2(fp16.smallest_normal), "fp16 smallest normal 2^-14", "left"),
             (math.log2(fp16.max), "fp16 max 65504", "right"))
    shapes = [{"type": "line", "xref": "x", "yref": "y domain", "x0": edge, "x1": edge, "y0": 0, "y1": 1,
               "line": {"dash": "dot", "color": "rgba(80, 80, 80, 0.7)", "width": 1}} for edge, _, _ in edges]
    annotations = [{"text": label, "xref": "x", "yref": "y domain", "x": edge, "y": 1, "xanchor": side,
                    "yanchor": "bottom", "showarrow": False, "font": {"size": 10, "color": "#505050"}}
                   for edge, label, side in edges]
    if hist.empty:
        annotations.append({"text": f"no finite non-zero gradient here: {stats.nan:,} NaN, {stats.inf:,} inf, "
                                    f"{stats.zeros:,} zeros", "xref": "x domain", "yref": "y domain", "x": 0.5,
                            "y": 0.5, "showarrow": False, "font": {"size": 13}})
    lo, hi = histogram_range(hist)
    ticks, labels = _log2_ticks(lo, hi)
    axis = {"range": [lo, hi], "tickvals": ticks, "ticktext": labels}
    layout = {
        "barmode": "overlay", "bargap": 0, "height": 580, "title": {"text": title},
        "margin": {"l": 10, "r": 10, "t": 90 if title else 50, "b": 10},
        "legend": {"orientation": "h", "yanchor": "top", "y": -0.12},
        "xaxis": {**axis, "anchor": "y", "showticklabels": False},
        "xaxis2": {**axis, "anchor": "y2", "matches": "x", "showticklabels": False},
        "xaxis3": {**axis, "anchor": "y3", "matches": "x",
                   "title": {"text": "log2 |g|  (bin e holds 2^e <= |g| < 2^(e+1))"}},
        "yaxis": {"domain": [0.23, 1.0], "anchor": "x", "type": "log", "minorloglabels": "complete",
                  "title": {"text": "elements"}},
        "yaxis2": {"domain": [0.12, 0.2], "anchor": "x2"},
        "yaxis3": {"domain": [0.0, 0.08], "anchor": "x3"},
        "shapes": shapes, "annotations": annotations,
    }
    return go.Figure({"data": data, "layout": layout})


# ---- scale timeline and skipped steps -------------------------------------------------------------------

def _lane_events(events: pd.DataFrame, lane: int, kinds: tuple[str, ...]) -> pd.DataFrame:
    if events.empty:
        return events.iloc[0:0]
    lanes = pd.to_numeric(events["lane"], errors="coerce")
    picked = events[(lanes == lane) & events["kind"].isin(kinds)].copy()
    picked["step"] = pd.to_numeric(picked["step"], errors="coerce").astype("Int64")
    return picked


def scale_timeline(steps: pd.DataFrame, lane: int) -> pd.DataFrame:
    """One lane's scale per step: step, scale, log2_scale, skipped, loss (empty for a lane without a scaler)."""
    frame = steps[steps["lane"] == lane].sort_values("step")
    scale = pd.to_numeric(frame["scale"], errors="coerce")
    frame = frame.assign(scale=scale)[scale.notna()]
    return pd.DataFrame({"step": frame["step"].astype(int).to_numpy(), "scale": frame["scale"].to_numpy(dtype=float),
                         "log2_scale": np.log2(frame["scale"].to_numpy(dtype=float)),
                         "skipped": frame["skipped"].astype(bool).to_numpy(),
                         "loss": pd.to_numeric(frame["loss"], errors="coerce").to_numpy(dtype=float)})


def scale_changes(events: pd.DataFrame, lane: int) -> pd.DataFrame:
    """The lane's scale_growth / scale_backoff events: step, kind (growth | backoff), scale_before, scale_after."""
    picked = _lane_events(events, lane, TIMELINE_EVENT_KINDS)
    return pd.DataFrame({
        "step": picked["step"].astype(int).to_numpy() if len(picked) else np.array([], dtype=int),
        "kind": [kind.removeprefix("scale_") for kind in picked["kind"]],
        "scale_before": [float(d.get("scale_before", math.nan)) for d in picked["data"]],
        "scale_after": [float(d.get("scale_after", math.nan)) for d in picked["data"]],
    })


def _params_text(params: list[dict]) -> str:
    parts = []
    for p in params:
        counts = [f"{p[k]} {label}" for k, label in (("inf", "inf"), ("nan", "NaN")) if p.get(k)]
        parts.append(f"{p['param']} ({', '.join(counts)})" if counts else p["param"])
    return ", ".join(parts)


def skipped_steps_table(events: pd.DataFrame, lane: int) -> pd.DataFrame:
    """Steps of a lane whose gradients held inf/NaN: step, outcome (with the scale's change), inf and NaN (elements of
    the parameters' gradients, after unscaling), and the parameters that held them.

    Skipped steps (GradScaler caught them) and, for lanes without a scaler, steps the optimizer took anyway. An
    overflow usually reaches the parameters' gradients as NaN rather than inf: see `NAN_FROM_OVERFLOW`.
    """
    picked = _lane_events(events, lane, ("skipped_step", "nonfinite_grads")).sort_values("step", kind="stable")
    rows = []
    for kind, step, data in zip(picked["kind"], picked["step"], picked["data"], strict=True):
        params = data.get("params") or []
        before, after = data.get("scale_before"), data.get("scale_after")
        outcome = (f"skipped; scale {before:g} → {after:g}" if kind == "skipped_step" and before is not None
                   else "skipped" if kind == "skipped_step" else "applied: no scaler to catch it")
        rows.append({"step": int(step), "outcome": outcome, "inf": sum(int(p.get("inf", 0)) for p in params),
                     "NaN": sum(int(p.get("nan", 0)) for p in params), "parameters": _params_text(params)})
    # The parameters go last: the one column that may run long ends the row instead of pushing others off the page.
    return pd.DataFrame(rows, columns=["step", "outcome", "inf", "NaN", "parameters"])


NAN_FROM_OVERFLOW = (
    "Why NaN rather than inf? The overflow happens inside the fp16 backward, before any parameter gradient exists: "
    "an activation gradient (e.g. the logits' gradient, cast to fp16 for the last matmul) becomes ±inf. The next "
    "matmuls then add +inf to -inf and multiply inf by exact zeros (inputs that are 0, ReLU outputs that are 0): "
    "both give NaN. So most elements reach the parameters' gradients as NaN, some as inf. GradScaler treats both the "
    "same: it skips the step and backs the scale off.")
"""The page's explanation, next to a skipped-steps table that counts more NaN than inf (tests/test_debugger.py
shows it happening in a real fp16 backward)."""
APPLIED_UNSCALED = (
    "Applied: with no GradScaler the optimizer stepped with these gradients, so from that step on the weights hold "
    "inf/NaN and every later step fails too (this table counts the first step of each such run); where it was found, "
    "the step's first inf/NaN module is named below.")
"""The page's note under the same table for a mode with no GradScaler (bf16, fp32: nothing skips a step)."""


def lane_faults(config: dict[str, Any], mode: str) -> list[FaultSpec]:
    """The run's faults that act on a lane of `mode` (config is RunConfig.to_dict()); ConfigError if one is bad.

    Read fault by fault rather than through RunConfig.from_dict, so a stored run whose modes this machine cannot
    run (a CUDA run viewed on a laptop) still shows its faults.
    """
    specs = [f if isinstance(f, FaultSpec) else FaultSpec(**dict(f, modes=tuple(f.get("modes", ()))))
             for f in StoredConfig.read(config).faults]
    return [f for f in specs if not f.modes or mode in f.modes]


def fault_windows(config: dict[str, Any], mode: str) -> pd.DataFrame:
    """Step windows of a lane's faults: kind, start, end (exclusive), description. init_scale has no window."""
    rows = [{"kind": f.kind, "start": f.step, "end": f.step + f.duration, "description": f.describe()}
            for f in lane_faults(config, mode) if f.kind != "init_scale"]
    return pd.DataFrame(rows, columns=["kind", "start", "end", "description"])


def _change_groups(changes: pd.DataFrame) -> list[dict]:
    """Runs of same-kind scale changes on consecutive steps (ten backoffs in a row are one story)."""
    groups: list[dict] = []
    for row in changes.sort_values("step").itertuples(index=False):
        last = groups[-1] if groups else None
        if last and last["kind"] == row.kind and row.step == last["last_step"] + 1:
            last.update(last_step=row.step, scale_after=row.scale_after, count=last["count"] + 1)
        else:
            groups.append({"kind": row.kind, "first_step": row.step, "last_step": row.step, "count": 1,
                           "scale_before": row.scale_before, "scale_after": row.scale_after})
    return groups


def _pow2(value: float) -> str:
    exponent = math.log2(value) if value > 0 else math.nan
    return f"2^{exponent:g}" if math.isfinite(exponent) and exponent == round(exponent) else f"{value:g}"


def scale_timeline_figure(steps: pd.DataFrame, events: pd.DataFrame, lane: int, mode: str,
                          windows: pd.DataFrame | None = None, max_points: int = plots.MAX_POINTS) -> go.Figure:
    """Axis y (top): the lane's GradScaler scale (log2 ticks) with skipped steps, growth/backoff markers and
    annotations. Axis y2 (below, x2 matched to x): loss of every lane of the run (log axis) with their skipped steps.
    Fault windows are shaded across both.
    """
    # Arrays go in as numpy, not lists: plotly checks a list element by element, which costs a long run's live
    # redraw half a second; numpy arrays travel as binary.
    color = plots.mode_color(mode)
    data: list[dict] = []
    annotations = [
        {"text": f"GradScaler scale, lane {lane} ({mode})", "xref": "paper", "yref": "paper", "x": 0.5,
         "y": TIMELINE_DOMAINS[0][1], "yanchor": "bottom", "showarrow": False, "font": {"size": 14}},
        {"text": "loss, every lane", "xref": "paper", "yref": "paper", "x": 0.5, "y": TIMELINE_DOMAINS[1][1],
         "yanchor": "bottom", "showarrow": False, "font": {"size": 14}}]
    scale_axis: dict[str, Any] = {"domain": list(TIMELINE_DOMAINS[0]), "anchor": "x", "title": {"text": "scale"}}
    timeline = scale_timeline(steps, lane)
    if timeline.empty:
        annotations.append({"text": (f"{mode} has no GradScaler: nothing is scaled, no step is skipped"
                                     if not uses_scaler(mode) else "no steps yet"),
                            "xref": "x domain", "yref": "y domain", "x": 0.5, "y": 0.5, "showarrow": False})
    else:
        shown = plots.decimate(timeline, "log2_scale", max_points, keep="skipped")
        data.append({"type": "scatter", "x": shown["step"].to_numpy(), "y": shown["log2_scale"].to_numpy(),
                     "mode": "lines", "line": {"color": color, "width": 2, "shape": "hv"}, "name": f"scale ({mode})",
                     "customdata": shown["scale"].to_numpy(),
                     "hovertemplate": "step %{x}: scale %{customdata:g}<extra></extra>"})
        skipped = timeline[timeline["skipped"]]
        data.append({"type": "scatter", "x": skipped["step"].to_numpy(), "y": skipped["log2_scale"].to_numpy(),
                     "mode": "markers", "name": "skipped step", "customdata": skipped["scale"].to_numpy(),
                     "marker": {"symbol": "x", "size": 9, "color": "#d62728"},
                     "hovertemplate": "step %{x} skipped (scale %{customdata:g})<extra></extra>"})
        changes = scale_changes(events, lane)
        markers = (("growth", "triangle-up", "#2ca02c"), ("backoff", "triangle-down", "#ff7f0e"))
        for kind, symbol, marker_color in markers:
            part = changes[changes["kind"] == kind]
            data.append({
                "type": "scatter", "x": part["step"].to_numpy(),
                "y": np.log2(part["scale_after"].to_numpy(dtype=float)), "mode": "markers", "name": f"scale {kind}",
                "marker": {"symbol": symbol, "size": 9, "color": marker_color},
                "customdata": part[["scale_before", "scale_after"]].to_numpy(dtype=float),
                "hovertemplate": f"{kind} after step %{{x}}: %{{customdata[0]:g}} -> %{{customdata[1]:g}}"
                                 "<extra></extra>"})
        for g in sorted(_change_groups(changes), key=lambda g: -g["count"])[:MAX_ANNOTATIONS]:
            arrow = "↑" if g["kind"] == "growth" else "↓"
            what = f"{g['count']} {g['kind']}s" if g["count"] > 1 else g["kind"]
            annotations.append({"x": g["last_step"], "y": math.log2(g["scale_after"]), "xref": "x", "yref": "y",
                                "showarrow": True, "arrowhead": 2, "ax": 0,
                                "ay": -28 if g["kind"] == "growth" else 28, "font": {"size": 10},
                                "text": f"{arrow} {what}: {_pow2(g['scale_before'])} → {_pow2(g['scale_after'])}"})
        lo, hi = float(timeline["log2_scale"].min()), float(timeline["log2_scale"].max())
        ticks, labels = _log2_ticks(lo - 1, hi + 1, max_ticks=10)
        scale_axis.update(tickvals=ticks, ticktext=labels, range=[lo - 1.5, hi + 1.5])
    for lane_index, frame in steps.sort_values("step").groupby("lane", sort=True):
        lane_mode = str(frame["mode"].iloc[0])
        loss = frame.assign(loss=pd.to_numeric(frame["loss"], errors="coerce"))
        shown = plots.decimate(loss, "loss", max_points, keep="skipped")
        data.append({"type": "scatter", "x": shown["step"].to_numpy(), "y": shown["loss"].to_numpy(), "mode": "lines",
                     "xaxis": "x2", "yaxis": "y2", "name": f"loss lane {lane_index} ({lane_mode})",
                     "line": {"color": plots.mode_color(lane_mode), "width": 1.5},
                     "hovertemplate": f"{lane_mode} step %{{x}}: loss %{{y:.4g}}<extra></extra>"})
        skipped = loss[loss["skipped"].astype(bool)]
        if len(skipped):
            data.append({"type": "scatter", "x": skipped["step"].to_numpy(), "y": skipped["loss"].to_numpy(),
                         "mode": "markers", "xaxis": "x2", "yaxis": "y2", "showlegend": False,
                         "marker": {"symbol": "x", "size": 7, "color": plots.mode_color(lane_mode)},
                         "hovertemplate": f"{lane_mode} step %{{x}} skipped<extra></extra>"})
    shapes = []
    for window in (windows.itertuples(index=False) if windows is not None else ()):
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": window.start - 0.5, "x1": window.end - 0.5,
                       "y0": 0, "y1": 1, "fillcolor": FAULT_FILL, "line": {"width": 0}, "layer": "below"})
        annotations.append({"text": window.description, "xref": "x", "yref": "y domain", "x": window.start - 0.5,
                            "y": 1, "xanchor": "left", "yanchor": "top", "showarrow": False, "font": {"size": 10}})
    layout = {
        "height": 560, "margin": {"l": 10, "r": 10, "t": 40, "b": 10}, "hovermode": "closest",
        "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.04},
        "xaxis": {"anchor": "y", "matches": "x2", "showticklabels": False},
        "xaxis2": {"anchor": "y2", "title": {"text": "step"}},
        "yaxis": scale_axis,
        "yaxis2": {"domain": list(TIMELINE_DOMAINS[1]), "anchor": "x2", "type": "log", "minorloglabels": "complete",
                   "title": {"text": "loss"}},
        "shapes": shapes, "annotations": annotations,
    }
    return go.Figure({"data": data, "layout": layout})


# ---- what a run did -------------------------------------------------------------------------------------

NO_SCALER = "no scaler"
"""What a scale cell says for a lane without a GradScaler (bf16, fp32 and 16-true modes)."""


def scale_text(value: float, mode: str) -> str:
    """A scale as a table cell: "65536", "no scaler" for a mode without one, "—" for a scaled lane with no step yet."""
    if not uses_scaler(mode):
        return NO_SCALER
    return f"{value:g}" if math.isfinite(value) else "—"


def lane_overview(steps: pd.DataFrame, events: pd.DataFrame, lanes: Sequence[LaneInfo]) -> pd.DataFrame:
    """Per lane (lanes from RunReader.run_info): mode, status, steps, skipped steps, non-finite steps, and the scale
    now / min / max as text ("no scaler" for a lane without a GradScaler)."""
    rows = []
    for lane in lanes:
        index, mode = lane.lane, lane.mode
        frame = steps[steps["lane"] == index]
        scale = pd.to_numeric(frame["scale"], errors="coerce").dropna()
        nonfinite = _lane_events(events, index, ("nonfinite_grads",))
        figures = (scale.iloc[-1], scale.min(), scale.max()) if len(scale) else (math.nan,) * 3
        rows.append({"lane": index, "mode": mode, "status": lane.status, "steps": len(frame),
                     "skipped steps": int(frame["skipped"].astype(bool).sum()),
                     "steps with inf/NaN applied": len(nonfinite),
                     **{name: scale_text(float(v), mode) for name, v in zip(OVERVIEW_SCALES, figures, strict=True)}})
    return pd.DataFrame(rows, columns=["lane", "mode", "status", "steps", "skipped steps",
                                       "steps with inf/NaN applied", *OVERVIEW_SCALES])


def fault_recovery(steps: pd.DataFrame, lane: int, start: int, end: int, mode: str = "") -> dict[str, Any]:
    """What a fault acting on steps [start, end) did to one lane (`mode`: the lane's, as its run says; else read from
    its steps). A lane whose records have not reached `start` yet (a live run) is said to be there, not judged.

    skipped_steps: skipped steps from `start` until the scale is back (or the run's end); scale_before: the scale
    of step start-1 (of `start` when it is 0); scale_min: the lowest scale from `start` on; first_clean_step: the
    first step >= start that was not skipped; recovered_step: the first step >= end, not skipped, whose scale is
    back at scale_before (None: not within the run, or no scaler); steps_to_recover: recovered_step - end;
    outcome: the same in one sentence.
    """
    frame = steps[steps["lane"] == lane].sort_values("step")
    step = frame["step"].astype(int)
    scale = pd.to_numeric(frame["scale"], errors="coerce")
    skipped = frame["skipped"].astype(bool)
    after = step >= start
    prior = scale[step == (start - 1 if start > 0 else start)]
    scale_before = float(prior.iloc[0]) if len(prior) else math.nan
    clean = step[after & ~skipped]
    recovered = step[(step >= end) & ~skipped & (scale >= scale_before)]
    recovered_step = int(recovered.iloc[0]) if len(recovered) and not math.isnan(scale_before) else None
    last = recovered_step if recovered_step is not None else (int(step.max()) if len(step) else start)
    skipped_count = int((skipped & after & (step <= last)).sum())
    scale_min = float(scale[after].min()) if scale[after].notna().any() else math.nan
    if not after.any():  # nothing to judge yet: not "no GradScaler" because no scale has been recorded
        where = f"at step {int(step.max())}" if len(step) else "with no step recorded yet"
        outcome = f"not reached yet: the fault acts from step {start}, the lane is {where}"
    elif math.isnan(scale_before):
        outcome = (f"no GradScaler: {skipped_count} steps skipped; the optimizer took every step, "
                   "spiked gradients included")
    else:
        outcome = f"{skipped_count} steps skipped, scale {_pow2(scale_before)} -> {_pow2(scale_min)} at the lowest; "
        if recovered_step is None:
            tail = scale[after].dropna()
            now = f" (it is {_pow2(float(tail.iloc[-1]))} at the last step)" if len(tail) else ""
            outcome += f"not back to {_pow2(scale_before)} within the run{now}"
        else:
            outcome += f"back to {_pow2(scale_before)} at step {recovered_step}, {recovered_step - end} steps after " \
                       "the fault ended"
    return {"lane": lane, "mode": mode or (str(frame["mode"].iloc[0]) if len(frame) else ""),
            "skipped_steps": skipped_count, "scale_before": scale_before, "scale_min": scale_min,
            "first_clean_step": int(clean.iloc[0]) if len(clean) else None, "recovered_step": recovered_step,
            "steps_to_recover": recovered_step - end if recovered_step is not None else None, "outcome": outcome}


def fault_effects(steps: pd.DataFrame, config: dict[str, Any], lanes: Sequence[LaneInfo]) -> pd.DataFrame:
    """fault_recovery for every (fault with a step window, lane it acts on), with the fault's description."""
    rows = []
    for lane in lanes:
        for window in fault_windows(config, lane.mode).itertuples(index=False):
            rows.append({"fault": window.description,
                         **fault_recovery(steps, lane.lane, int(window.start), int(window.end), lane.mode)})
    columns = ["fault", "lane", "mode", "skipped_steps", "scale_before", "scale_min", "first_clean_step",
               "recovered_step", "steps_to_recover", "outcome"]
    frame = pd.DataFrame(rows, columns=columns)
    for column in ("first_clean_step", "recovered_step", "steps_to_recover"):
        frame[column] = frame[column].astype("Int64")
    return frame


def stat_step_labels(stat_steps: list[int], steps: pd.DataFrame, lane: int) -> dict[int, str]:
    """Labels for the sampled steps of a lane: 'step 50 · skipped' where the optimizer step was skipped."""
    frame = steps[steps["lane"] == lane]
    skipped = set(frame.loc[frame["skipped"].astype(bool), "step"].astype(int))
    return {s: f"step {s} · skipped" if s in skipped else f"step {s}" for s in stat_steps}


def default_stat_step(stat_steps: list[int], steps: pd.DataFrame, lane: int) -> int | None:
    """The sampled step the gradient section opens on: the first skipped one (what a user came to see), else the
    last one; None when nothing was sampled."""
    if not stat_steps:
        return None
    frame = steps[steps["lane"] == lane]
    skipped = set(frame.loc[frame["skipped"].astype(bool), "step"].astype(int))
    return next((step for step in stat_steps if step in skipped), stat_steps[-1])


def default_lane(lanes: Sequence[LaneInfo]) -> int:
    """The first lane with a GradScaler (the one that can skip), else the first lane."""
    for lane in lanes:
        if uses_scaler(lane.mode):
            return lane.lane
    return lanes[0].lane if lanes else 0
