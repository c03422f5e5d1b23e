"""Layer-numerics figures and tables: per-layer error against fp32, per-layer ranges against fp16, and a run's sampled
per-layer abs max over steps as a heatmap that shows an activation climbing toward fp16's limit."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.probes.layerwatch import FIRST_NONFINITE_EVENT
from amp_core.probes.numerics import FP16_MAX, FP16_TINY, LAYER_AMAX_EVENT, NumericsReport
from amp_core.views.optrace import DTYPE_COLOURS
from amp_core.views.plots import chart_layout, empty_figure

FP16_MAX_LOG2 = math.log2(FP16_MAX)
"""15.9993: log2 of fp16's largest value; the heatmap's colour turns red above it."""
FP16_SMALLEST_LOG2 = -24
"""log2 of fp16's smallest subnormal; below about half of it a value flushes to 0."""
NONFINITE_COLOUR = "#d62728"
TENSORS = {"output": "out", "input": "in", "grad": "grad"}
"""Which tensor of a module a range figure shows -> its column prefix in NumericsReport.module_frame()."""


def _log2(values: pd.Series) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(values.to_numpy(dtype=float))


def _figure_height(rows: int) -> int:
    return max(280, 120 + 22 * rows)


def error_figure(report: NumericsReport) -> go.Figure:
    """Per module, the relative error of its output against fp32 (log axis), worst on top; bars coloured by the dtype
    the output was held in; an inf/NaN error is drawn red at the right edge and labelled."""
    frame = report.error_frame()
    title = f"Error of each module's output against fp32 · {report.label}"
    if frame.empty:
        return empty_figure(title, "no module produced a floating-point output")
    errors = frame["output_error"].to_numpy(dtype=float)
    finite = errors[np.isfinite(errors) & (errors > 0)]
    if finite.size == 0 and np.isfinite(errors).all():
        return empty_figure(title, f"every output equals the {report.reference_mode} run's exactly (error 0)")
    edge = finite.max() * 4 if finite.size else 1.0
    floor = finite.min() / 4 if finite.size else 1e-8
    shown = np.where(np.isfinite(errors), np.maximum(errors, floor), edge)  # a log axis cannot draw 0
    labels = [_error_text(e) for e in errors]
    colours = [NONFINITE_COLOUR if not math.isfinite(e) else DTYPE_COLOURS.get(d.split(", ")[0], "#72b7b2")
               for e, d in zip(errors, frame["dtype"], strict=True)]
    first = report.first_nonfinite
    outline = ["#000000" if first and m.split(" (call")[0] == first.module else "rgba(0,0,0,0)"
               for m in frame["module"]]
    bar = {"type": "bar", "orientation": "h", "y": frame["module"].tolist()[::-1], "x": shown[::-1].tolist(),
           "text": labels[::-1], "textposition": "outside", "cliponaxis": False,
           "marker": {"color": colours[::-1], "line": {"color": outline[::-1], "width": 2}},
           "customdata": frame["dtype"].tolist()[::-1],
           "hovertemplate": "%{y} (%{customdata}): relative error %{text}<extra></extra>"}
    layout = chart_layout(f"{title}<br><sup>‖y − y_fp32‖ / ‖y_fp32‖, worst on top · output dtype {_dtype_key()}</sup>",
                          "", height=_figure_height(len(frame)), hovermode="closest", showlegend=False,
                          margin={"l": 140, "r": 70, "t": 70, "b": 45},
                          xaxis={"type": "log", "title": {"text": "relative error (log)"}, "exponentformat": "e"},
                          yaxis={"automargin": True})
    return go.Figure({"data": [bar], "layout": layout})


def _dtype_key() -> str:
    return " · ".join(f"<span style='color:{DTYPE_COLOURS[d]}'>■</span> {d}" for d in ("fp32", "bf16", "fp16"))


def _error_text(error: float) -> str:
    if math.isnan(error):
        return "NaN"
    if math.isinf(error):
        return "inf"
    return f"{error:.2g}"


