"""Plotly figure builders for the Train page (pure: pandas/numpy/plotly), drawn from lanes read for charts.

Every builder takes lanes (`LaneSeries`, read through the multi-resolution summary: every record of a short range,
else an exact min/max envelope with every skipped step and non-finite value at its step) or a DataFrame of records
(split into lanes here), and returns a `go.Figure` whose traces are named by mode and coloured by `mode_color`, so a
mode looks the same in every chart and page. Figures are built from plain dicts: plotly's per-trace validation costs
~3 ms a trace, over the Train page's budget at 4 lanes x 5 charts (see bench/scale.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from _plotly_utils.utils import convert_to_base64

from amp_core.probes.spikes import SpikeRule, band_upper
from amp_core.records.levels import FIELD_INDEX, LEVEL_BASE
from amp_core.records.query import MAX_POINTS, LaneSeries, level_buckets
from amp_core.views.summary import by_lane, seed_groups, seed_spread
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


RECIPE_OPTION_COLORS: dict[str, str] = {
    "fp8-tensorwise": "#8c564b", "fp8-rowwise": "#e377c2", "fp8-rowwise-gw-hp": "#bcbd22",
    "adamw-8bit": "#393b79", "adamw-4bit": "#637939", "adamw-fp8": "#843c39", "states-bf16": "#7b4173",
    "sr": "#e7969c",
    "reduce-bf16": "#17becf", "reduce-fp32": "#6b6ecf",
    "compile": "#d4a017", "compile-max-autotune": "#a05195", "compile-reduce-overhead": "#003f5c",
}
"""A recipe lane takes its last option's colour, so it never shares its plain mode's."""


def mode_color(mode: str) -> str:
    """The colour of a mode, or of a recipe (`MODE+OPTION...`) by its last option."""
    if "+" in mode:
        return RECIPE_OPTION_COLORS.get(mode.rsplit("+", 1)[1], "#7f7f7f")
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


SEED_BAND = "band: min to max across seeds"
"""What the band of a mode drawn from several seed replicates spans (said in the legend and captions)."""


def seed_band_traces(mode: str, steps: np.ndarray, low: np.ndarray, mean: np.ndarray, high: np.ndarray, seeds: int,
                     *, name: str | None = None, legendgroup: str | None = None, dash: str = "solid", unit: str = "",
                     customdata: np.ndarray | None = None, hover: str = "step %{x}") -> list[dict]:
    """One mode of several seed replicates: its mean across seeds (a line in the mode's colour) inside the band from
    the smallest to the largest seed's value, one legend entry ("mode · mean of S seeds")."""
    color = mode_color(mode)
    name = name or f"{mode} · mean of {seeds} seeds"
    group = legendgroup or name
    edge = {"color": color, "width": 0}
    extra = {} if customdata is None else {"customdata": customdata}
    return [
        line_trace(mode, steps, low, name=f"{name} (min)", legendgroup=group, showlegend=False, line=edge,
                   hoverinfo="skip"),
        line_trace(mode, steps, high, name=f"{name} (min-max band)", legendgroup=group, showlegend=False, line=edge,
                   fill="tonexty", fillcolor=_fill(color), hoverinfo="skip"),
        line_trace(mode, steps, mean, name=name, legendgroup=group, line={"color": color, "width": 2, "dash": dash},
                   hovertemplate=f"{hover}: mean %{{y:.4g}}{unit} ({SEED_BAND})<extra>{name}</extra>", **extra),
    ]


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


SPIKE_MARKER = {"symbol": "circle-open", "size": 12, "color": "#d62728", "line": {"width": 2}}
"""How a loss spike (above the robust band) is marked, on the Train page and the Overflow debugger alike."""


def spike_trace(x: np.ndarray, y: np.ndarray, name: str, legendgroup: str = "spike", **extra) -> dict:
    """Loss spikes as open red circles."""
    trace = {"type": "scatter", "mode": "markers", "name": name, "legendgroup": legendgroup, "x": x, "y": y,
             "marker": SPIKE_MARKER, "hovertemplate": "step %{x}: spike, loss %{y:.4g}<extra></extra>"}
    trace.update(extra)
    return trace


def spike_steps(steps: np.ndarray, losses: np.ndarray, rule: SpikeRule) -> np.ndarray:
    """Indices of the steps whose loss lies above the band of the steps before them (probes.spikes)."""
    upper = band_upper(losses, rule)
    with np.errstate(invalid="ignore"):
        return np.flatnonzero(np.isfinite(losses) & (losses > upper))


LEGEND_BELOW = {"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0}
"""A chart's legend in rows under it, anchored to the figure's bottom edge (the margin grows to hold it): anchored to
the plot area instead, a legend of several rows grew up over the x axis's title."""


def chart_layout(title: str, y_title: str, **extra) -> dict:
    layout = {"title": {"text": title}, "height": CHART_HEIGHT, "margin": {"l": 60, "r": 20, "t": 40, "b": 40},
              "xaxis": {"title": {"text": "step"}}, "yaxis": {"title": {"text": y_title}},
              "legend": dict(LEGEND_BELOW), "hovermode": "x unified"}
    layout.update(extra)
    return layout


def _containers_copied(tree):
    """A copy of a figure's dicts, lists and tuples that shares their leaves (strings, numbers, arrays)."""
    if isinstance(tree, dict):
        return {key: _containers_copied(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_containers_copied(value) for value in tree)
    return tree


class ChartFigure(go.Figure):
    """A figure built from a spec this module wrote (plotly's own property names; the tests draw every chart), without
    plotly's validation of each property, whose `to_dict` copies only containers. `st.plotly_chart` calls `to_dict`
    (plotly's deep-copies every value, the template's too) and serialises the result. A live view rebuilds and
    serialises its five figures every few seconds beside a training thread that needs the interpreter: validation
    and deep copies were over half of a redraw's CPU time (cProfile). The default template is applied as plotly
    applies it, and `to_dict` gives what plotly's gives (the same JSON)."""

    def __init__(self, spec: dict):
        super().__init__(spec, _validate=False)

    def to_dict(self) -> dict:
        # convert_to_base64 replaces each array in its (copied) container: the figure's own arrays are left alone.
        # The template (plotly's default: colours, fonts, axes, no arrays) is copied but not searched for arrays:
        # it is most of a figure's dicts.
        layout = {key: value for key, value in self._layout.items() if key != "template"}
        spec = {"data": _containers_copied(self._data), "layout": _containers_copied(layout)}
        convert_to_base64(spec)
        if "template" in self._layout:
            spec["layout"]["template"] = _containers_copied(self._layout["template"])
        return spec


class ChartSpec:
    """A chart as its spec only, with the template a ChartFigure would carry: what chart_feed.figure_spec reads of a
    figure (`_data`, `_layout`), for a live chart, which is fed updates and never draws a plotly Figure. Building one
    deep-copies its data, its layout and plotly's default template: nearly half the CPU of a live view's tick, paid
    twice a second while a room watches (cProfile)."""

    __slots__ = ("_data", "_layout")

    def __init__(self, spec: dict):
        self._data = spec["data"]
        self._layout = dict(spec["layout"], template=_default_template())


_SPECS_ONLY = contextvars.ContextVar("specs_only", default=False)
_template: list[tuple[str, dict]] = []


def _default_template() -> dict:
    """The template plotly gives a new figure now (its default's, as a ChartFigure holds it), made once per default."""
    import plotly.io as pio

    name = str(pio.templates.default)
    if not _template or _template[0][0] != name:
        _template[:] = [(name, ChartFigure({"data": [], "layout": {}})._layout.get("template", {}))]
    return _template[0][1]


@contextlib.contextmanager
def specs_only():
    """Within it, the charts built here are ChartSpecs, not Figures (a live view's specs: see ChartSpec)."""
    token = _SPECS_ONLY.set(True)
    try:
        yield
    finally:
        _SPECS_ONLY.reset(token)


def chart_figure(spec: dict) -> go.Figure:
    """The figure of a spec built here (ChartFigure: no per-property validation, a cheap `to_dict`); within
    `specs_only()`, its ChartSpec."""
    return ChartSpec(spec) if _SPECS_ONLY.get() else ChartFigure(spec)


def _rank_zero(series: list[LaneSeries]) -> list[LaneSeries]:
    """Each lane's first rank (a DDP job's scale and LR are every rank's)."""
    return [ranks[0] for ranks in by_lane(series).values()]


def empty_figure(title: str, why: str) -> go.Figure:
    note = {"text": why, "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}
    return chart_figure({"data": [], "layout": chart_layout(title, "", xaxis={"visible": False},
                                                            yaxis={"visible": False}, annotations=[note])})


LOG_SPAN = 30.0
"""An automatic loss axis turns logarithmic when the finite losses span this factor or more (and are all > 0)."""
OUTLIER_IQRS = 5.0
"""A figure's bulk: points within this many interquartile ranges of the middle half (Tukey's fences, widened)."""
SPIKE_SPAN = 100.0
"""A linear axis leaves the rest out only when they reach this many times farther than the bulk: spikes, not a lane
that drifts away or a long tail of early steps."""
LOSS_SPIKE_SPAN = 10.0
"""The same for the loss axis of the Train page (a curve that falls steadily stays whole: its bulk is wide)."""
LOSS_AXES = ("auto", "linear", "log")
BAND_SAMPLES = 64
"""A step-time band point of at least this many level-1 summary buckets is estimated from their last step times."""
BAND_WINDOW = 25
"""Steps in the rolling window of the step-time median and band while a lane is drawn record by record."""


def bulk_range(values: np.ndarray, include_zero: bool = False,
               spike_span: float = SPIKE_SPAN) -> tuple[float, float] | None:
    """(low, high) of an axis that leaves spikes out, or None when nothing stands out that far: the points within
    OUTLIER_IQRS interquartile ranges of the middle half, padded by a tenth, when all the points reach `spike_span`
    times farther than those."""
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    if finite.size < 8:
        return None
    q1, q3 = np.quantile(finite, [0.25, 0.75])
    reach = OUTLIER_IQRS * (q3 - q1)
    inside = finite[(finite >= q1 - reach) & (finite <= q3 + reach)]
    bottom, top = float(inside.min()), float(inside.max())
    if include_zero:
        bottom, top = min(bottom, 0.0), max(top, 0.0)
    if reach <= 0 or finite.max() - finite.min() <= spike_span * (top - bottom):
        return None
    pad = 0.1 * (top - bottom)
    return bottom - pad, top + pad


def log_axis(title: str) -> dict:
    """A log y axis whose in-between ticks carry their power of ten ("200", "0.02"), not bare digits."""
    return {"title": {"text": title}, "type": "log", "minorloglabels": "complete", "tickfont": {"size": 13}}


def loss_axis(values: np.ndarray, choice: str = "auto") -> tuple[dict, str, tuple[float, float] | None]:
    """(y axis, what it does in words, clipped range or None) for loss values. `choice` "auto": log when the finite
    losses are none negative, their positive ones span LOG_SPAN or more and at most half are exactly 0, else linear
    with spikes left off the axis (marked on its edge); "linear" / "log" as asked (log needs positive losses). A log
    axis has no 0: losses of exactly 0 (a confident classifier's cross-entropy underflows to it) are then marked on
    its bottom edge, the returned range's low end."""
    if choice not in LOSS_AXES:
        raise ValueError(f"loss axis must be one of {', '.join(LOSS_AXES)}, got {choice!r}")
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    positive = finite[finite > 0]
    zeros = int((finite == 0).sum())
    loggable = positive.size > 0 and finite.min() >= 0 and zeros <= finite.size // 2
    span = positive.max() / positive.min() if positive.size else math.nan
    if positive.size and (choice == "log" or (choice == "auto" and loggable and span >= LOG_SPAN)):
        why = f"log axis: the loss spans {math.log10(span):.1f} decades" if choice == "auto" else "log axis"
        if not zeros:
            return log_axis("loss"), why, None
        # Short: the title shares half the page's width (the ▼ markers' hover says "exactly 0").
        decades = f"log axis, {math.log10(span):.1f} decades" if choice == "auto" else "log axis"
        return log_axis("loss"), f"{decades}; {zeros:,} at 0 ▼", (float(positive.min()), float(positive.max()))
    axis = {"title": {"text": "loss"}, "type": "linear"}
    clip = bulk_range(finite, spike_span=LOSS_SPIKE_SPAN) if choice == "auto" else None
    if clip is None:
        return axis, "", None
    axis["range"] = list(clip)
    return axis, "a spike is off the axis (▲ on its edge; hover for its value)", clip


def edge_markers(mode: str, steps: np.ndarray, values: np.ndarray, clip: tuple[float, float], name: str,
                 **extra) -> list[dict]:
    """Values beyond a clipped axis drawn on its edge (▲ above, ▼ below), their true value in the hover."""
    low, high = clip
    out = []
    for beyond, edge, symbol in ((values > high, high, "triangle-up"), (values < low, low, "triangle-down")):
        if beyond.any():
            out.append(marker_trace(mode, steps[beyond], np.full(int(beyond.sum()), edge), name, symbol=symbol,
                                    showlegend=False, customdata=values[beyond],
                                    hovertemplate="step %{x}: %{customdata:.4g} (beyond the axis)<extra>" + mode
                                    + "</extra>", **extra))
    return out


def row_quantiles(matrix: np.ndarray, qs: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's quantiles `qs` of its finite values (numpy's default linear interpolation), NaN for a row with none,
    and each row's count of finite values: one sort for every row instead of a quantile call per row."""
    ordered = np.sort(matrix, axis=1)  # NaN sorts last
    counts = np.isfinite(matrix).sum(axis=1)
    out = np.full((len(matrix), len(qs)), np.nan)
    rows = np.nonzero(counts)[0]
    for j, q in enumerate(qs):
        position = q * (counts[rows] - 1)
        below = np.floor(position).astype(np.int64)
        above = np.minimum(below + 1, counts[rows] - 1)
        low, high = ordered[rows, below], ordered[rows, above]
        out[rows, j] = low + (position - below) * (high - low)
    return out, counts


class StepTimeBands:
    """Per lane, the step time's 10th percentile, median and 90th percentile along the steps: one slow step (a stall,
    a page redrawing) moves neither the median nor the band much.

    A lane holding every record of its range gets a rolling window of BAND_WINDOW records; an envelope gets one point
    per bucket, from the step times of that bucket's records, or, for buckets of BAND_SAMPLES x LEVEL_BASE steps or
    more (a run of about a million steps), from every LEVEL_BASE-th step's time (the summary's level-1 buckets' last
    records): a first view then reads the summary, not every record. A bucket whose steps are all recorded never
    changes, so its figures are kept: a live redraw reads only the bucket still filling.
    """

    def __init__(self, max_kept: int = 20_000):
        self.max_kept = max_kept
        self._kept: dict[tuple, tuple[float, float, float]] = {}

    def band(self, lane: LaneSeries) -> dict[str, np.ndarray]:
        """step, p10, p50, p90 (ms) and records (how many steps each point stands for), by step."""
        if lane.raw is not None:
            steps, ms = np.asarray(lane["step"]), lane["step_ms"]
            rolling = pd.Series(ms).rolling(BAND_WINDOW, min_periods=1)
            return {"step": steps, "p10": rolling.quantile(0.1).to_numpy(), "p50": rolling.median().to_numpy(),
                    "p90": rolling.quantile(0.9).to_numpy(), "records": np.ones(len(steps), dtype=np.int64)}
        size, ids = lane.bucket_steps, np.asarray(lane.buckets["id"], dtype=np.int64)
        lows = np.maximum(ids * size, lane.start)
        highs = np.minimum((ids + 1) * size, lane.stop)
        end = lane.stats.last_step + 1
        figures = np.full((len(ids), 3), np.nan)
        missing = []
        for i, (low, high) in enumerate(zip(lows.tolist(), highs.tolist(), strict=True)):
            kept = self._kept.get((lane.key, lane.rank, low, high))
            if kept is None:
                missing.append(i)
            else:
                figures[i] = kept
        if missing:
            first, last = int(lows[missing[0]]), int(highs[missing[-1]])
            # A bucket of BAND_SAMPLES level-1 summary buckets or more: its quantiles from those buckets' last
            # records (every LEVEL_BASE-th step time, a systematic sample), not from every record of the run.
            every = LEVEL_BASE if size >= LEVEL_BASE * BAND_SAMPLES else 1
            if every > 1:
                sampled = level_buckets(lane.source, 1, first // every, -(-last // every),
                                        ("last_step", "last"))
                steps = np.asarray(sampled["last_step"], dtype=np.int64)
                ms = np.asarray(sampled["last"][:, FIELD_INDEX["step_ms"]], dtype=float)
            else:
                rows = lane.source.raw_rows(first, last, ["step_ms"])
                steps, ms = np.asarray(rows["step"], dtype=np.int64), np.asarray(rows["step_ms"], dtype=float)
            if len(self._kept) > self.max_kept:
                self._kept.clear()
            todo = np.asarray(missing)
            # Every missing bucket at once: a row per bucket, its steps' times in their columns (NaN: no record).
            at = np.searchsorted(lows[todo], steps, side="right") - 1
            inside = (at >= 0) & (steps < highs[todo][np.maximum(at, 0)]) & np.isfinite(ms)
            matrix = np.full((len(todo), -(-int(size) // every)), np.nan)
            matrix[at[inside], (steps[inside] - lows[todo][at[inside]]) // every] = ms[inside]
            quantiles, counts = row_quantiles(matrix, (0.1, 0.5, 0.9))
            figures[todo] = quantiles
            for row, i in enumerate(missing):
                low, high = int(lows[i]), int(highs[i])
                if high <= end and counts[row] == -(-(high - low) // every):  # every step (sample) is in: final
                    self._kept[lane.key, lane.rank, low, high] = tuple(quantiles[row])
        return {"step": highs - 1, "p10": figures[:, 0], "p50": figures[:, 1], "p90": figures[:, 2],
                "records": highs - lows}

    def median_time_s(self, lane: LaneSeries) -> tuple[np.ndarray, np.ndarray]:
        """(steps, seconds): the running sum of the median step time, what the lane would take at its typical speed
        (a stall adds its step's median, not its own length)."""
        band = self.band(lane)
        per_point = np.nan_to_num(band["p50"], nan=0.0) * band["records"]
        return band["step"], np.cumsum(per_point) / 1e3


def band_traces(mode: str, band: dict[str, np.ndarray], name: str, legendgroup: str, dash: str = "solid") -> list:
    """The p10-p90 band (filled, faint) and the median line of one lane."""
    color = mode_color(mode)
    return [
        {"type": "scatter", "mode": "lines", "x": band["step"], "y": band["p90"], "line": {"width": 0, "color": color},
         "legendgroup": legendgroup, "showlegend": False, "hoverinfo": "skip", "name": f"{name} p90"},
        {"type": "scatter", "mode": "lines", "x": band["step"], "y": band["p10"], "line": {"width": 0, "color": color},
         "fill": "tonexty", "fillcolor": _fill(color), "legendgroup": legendgroup, "showlegend": False,
         "name": f"{name} p10-p90", "customdata": np.stack([band["p10"], band["p90"]], axis=1),
         "hovertemplate": "p10 %{customdata[0]:.3g} ms · p90 %{customdata[1]:.3g} ms<extra>" + name + "</extra>"},
        line_trace(mode, band["step"], band["p50"], name=name, legendgroup=legendgroup,
                   line={"color": color, "width": 1.8, "dash": dash},
                   hovertemplate="step %{x}: median %{y:.3g} ms<extra>" + name + "</extra>"),
    ]


def loss_figure(records: pd.DataFrame | list[LaneSeries], *, axis: str = "auto", smoothing: float = 0.0,
                max_points: int = MAX_POINTS, seeds: dict[str, int] | None = None,
                spikes: SpikeRule | None = None) -> go.Figure:
    """Loss vs step per lane (EMA-smoothed if asked, the raw curve then faint behind it); skipped steps as x; with
    `spikes`, each loss above its robust band (probes.spikes) as an open red circle, on a lane drawn step by step (a
    lane read as an envelope of buckets is not marked: its band would be the buckets'). The y axis is `loss_axis`'s:
    by default log when the loss spans a wide range, else linear with spikes off the axis. A mode with several seed
    replicates (`seeds`: lane key -> seed) is one mean line across its seeds inside their min-max band, each seed's
    skipped steps marked."""
    series = _lanes(records, max_points)
    if not series:
        return empty_figure("Loss", "no steps yet")
    drawn, spread = [], []
    for group in seed_groups(series, seeds).values():
        if len(group) > 1:
            replicas = [ranks[0] for ranks in group]
            curves = [smoothed(lane, "loss", smoothing) if smoothing > 0 else lane.means("loss")[:2]
                      for lane in replicas]
            spread += seed_band_traces(replicas[0].mode, *seed_spread(curves), len(replicas))
            for lane in replicas:
                skipped, at_skips = lane.skipped()
                if len(skipped):
                    spread.append(marker_trace(lane.mode, skipped, np.asarray(at_skips["loss"], dtype=float),
                                               f"{lane.mode} skipped", showlegend=False))
            continue
        ranks = group[0]
        lane = ranks[0]
        if len(ranks) > 1:  # a torchrun job: the spread across ranks, rank 0's skipped steps (DDP ranks skip alike)
            spread += spread_traces(ranks, "loss")
            skipped, at_skips = lane.skipped()
            if len(skipped):
                spread.append(marker_trace(lane.mode, skipped, np.asarray(at_skips["loss"], dtype=float),
                                           f"{lane.mode} skipped"))
            continue
        steps, raw = lane.points("loss")
        skipped, at_skips = lane.skipped()
        if smoothing > 0:
            shown_steps, shown = smoothed(lane, "loss", smoothing)
            marks = np.interp(skipped, shown_steps, shown) if len(shown_steps) else np.full(len(skipped), np.nan)
        else:
            shown_steps, shown, marks = steps, raw, np.asarray(at_skips["loss"], dtype=float)
        spiked = (spike_steps(steps, raw, spikes) if spikes is not None and lane.bucket_steps == 1
                  else np.array([], dtype=int))
        drawn.append((lane.mode, steps, raw, shown_steps, shown, skipped, marks, spiked))
    shown_all = [shown for *_, shown, _, _, _ in drawn] or [np.asarray(t["y"], dtype=float) for t in spread]
    yaxis, why, clip = loss_axis(np.concatenate(shown_all) if shown_all else np.array([]), axis)
    data = spread
    for mode, steps, raw, shown_steps, shown, skipped, marks, spiked in drawn:
        if smoothing > 0:
            data.append(line_trace(mode, steps, raw, opacity=0.25, showlegend=False, hoverinfo="skip"))
        data.append(line_trace(mode, shown_steps, shown))
        if clip is not None:
            data += edge_markers(mode, shown_steps, shown, clip, f"{mode} beyond the axis")
        if len(skipped):
            finite = shown[np.isfinite(shown)]
            top = clip[1] if clip is not None else finite.max() if finite.size else 1.0
            at = np.where(np.isfinite(marks), marks, top)  # inf/NaN: on top
            data.append(marker_trace(mode, skipped, np.minimum(at, top) if clip is not None else at,
                                     f"{mode} skipped"))
        if len(spiked):
            at = raw[spiked]
            # Not listed: every lane's spikes are the same red circle, which the Train page's caption explains;
            # they show and hide with their lane's line.
            data.append(spike_trace(steps[spiked], np.minimum(at, clip[1]) if clip is not None else at,
                                    f"{mode} spike", legendgroup=mode, showlegend=False, customdata=at,
                                    hovertemplate="step %{x}: spike, loss %{customdata:.4g}<extra>" + mode
                                                  + "</extra>"))
    title = "Loss" + (f" (EMA smoothing {smoothing:g})" if smoothing > 0 else "") + (f" · {why}" if why else "")
    return chart_figure({"data": data, "layout": chart_layout(title, "loss", yaxis=yaxis)})


def step_time_figure(records: pd.DataFrame | list[LaneSeries], max_points: int = MAX_POINTS, *, raw: bool = False,
                     bands: StepTimeBands | None = None, seeds: dict[str, int] | None = None) -> go.Figure:
    """Step time per lane as a median line with its p10-p90 band (StepTimeBands: robust to one-off stalls); `raw`
    adds the measured points themselves (their min/max envelope on a long run), faint, behind. A mode with several
    seed replicates (`seeds`) is the mean of its seeds' median lines inside the min-max band of those medians."""
    series = _lanes(records, max_points)
    if not series:
        return empty_figure("Step time", "no steps yet")
    bands = bands or StepTimeBands()
    data, replicated = [], False
    for group in seed_groups(series, seeds).values():
        if len(group) > 1:
            replicated = True
            medians = [(band["step"], band["p50"]) for band in (bands.band(ranks[0]) for ranks in group)]
            data += seed_band_traces(group[0][0].mode, *seed_spread(medians), len(group), unit=" ms")
            continue
        ranks = group[0]
        if len(ranks) > 1:  # a torchrun job: the median across ranks inside the min-max band
            data += spread_traces(ranks, "step_ms", " ms")
            continue
        lane = ranks[0]
        if raw:
            steps, ms = lane.points("step_ms")
            data.append({"type": "scattergl" if len(steps) > 1000 else "scatter", "mode": "markers", "x": steps,
                         "y": ms, "name": f"{lane.mode} (each step)", "legendgroup": lane.mode, "showlegend": False,
                         "marker": {"color": mode_color(lane.mode), "size": 3, "opacity": 0.35},
                         "hovertemplate": "step %{x}: %{y:.3g} ms<extra>" + lane.mode + "</extra>"})
        data += band_traces(lane.mode, bands.band(lane), lane.mode, lane.mode)
    # Several seeds: each mode's line is the mean of its seeds' medians, its band their min-max (not p10-p90).
    title = ("Step time · seeds' mean median · min-max band" if replicated else
             "Step time · median and p10-p90 band") + (" · dots: each step" if raw else "")
    return chart_figure({"data": data, "layout": chart_layout(title, "ms / step", hovermode="closest", yaxis={
        "title": {"text": "ms / step"}, "rangemode": "tozero"})})


def constant_lr(records: pd.DataFrame | list[LaneSeries], max_points: int = MAX_POINTS) -> float | None:
    """The LR when every lane used one and the same LR at every step (min = max), else None."""
    values = [lane.points("lr")[1] for lane in _lanes(records, max_points)]
    values = np.concatenate(values) if values else np.array([])
    values = values[np.isfinite(values)]
    return float(values[0]) if values.size and values.min() == values.max() else None


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
    return chart_figure({"data": data, "layout": layout})


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
    return chart_figure({"data": data, "layout": chart_layout("Learning rate", "LR", yaxis=yaxis)})


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
    return chart_figure({"data": data, "layout": chart_layout("GradScaler scale", "scale", yaxis=yaxis)})


def memory_unit(max_bytes: float) -> tuple[str, float]:
    """('MiB', 2**20) for figures of a MiB or more, else ('KiB', 2**10)."""
    return ("MiB", 2.0**20) if max_bytes >= 2**20 else ("KiB", 2.0**10)


def memory_figure(records: pd.DataFrame | list[LaneSeries], labels: dict[str, str] | None = None) -> go.Figure:
    """Bytes each lane holds at its latest step, by part (activations only where measured), one bar per lane named by
    its recipe in full (or `labels`: lane key -> name, e.g. on Compare where two runs may share a mode); on CUDA
    also the allocator peak of the lane's own step above its start, and the lane's own peak (held at the start +
    that). Low-bit optimizer states count the bytes their codes and scales hold. A lane of several ranks (a torchrun
    job) has a bar per rank, "label · rank r": what that rank holds (under FSDP2 its shards, under DDP a full
    replica)."""
    groups = list(by_lane(_lanes(records)).values())
    if not groups:
        return empty_figure("Memory", "no steps yet")
    latest, markers = [], {}
    for ranks in groups:
        for position, lane in enumerate(ranks):
            name = (labels or {}).get(lane.key, lane.mode) + (f" · rank {lane.rank}" if len(ranks) > 1 else "")
            latest.append((name, lane.stats.latest))
            # A lane's ranks side by side in its colour, each further rank a little lighter.
            markers[name] = {"color": mode_color(lane.mode), "opacity": 1.0 - 0.5 * position / len(ranks)}
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
             "y": [v / divisor for v in vals], "marker": markers[mode],
             "customdata": vals, "hovertemplate": "%{x}: %{y:.3g} " + unit + " (%{customdata:,.0f} B)<extra>"
             + mode + "</extra>"} for mode, vals in values.items()]
    per_rank = " per rank" if any(len(ranks) > 1 for ranks in groups) else ""
    layout = chart_layout(f"Memory held{per_rank} (latest step)", unit, barmode="group", hovermode="closest",
                          xaxis={"title": {"text": ""}})
    return chart_figure({"data": data, "layout": layout})


def train_figures(records: pd.DataFrame | list[LaneSeries], *, loss_axis: str = "auto", smoothing: float = 0.0,
                  raw_step_times: bool = False, bands: StepTimeBands | None = None,
                  max_points: int = MAX_POINTS, seeds: dict[str, int] | None = None,
                  spikes: SpikeRule | None = None) -> dict[str, go.Figure]:
    """Every chart of the Train page, keyed loss / step_time / memory / scale / lr (the records split once), and
    `ranks` (each rank's median step time) when a lane ran on several ranks (a torchrun job): its loss and step
    time are then drawn as the median across ranks inside a min-max band. With several seeds per mode (`seeds`: lane
    key -> seed) loss and step time draw each mode as its mean across seeds inside a min-max band; the memory, scale
    and LR charts draw each mode's first seed (every seed of a mode holds the same bytes and steps the same LR; the
    scale of each seed is in the lanes table). `spikes`: the band that marks loss spikes (None: none marked)."""
    series = _lanes(records, max_points)
    firsts = [lane for group in seed_groups(series, seeds).values() for lane in group[0]]  # each mode's first seed
    figures = {"loss": loss_figure(series, axis=loss_axis, smoothing=smoothing, max_points=max_points, seeds=seeds,
                                   spikes=spikes),
               "step_time": step_time_figure(series, max_points, raw=raw_step_times, bands=bands, seeds=seeds),
               "memory": memory_figure(firsts), "scale": scale_figure(firsts, max_points),
               "lr": lr_figure(firsts, max_points)}
    if any(len(ranks) > 1 for ranks in by_lane(series).values()):
        figures["ranks"] = rank_step_time_figure(series)
    return figures
