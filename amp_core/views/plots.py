"""Plotly figure builders for the Train page (pure: pandas/numpy/plotly), drawn from lanes read for charts.

Every builder takes lanes (`LaneSeries`, read through the multi-resolution summary: every record of a short range,
else an exact min/max envelope with every skipped step and non-finite value at its step) or a DataFrame of records
(split into lanes here), and returns a `go.Figure` whose traces are named by mode and coloured by `mode_color`, so a
mode looks the same in every chart and page. Figures are built from plain dicts: plotly's per-trace validation costs
~3 ms a trace, over the Train page's budget at 4 lanes x 5 charts (see bench/scale.py).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.records.query import MAX_POINTS, LaneSeries
from amp_core.views.summary import by_lane
from amp_core.views.summary import lanes as _lanes

# One colour per mode, the same in every chart and page.
MODE_COLORS: dict[str, str] = {
    "32-true": "#1f77b4",
    "tf32": "#17becf",
    "16-mixed": "#d62728",
    "bf16-mixed": "#2ca02c",
    "16-true": "#ff7f0e",
    "bf16-true": "#9467bd",
}
MEMORY_PARTS: tuple[tuple[str, str], ...] = (
    ("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optim_bytes", "optimizer state"),
    ("activations_bytes", "activations"))
CHART_HEIGHT = 320


def mode_color(mode: str) -> str:
    return MODE_COLORS.get(mode, "#7f7f7f")


def _fill(color: str, opacity: float = 0.2) -> str:
    """A '#rrggbb' colour as a translucent rgba fill."""
    red, green, blue = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({red}, {green}, {blue}, {opacity})"


def rank_spread(ranks: list[LaneSeries], figure: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, min, median, max) of a figure across one lane's ranks, at the steps (or buckets: their means) every
    rank has. Non-finite values are left out of a step's spread."""
    columns = []
    for lane in ranks:
        steps, means, _ = lane.means(figure)
        columns.append(pd.Series(np.where(np.isfinite(means), means, np.nan), index=steps))
    table = pd.concat(columns, axis=1, join="inner").sort_index()
    table = table[~table.index.duplicated()]
    values = table.to_numpy(dtype=float)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step where every rank's value is inf/NaN: a gap
        return (table.index.to_numpy(), np.nanmin(values, axis=1), np.nanmedian(values, axis=1),
                np.nanmax(values, axis=1))


def spread_traces(ranks: list[LaneSeries], figure: str, unit: str = "") -> list[dict]:
    """A lane of several ranks drawn as its median across ranks (a line in the mode's colour) inside the band from
    the smallest to the largest rank's value (min / median / max in the hover)."""
    mode, color = ranks[0].mode, mode_color(ranks[0].mode)
    steps, low, middle, high = rank_spread(ranks, figure)

    def named(part: str) -> dict:
        name = f"{mode} · {part} of {len(ranks)} ranks"
        return {"name": name, "hovertemplate": f"step %{{x}}: %{{y:.4g}}{unit}<extra>{name}</extra>"}

    edge = {"color": color, "width": 0}
    return [line_trace(mode, steps, low, showlegend=False, line=edge, **named("min")),
            line_trace(mode, steps, high, showlegend=False, line=edge, fill="tonexty", fillcolor=_fill(color),
                       **named("max")),
            line_trace(mode, steps, middle, **named("median"))]