def range_figure(report: NumericsReport, tensor: str = "output") -> go.Figure:
    """Per module (forward order, top to bottom) the span of |values| its output, input or output gradient held in
    the mode, from the smallest non-zero to the largest, on a log2 axis against fp16's limits."""
    if tensor not in TENSORS:
        raise ValueError(f"tensor must be one of {', '.join(TENSORS)}, got {tensor!r}")
    prefix = TENSORS[tensor]
    frame = report.module_frame()
    frame = frame[frame[f"{prefix}_abs_max"].notna()]
    title = f"Range of each module's {tensor} · {report.label}"
    if frame.empty:
        return empty_figure(title, f"no module has a floating-point {tensor}")
    low, high = _log2(frame[f"{prefix}_min_nonzero"]), _log2(frame[f"{prefix}_abs_max"])
    drawn = np.isfinite(low) & np.isfinite(high)  # a tensor with no finite non-zero value has no span to draw
    finite_low = low[drawn]
    start = min(FP16_SMALLEST_LOG2 - 2, math.floor(finite_low.min()) - 1) if finite_low.size else -26
    base = np.where(drawn, low, start)
    width = np.where(drawn, np.maximum(np.where(drawn, high - low, 0), 0.15), 0)
    broken = (frame[f"{prefix}_inf"] + frame[f"{prefix}_nan"]).to_numpy() > 0
    modules = frame["module"].tolist()
    data = [{"type": "bar", "orientation": "h", "y": modules[::-1], "base": base[::-1].tolist(),
             "x": width[::-1].tolist(), "name": "|values| (smallest non-zero .. largest)",
             "marker": {"color": [DTYPE_COLOURS.get(d.split(", ")[0], "#72b7b2") for d in frame["dtype"]][::-1]},
             "customdata": np.stack([frame[f"{prefix}_min_nonzero"], frame[f"{prefix}_abs_max"]], axis=1)[::-1],
             "hovertemplate": "%{y}: %{customdata[0]:.3g} .. %{customdata[1]:.3g}<extra></extra>"}]
    if broken.any():
        data.append({"type": "scatter", "mode": "markers+text", "name": "holds inf/NaN",
                     "y": [m for m, b in zip(modules, broken, strict=True) if b],
                     "x": [FP16_MAX_LOG2 + 1.5] * int(broken.sum()), "text": ["inf/NaN"] * int(broken.sum()),
                     "textposition": "middle right", "marker": {"color": NONFINITE_COLOUR, "symbol": "x", "size": 11},
                     "hoverinfo": "skip"})
    limits = [(FP16_SMALLEST_LOG2, "fp16 subnormal<br>from 2^-24"), (math.log2(FP16_TINY), "fp16 normal<br>from 2^-14"),
              (FP16_MAX_LOG2, "fp16 max<br>65504")]
    shapes = [{"type": "line", "xref": "x", "yref": "paper", "x0": x, "x1": x, "y0": 0, "y1": 1,
               "line": {"color": NONFINITE_COLOUR if x > 0 else "#7f7f7f", "dash": "dash", "width": 1}}
              for x, _ in limits]
    annotations = [{"x": x, "y": 1.0, "xref": "x", "yref": "paper", "text": text, "showarrow": False,
                    "xanchor": "center", "yanchor": "bottom", "font": {"size": 10, "color": "#555"}}
                   for x, text in limits]
    ticks = list(range(int(start) - int(start) % 4, 22, 4))
    layout = chart_layout(f"{title}<br><sup>in the mode's own tensors, coloured by dtype {_dtype_key()}; dashed: "
                          "fp16's limits (bf16 spans fp32's range, 2^-133 .. 2^128)</sup>", "",
                          height=_figure_height(len(frame)),
                          hovermode="closest", showlegend=False, shapes=shapes, annotations=annotations,
                          margin={"l": 140, "r": 30, "t": 105, "b": 45}, yaxis={"automargin": True},
                          xaxis={"title": {"text": "|value| (log2)"}, "range": [start, FP16_MAX_LOG2 + 4],
                                 "tickvals": ticks, "ticktext": [f"2^{k}" for k in ticks]})
    return go.Figure({"data": data, "layout": layout})


# --- over time ------------------------------------------------------------------------------------------------------

AMAX_COLUMNS = ["lane", "step", "order", "module", "output_amax", "grad_amax", "output_nonfinite", "grad_nonfinite",
                "scale"]


def amax_samples(events: pd.DataFrame) -> pd.DataFrame:
    """A run's layer_amax events as one row per lane, step and module: order (execution order within the step),
    output_amax and grad_amax (NaN where there was no value or it was inf/NaN), output_nonfinite and grad_nonfinite
    (the tensor held inf or NaN), scale."""
    if events.empty:
        return pd.DataFrame(columns=AMAX_COLUMNS)
    rows = []
    for event in events[events["kind"] == LAYER_AMAX_EVENT].itertuples():
        data = event.data
        for order, (module, output, grad) in enumerate(zip(data["modules"], data["output_amax"], data["grad_amax"],
                                                           strict=True)):
            rows.append({"lane": int(event.lane), "step": int(event.step), "order": order, "module": module,
                         "output_amax": _amax(output), "grad_amax": _amax(grad),
                         "output_nonfinite": isinstance(output, str), "grad_nonfinite": isinstance(grad, str),
                         "scale": data.get("scale")})
    return pd.DataFrame(rows, columns=AMAX_COLUMNS)


def _amax(value: float | str | None) -> float:
    return math.nan if value is None or isinstance(value, str) else float(value)


def amax_heatmap(samples: pd.DataFrame, lane: int, mode: str, which: str = "output") -> go.Figure:
    """Per module (rows, execution order) and sampled step (columns): log2 of the abs max. The colour runs up to
    fp16's largest value and turns red above it; a cell that held inf/NaN is red and says so."""
    column = {"output": "output_amax", "grad": "grad_amax"}.get(which)
    if column is None:
        raise ValueError(f"which must be 'output' or 'grad', got {which!r}")
    title = f"Abs max of each module's {'output' if which == 'output' else 'output gradient'} over steps · {mode}"
    picked = samples[samples["lane"] == lane]
    if picked.empty:
        return empty_figure(title, "this lane has no layer amax samples")
    modules = picked.sort_values(["step", "order"]).drop_duplicates("module")["module"].tolist()
    grid = picked.pivot_table(index="module", columns="step", values=column, aggfunc="max", dropna=False)
    grid = grid.reindex(modules)
    steps = [int(s) for s in grid.columns]
    values = grid.to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        logged = np.log2(values)
    finite = logged[np.isfinite(logged)]
    bottom = math.floor(finite.min()) if finite.size else -8
    bottom = min(bottom, math.floor(FP16_MAX_LOG2) - 8)
    top = FP16_MAX_LOG2 + 1
    flags = picked[picked[f"{which}_nonfinite"]]
    held = set(zip(flags["module"], flags["step"].astype(int), strict=True))
    shown = np.where(np.isfinite(logged), np.minimum(logged, top), bottom)
    text = [[_cell_text(values[i, j], (m, s) in held) for j, s in enumerate(steps)] for i, m in enumerate(modules)]
    for i, module in enumerate(modules):
        for j, step in enumerate(steps):
            if (module, step) in held:
                shown[i, j] = top
    limit = (FP16_MAX_LOG2 - bottom) / (top - bottom)
    colours = [[0.0, "#f7fbff"], [limit * 0.5, "#6baed6"], [limit * 0.85, "#08519c"], [limit, "#fdae61"],
               [limit, NONFINITE_COLOUR], [1.0, NONFINITE_COLOUR]]
    ticks = [k for k in range(int(bottom) - int(bottom) % 4, 14, 4) if k >= bottom] + [FP16_MAX_LOG2]
    heatmap = {"type": "heatmap", "x": steps, "y": modules, "z": shown.tolist(), "zmin": bottom, "zmax": top,
               "colorscale": colours, "text": text, "hovertemplate": "%{y} · step %{x}: %{text}<extra></extra>",
               "colorbar": {"title": {"text": "log2 |max|"}, "tickvals": ticks,
                            "ticktext": [f"2^{k}" for k in ticks[:-1]] + ["fp16 max"]},
               "xgap": 1, "ygap": 1}
    scale_note = "scaled by the loss scale, as the fp16 backward holds them" if which == "grad" else ""
    layout = chart_layout(f"{title}<br><sup>red: above fp16's largest value 65504 (or inf/NaN) {scale_note}</sup>",
                          "", height=_figure_height(len(modules)), hovermode="closest",
                          margin={"l": 140, "r": 20, "t": 70, "b": 45},
                          yaxis={"autorange": "reversed", "automargin": True, "type": "category"},
                          xaxis={"title": {"text": "step"}, "type": "category" if len(steps) < 30 else "linear"})
    return go.Figure({"data": [heatmap], "layout": layout})


def _cell_text(value: float, nonfinite: bool) -> str:
    if nonfinite:
        return "inf/NaN"
    if math.isnan(value):
        return "not sampled"
    return f"{value:.3g} (2^{math.log2(value):.1f})" if value > 0 else "0"