def decimate_indices(values: np.ndarray, max_points: int = MAX_POINTS, keep: np.ndarray | None = None) -> np.ndarray:
    """Row positions to draw: per bucket the first, min and max, the last row, NaN/inf rows, and every `keep` row.

    Spikes survive because each bucket keeps its extremes; skipped steps survive through `keep`.
    """
    n = len(values)
    if n <= max_points:
        return np.arange(n)
    size = -(-n // max(1, max_points // 3))  # rows per bucket, rounded up
    buckets = -(-n // size)
    v = np.asarray(values, dtype=float)
    finite = np.isfinite(v)
    lo = np.full(buckets * size, np.inf)
    hi = np.full(buckets * size, -np.inf)
    lo[:n] = np.where(finite, v, np.inf)
    hi[:n] = np.where(finite, v, -np.inf)
    offsets = np.arange(buckets) * size
    chosen = [offsets, offsets + lo.reshape(buckets, size).argmin(axis=1),
              offsets + hi.reshape(buckets, size).argmax(axis=1), np.flatnonzero(~finite), np.array([n - 1])]
    if keep is not None:
        chosen.append(np.flatnonzero(keep))
    return np.unique(np.concatenate(chosen))


def decimate(frame: pd.DataFrame, column: str, max_points: int = MAX_POINTS, keep: str | None = None) -> pd.DataFrame:
    """`frame` (one lane, ordered by step) cut to about `max_points` rows that keep spikes and `keep` rows."""
    if len(frame) <= max_points:
        return frame
    mask = frame[keep].to_numpy(dtype=bool) if keep else None
    return frame.iloc[decimate_indices(frame[column].to_numpy(dtype=float), max_points, mask)]


def smooth(values: np.ndarray, smoothing: float) -> np.ndarray:
    """TensorBoard-style EMA (debiased), 0 = none, 0.99 = heavy; non-finite values are skipped, not spread."""
    if smoothing <= 0:
        return values
    series = pd.Series(np.where(np.isfinite(values), values, np.nan))
    return series.ewm(alpha=1.0 - smoothing, adjust=True, ignore_na=True).mean().to_numpy()


def smooth_means(means: np.ndarray, counts: np.ndarray, smoothing: float) -> np.ndarray:
    """The same EMA over buckets: a bucket of n finite values decays the average by smoothing**n and brings in its
    mean with weight 1 - smoothing**n (what the per-step EMA does when a bucket's values are all equal)."""
    out = np.empty(len(means))
    numerator = denominator = 0.0
    for i, (mean, count) in enumerate(zip(means.tolist(), counts.tolist(), strict=True)):
        if count > 0 and math.isfinite(mean):
            decay = smoothing ** count
            numerator = decay * numerator + (1 - decay) * mean
            denominator = decay * denominator + (1 - decay)
        out[i] = numerator / denominator if denominator else math.nan
    return out


def smoothed(lane: LaneSeries, figure: str, smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """(steps, EMA) of a figure: per record when the lane holds every record, else per bucket (at its last step)."""
    steps, means, counts = lane.means(figure)
    if lane.bucket_steps == 1:
        return steps, smooth(means, smoothing)
    return steps, smooth_means(means, counts, smoothing)


# Figures are plain dicts (one idiom for every view): plotly validates a go.Scatter(...) property by property,
# about 3 ms a trace, which a live redraw of 4 lanes x 5 charts cannot afford.
def line_trace(mode: str, x: np.ndarray, y: np.ndarray, **extra) -> dict:
    """A line in the mode's colour (name and legend group: the mode, unless `extra` says otherwise)."""
    trace = {"type": "scatter", "mode": "lines", "name": mode, "legendgroup": mode, "x": x, "y": y,
             "line": {"color": mode_color(mode), "width": 1.6}}
    trace.update(extra)
    return trace


def marker_trace(mode: str, x: np.ndarray, y: np.ndarray, name: str, symbol: str = "x", **extra) -> dict:
    """Markers in the mode's colour (skipped steps, by default)."""
    trace = {"type": "scatter", "mode": "markers", "name": name, "legendgroup": mode, "x": x, "y": y,
             "marker": {"color": mode_color(mode), "symbol": symbol, "size": 9, "line": {"width": 1}},
             "hovertemplate": "step %{x}: skipped<extra>" + mode + "</extra>"}
    trace.update(extra)
    return trace


def chart_layout(title: str, y_title: str, **extra) -> dict:
    layout = {"title": {"text": title}, "height": CHART_HEIGHT, "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
              "xaxis": {"title": {"text": "step"}}, "yaxis": {"title": {"text": y_title}},
              "legend": {"orientation": "h", "y": -0.2}, "hovermode": "x unified"}
    layout.update(extra)
    return layout


def _rank_zero(series: list[LaneSeries]) -> list[LaneSeries]:
    """Each lane's first rank (a DDP job's scale and LR are every rank's)."""
    return [ranks[0] for ranks in by_lane(series).values()]


def empty_figure(title: str, why: str) -> go.Figure:
    return go.Figure({"data": [], "layout": chart_layout(title, "", xaxis={"visible": False}, yaxis={"visible": False},
                                                     annotations=[{"text": why, "showarrow": False, "xref": "paper",
                                                                   "yref": "paper", "x": 0.5, "y": 0.5}])})


def loss_figure(records: pd.DataFrame | list[LaneSeries], *, log_y: bool = False, smoothing: float = 0.0,
                max_points: int = MAX_POINTS) -> go.Figure:
    """Loss vs step per lane (EMA-smoothed if asked, the raw curve then faint behind it); skipped steps as x."""
    series = _lanes(records, max_points)
    if not series:
        return empty_figure("Loss", "no steps yet")
    data = []
    for ranks in by_lane(series).values():
        lane = ranks[0]
        mode = lane.mode
        if len(ranks) > 1:  # a torchrun job: the spread across ranks, rank 0's skipped steps (DDP ranks skip alike)
            data += spread_traces(ranks, "loss")
            skipped, at_skips = lane.skipped()
            if len(skipped):
                data.append(marker_trace(mode, skipped, np.asarray(at_skips["loss"], dtype=float), f"{mode} skipped"))
            continue
        steps, raw = lane.points("loss")
        skipped, at_skips = lane.skipped()
        if smoothing > 0:
            data.append(line_trace(mode, steps, raw, opacity=0.25, showlegend=False, hoverinfo="skip"))
            steps, shown = smoothed(lane, "loss", smoothing)
            marks = np.interp(skipped, steps, shown) if len(steps) else np.full(len(skipped), np.nan)
        else:
            shown, marks = raw, np.asarray(at_skips["loss"], dtype=float)
        data.append(line_trace(mode, steps, shown))
        if len(skipped):
            finite = shown[np.isfinite(shown)]
            top = finite.max() if finite.size else 1.0
            data.append(marker_trace(mode, skipped, np.where(np.isfinite(marks), marks, top),  # inf/NaN: on top
                                     f"{mode} skipped"))
    title = "Loss" + (f" (EMA smoothing {smoothing:g})" if smoothing > 0 else "")
    return go.Figure({"data": data, "layout": chart_layout(title, "loss", yaxis={
        "title": {"text": "loss"}, "type": "log" if log_y else "linear"})})


def step_time_figure(records: pd.DataFrame | list[LaneSeries], max_points: int = MAX_POINTS) -> go.Figure:
    """Measured ms per step per lane (the min/max envelope keeps the slow outliers visible)."""
    series = _lanes(records, max_points)
    if not series:
        return empty_figure("Step time", "no steps yet")
    data = []
    for ranks in by_lane(series).values():
        data += spread_traces(ranks, "step_ms", " ms") if len(ranks) > 1 else \
            [line_trace(ranks[0].mode, *ranks[0].points("step_ms"))]
    return go.Figure({"data": data, "layout": chart_layout("Step time", "ms / step", yaxis={
        "title": {"text": "ms / step"}, "rangemode": "tozero"})})


def rank_step_time_figure(records: pd.DataFrame | list[LaneSeries]) -> go.Figure:
    """Each rank's median step time, grouped by lane (one bar per rank in the mode's colour): how far the slowest
    rank is behind the fastest. Lanes of a single rank are left out."""
    groups = [ranks for ranks in by_lane(_lanes(records)).values() if len(ranks) > 1]
    if not groups:
        return empty_figure("Step time by rank", "no lane ran on more than one rank")
    data = []
    for ranks in groups:
        mode = ranks[0].mode
        medians = np.array([lane.stats.median_step_ms for lane in ranks])
        fastest = np.nanmin(medians)
        data.append({"type": "bar", "name": mode, "legendgroup": mode, "x": [f"rank {lane.rank}" for lane in ranks],
                     "y": medians, "marker": {"color": mode_color(mode)}, "customdata": medians / fastest,
                     "hovertemplate": "%{x}: %{y:.3g} ms (%{customdata:.2f}× the fastest rank)<extra>" + mode
                     + "</extra>"})
    layout = chart_layout("Step time by rank (median)", "ms / step", barmode="group", hovermode="closest",
                          xaxis={"title": {"text": ""}})
    return go.Figure({"data": data, "layout": layout})


def lr_figure(records: pd.DataFrame | list[LaneSeries], max_points: int = MAX_POINTS) -> go.Figure:
    """The LR each lane's optimizer used (it differs between lanes only under an LR fault)."""
    series = _rank_zero(_lanes(records, max_points))
    if not series:
        return empty_figure("Learning rate", "no steps yet")
    data, tops = [], []
    for lane in series:
        steps, lr = lane.points("lr")
        tops.append(np.nanmax(lr) if np.isfinite(lr).any() else np.nan)
        data.append(line_trace(lane.mode, steps, lr, line={"color": mode_color(lane.mode), "width": 1.6,
                                                           "shape": "hv"}))
    yaxis = {"title": {"text": "LR"}, "rangemode": "tozero", "exponentformat": "e"}
    top = max(tops)
    if np.isfinite(top) and top > 0:  # plotly would centre a constant LR on a -1..1 axis, where 1e-3 looks like 0
        yaxis["range"] = [0, top * 1.15]
    return go.Figure({"data": data, "layout": chart_layout("Learning rate", "LR", yaxis=yaxis)})


def scale_figure(records: pd.DataFrame | list[LaneSeries], max_points: int = MAX_POINTS) -> go.Figure:
    """GradScaler scale per scaled lane on a log2 axis (ticks at powers of two); skipped steps as x."""
    scaled = [(lane, *lane.points("scale")) for lane in _rank_zero(_lanes(records, max_points))]
    scaled = [(lane, steps, scale) for lane, steps, scale in scaled if not np.isnan(scale).all()]
    if not scaled:
        return empty_figure("GradScaler scale", "no lane uses a GradScaler (only 16-mixed does)")
    data, exponents = [], []
    for lane, steps, scale in scaled:
        mode = lane.mode
        data.append(line_trace(mode, steps, scale, line={"color": mode_color(mode), "width": 1.6, "shape": "hv"}))
        skipped, at_skips = lane.skipped()
        if len(skipped):
            data.append(marker_trace(mode, skipped, np.asarray(at_skips["scale"], dtype=float), f"{mode} skipped"))
        positive = scale[(scale > 0) & np.isfinite(scale)]
        if positive.size:
            exponents += [math.floor(math.log2(positive.min())), math.ceil(math.log2(positive.max()))]
    low, high = (min(exponents), max(exponents)) if exponents else (0, 16)
    every = max(1, -(-(high - low + 1) // 12))  # at most ~12 tick labels
    ticks = list(range(low, high + 1, every))
    yaxis = {"title": {"text": "scale (log2)"}, "type": "log", "tickvals": [2.0**k for k in ticks],
             "ticktext": [f"2^{k}" for k in ticks]}
    return go.Figure({"data": data, "layout": chart_layout("GradScaler scale", "scale", yaxis=yaxis)})


def memory_unit(max_bytes: float) -> tuple[str, float]:
    """('MiB', 2**20) for figures of a MiB or more, else ('KiB', 2**10)."""
    return ("MiB", 2.0**20) if max_bytes >= 2**20 else ("KiB", 2.0**10)


def memory_figure(records: pd.DataFrame | list[LaneSeries]) -> go.Figure:
    """Bytes each lane holds at its latest step, by part (activations only where measured), one bar per mode; on CUDA
    also the allocator peak of the lane's own step above its start, and the lane's own peak (held at the start +
    that). A lane of several ranks shows its largest rank's figures."""
    series = [max(ranks, key=lambda lane: lane.stats.peak_bytes if np.isfinite(lane.stats.peak_bytes) else -1)
              for ranks in by_lane(_lanes(records)).values()]
    if not series:
        return empty_figure("Memory", "no steps yet")
    latest = [(lane.mode, lane.stats.latest) for lane in series]
    # A forward always saves some bytes for backward: none anywhere means nobody measured them (a Monitor, which does
    # not run the user's forward), and an empty bar would read as "no activations".
    parts = [part for part in MEMORY_PARTS if part[0] != "activations_bytes" or
             any(row.get("activations_bytes", 0) for _, row in latest)] + [("_held", "total held")]
    if any(pd.notna(row.get("peak_above_start_bytes")) for _, row in latest):
        parts += [("peak_above_start_bytes", "step peak above its start (CUDA)"),
                  ("lane_peak_bytes", "lane peak (CUDA)")]
    values = {mode: [float(sum(row.get(c, np.nan) for c, _ in MEMORY_PARTS)) if column == "_held" else
                     float(row.get(column, np.nan)) for column, _ in parts]
              for mode, row in latest}
    unit, divisor = memory_unit(np.nanmax([v for vals in values.values() for v in vals] + [0.0]))
    labels = [label for _, label in parts]
    data = [{"type": "bar", "name": mode, "legendgroup": mode, "x": labels,
             "y": [v / divisor for v in vals], "marker": {"color": mode_color(mode)},
             "customdata": vals, "hovertemplate": "%{x}: %{y:.3g} " + unit + " (%{customdata:,.0f} B)<extra>"
             + mode + "</extra>"} for mode, vals in values.items()]
    layout = chart_layout("Memory held (latest step)", unit, barmode="group", hovermode="closest",
                     xaxis={"title": {"text": ""}})
    return go.Figure({"data": data, "layout": layout})


def train_figures(records: pd.DataFrame | list[LaneSeries], *, log_y: bool = False, smoothing: float = 0.0,
                  max_points: int = MAX_POINTS) -> dict[str, go.Figure]:
    """Every chart of the Train page, keyed loss / step_time / memory / scale / lr (the records split once), and
    `ranks` (each rank's median step time) when a lane ran on several ranks (a torchrun job): its loss and step
    time are then drawn as the median across ranks inside a min-max band."""
    series = _lanes(records, max_points)
    figures = {"loss": loss_figure(series, log_y=log_y, smoothing=smoothing, max_points=max_points),
               "step_time": step_time_figure(series, max_points), "memory": memory_figure(series),
               "scale": scale_figure(series, max_points), "lr": lr_figure(series, max_points)}
    if any(len(ranks) > 1 for ranks in by_lane(series).values()):
        figures["ranks"] = rank_step_time_figure(series)
    return figures