def amax_story(samples: pd.DataFrame, lane: int, which: str = "output") -> str:
    """One line about a lane's samples: the first module and step where a value broke, else the module that came
    closest to fp16's limit (how many binades below it)."""
    column = "output_amax" if which == "output" else "grad_amax"
    picked = samples[samples["lane"] == lane].sort_values(["step", "order"])
    if picked.empty:
        return "no samples yet"
    broken = picked[picked[f"{which}_nonfinite"]]
    growing = picked.dropna(subset=[column])
    if not broken.empty:
        first = broken.iloc[0]
        before = growing[(growing["module"] == first["module"]) & (growing["step"] < first["step"])]
        history = (f"; it was {before.iloc[-1][column]:.3g} at step {int(before.iloc[-1]['step'])}"
                   if not before.empty else "")
        return f"first inf/NaN: {first['module']} at step {int(first['step'])}{history}"
    if growing.empty or growing[column].max() <= 0:
        return "no non-zero values sampled"
    peak = growing.loc[growing[column].idxmax()]
    headroom = FP16_MAX_LOG2 - math.log2(peak[column])
    where = "above" if headroom < 0 else "below"
    return (f"closest to fp16's limit: {peak['module']} at step {int(peak['step'])}, {peak[column]:.3g} "
            f"({abs(headroom):.1f} binades {where} 65504)")


def first_nonfinite_events(events: pd.DataFrame, lane: int | None = None) -> pd.DataFrame:
    """An attached run's first inf/NaN events (amp_core.probes.layerwatch) as rows: step (the failed one), watched
    (the step whose hooks named it), module, phase, before / after (abs max), message. `lane`: that lane's only."""
    columns = ["step", "watched", "module", "phase", "before", "after", "message"]
    if events.empty:
        return pd.DataFrame(columns=columns)
    if lane is not None:
        events = events[pd.to_numeric(events["lane"], errors="coerce") == lane]
    rows = [{"step": event.data.get("failed_step"), "watched": event.data.get("watched_step"),
             "module": event.data.get("module") or "–", "phase": event.data.get("phase") or "–",
             "before": _amax_text(event.data.get("before_amax")), "after": _amax_text(event.data.get("after_amax")),
             "message": event.message}
            for event in events[events["kind"] == FIRST_NONFINITE_EVENT].itertuples()]
    return pd.DataFrame(rows, columns=columns)


def _amax_text(value: float | str | None) -> str:
    return "–" if value is None else value if isinstance(value, str) else f"{value:.3g}"


def amax_texts(values: list[float | str | None]) -> list[str]:
    """Abs-max figures as a table shows them: 3 significant digits, "inf" / "nan" as recorded, "–" for none."""
    return [_amax_text(value) for value in values]


def cast_shares(events: pd.DataFrame, lane: int, which: str = "output") -> pd.DataFrame:
    """The latest sampled step's per-module shares of values a cast to each format overflows / makes subnormal /
    flushes to zero (attached runs' samples carry them, and a race's FP8 lanes', with the fp8 formats also after
    torchao's scale; other race lanes' do not: empty then). Columns: module, then '<format> <effect>'; attrs: step,
    and fp8 (how torchao scales and casts) for an FP8 lane."""
    if events.empty:
        return pd.DataFrame()
    samples = events[(events["kind"] == LAYER_AMAX_EVENT) & (events["lane"] == lane)]
    samples = samples[[isinstance(d, dict) and "shares" in d for d in samples["data"]]]
    if samples.empty:
        return pd.DataFrame()
    latest = samples.iloc[-1]
    frame = cast_shares_table(latest["data"], which)
    frame.attrs["step"] = int(latest["step"])
    frame.attrs["fp8"] = latest["data"].get("fp8")
    return frame


CAST_EFFECTS = ("overflow", "subnormal", "zero")
"""The column suffixes of a cast-shares table."""


def cast_shares_table(data: dict, which: str = "output") -> pd.DataFrame:
    """One attached sample's (a layer_amax event's data with shares) per-module shares: module, '<format> <effect>'."""
    frame = pd.DataFrame({"module": data["modules"]})
    for name, effects in data["shares"][which].items():
        for effect, values in effects.items():
            frame[f"{name} {effect}"] = [math.nan if v is None else v for v in values]
    return frame
