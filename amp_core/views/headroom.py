"""Headroom over time, for Layer numerics and the Overflow debugger: each sampled layer's bits to a format's limit at
every sample with the forecast's line to zero and the predicted break step; for each failed step, whether it was
forecast and how early; a fix race's lanes as a table."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.probes.headroom import FORECAST_EVENT, FORMAT_LIMITS, LOSS_PSEUDO_MODULE, first_warning, headroom_bits
from amp_core.probes.numerics import LAYER_AMAX_EVENT
from amp_core.views.plots import LEGEND_BELOW, chart_layout, empty_figure

if TYPE_CHECKING:
    from amp_core.diagnostics.forecast_fix import FixRace

SHOWN_LAYERS = 6
"""Layers drawn: those with the least headroom at the latest sample (and any a forecast names)."""
FORECAST_COLOUR = "#ff7f0e"
BREAK_COLOUR = "#d62728"
LAYER_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def headroom_history(events: pd.DataFrame, lane: int, tensor: str, format_name: str, limit: str) -> pd.DataFrame:
    """(step, module, headroom_bits) of every sample of `lane`: bits between the tensor's abs max as held (a
    gradient under a GradScaler at that step's scale, as the backward held it) and the format's limit; NaN where the
    sample held inf/NaN (the tensor was past every limit)."""
    rows: list[tuple[int, str, float]] = []
    if not events.empty:
        limits = FORMAT_LIMITS[format_name]
        samples = events[(events["kind"] == LAYER_AMAX_EVENT) & (events["lane"] == lane)]
        for step, data in zip(samples["step"], samples["data"], strict=True):
            for module, amax in zip(data.get("modules") or [], data.get(f"{tensor}_amax") or [], strict=False):
                if module == LOSS_PSEUDO_MODULE:
                    continue
                finite = isinstance(amax, int | float) and amax > 0 and math.isfinite(amax)
                rows.append((int(step), module, headroom_bits(amax, limits, limit) if finite else math.nan))
    return pd.DataFrame(rows, columns=["step", "module", "headroom_bits"]).sort_values("step", kind="stable")


def sampled(events: pd.DataFrame, lane: int) -> bool:
    """Whether the lane has layer samples (what a forecast is made from)."""
    return not events.empty and bool(((events["kind"] == LAYER_AMAX_EVENT) & (events["lane"] == lane)).any())


def first_break(steps: pd.DataFrame, lane: int) -> int | None:
    """The lane's first step with a non-finite loss: the break a forecast of an overflow predicts."""
    if steps.empty:
        return None
    mine = steps[steps["lane"] == lane]
    broken = mine[~mine["loss"].astype(float).map(math.isfinite)]
    return int(broken["step"].min()) if len(broken) else None


def _forecast_traces(step: int, data: dict, history: pd.DataFrame, label: str, dash: str) -> list[dict]:
    """The told forecast's line from its layer's headroom at the step it was told down to zero at the predicted
    step, and its interval as a fan to lo and hi."""
    at = history[(history["module"] == data["module"]) & (history["step"] <= step)]["headroom_bits"].dropna()
    start = float(at.iloc[-1]) if len(at) else float(data["headroom_bits"])
    fan = {"type": "scatter", "mode": "lines", "showlegend": False, "hoverinfo": "skip",
           "line": {"color": FORECAST_COLOUR, "width": 1, "dash": "dot"}}
    return [
        {**fan, "x": [step, data["lo_step"], None, step, data["hi_step"]], "y": [start, 0, None, start, 0]},
        {"type": "scatter", "mode": "lines+markers", "name": label, "x": [step, data["predicted_step"]],
         "y": [start, 0], "line": {"color": FORECAST_COLOUR, "width": 2, "dash": dash},
         "marker": {"symbol": ["circle", "x"], "size": [7, 11], "color": FORECAST_COLOUR},
         "hovertemplate": f"{label}<br>step %{{x}}: %{{y:.1f}} bits<extra></extra>"},
    ]


def headroom_figure(events: pd.DataFrame, steps: pd.DataFrame, lane: int, mode: str, tensor: str,
                    format_name: str, limit: str) -> go.Figure:
    """Headroom (bits) over steps of the layers nearest the limit; the forecast the lane told for this tensor,
    format and limit (its first warning, and its latest when that moved) as a line down to zero with its interval;
    the predicted step and the lane's break (its first non-finite loss) as vertical lines."""
    which = "largest value" if limit == "max" else "smallest normal"
    what = "outputs" if tensor == "output" else "gradients w.r.t. its output (as held: times the loss scale)"
    title = f"Headroom of each layer's {what} to {format_name}'s {which} · lane {lane} · {mode}"
    history = headroom_history(events, lane, tensor, format_name, limit)
    if history.empty:
        return empty_figure(title, "this lane has no layer samples yet")
    latest = history[history["step"] == history["step"].max()].sort_values("headroom_bits", na_position="first")
    shown = list(dict.fromkeys(latest["module"].head(SHOWN_LAYERS)))
    told = told_for(events, lane, tensor, format_name, limit)
    first = first_warning(list(zip(told["step"], told["data"], strict=True))) if not told.empty else None
    last = (int(told.iloc[-1]["step"]), told.iloc[-1]["data"]) if not told.empty else None
    for _, data in filter(None, (first, last)):
        if data["module"] not in shown:
            shown.append(data["module"])
    data_traces: list[dict] = []
    for index, module in enumerate(shown):
        rows = history[history["module"] == module]
        data_traces.append({"type": "scatter", "mode": "lines+markers", "name": module, "x": rows["step"].tolist(),
                            "y": rows["headroom_bits"].tolist(), "marker": {"size": 4},
                            "line": {"color": LAYER_COLOURS[index % len(LAYER_COLOURS)], "width": 1.5},
                            "hovertemplate": f"{module}<br>step %{{x}}: %{{y:.2f}} bits<extra></extra>"})
    shapes, annotations = [], []
    right = int(history["step"].max())
    if first is not None:
        data_traces += _forecast_traces(first[0], first[1], history, f"forecast told at step {first[0]}", "dash")
        right = max(right, first[1]["hi_step"])
    if last is not None and first is not None and last[0] != first[0]:
        data_traces += _forecast_traces(last[0], last[1], history, f"latest, told at step {last[0]}", "dashdot")
        right = max(right, last[1]["hi_step"])
    if first is not None:
        predicted = first[1]["predicted_step"]
        shapes.append(_vertical(predicted, FORECAST_COLOUR, "dash"))
        annotations.append(_label(predicted, f"forecast: step {predicted}", FORECAST_COLOUR, 1.0))
    broke = first_break(steps, lane)
    if broke is not None:
        shapes.append(_vertical(broke, BREAK_COLOUR, "solid"))
        annotations.append(_label(broke, f"broke: step {broke}", BREAK_COLOUR, 0.9))
        right = max(right, broke)
    shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 0, "y1": 0,
                   "line": {"color": BREAK_COLOUR, "width": 1}})
    finite = history["headroom_bits"].dropna()
    top = max(float(finite[history.loc[finite.index, "module"].isin(shown)].max()) if len(finite) else 1.0, 1.0)
    layout = chart_layout(f"{title}<br><sup>0 bits: the limit; a layer that held inf/NaN leaves a gap</sup>",
                          "headroom (bits)", height=380, hovermode="closest", legend=LEGEND_BELOW,
                          margin={"l": 60, "r": 20, "t": 70, "b": 110}, shapes=shapes, annotations=annotations,
                          xaxis={"title": {"text": "step"}, "range": [-0.02 * right, right * 1.04 + 1]},
                          yaxis={"title": {"text": "headroom (bits)"}, "range": [-1.0, top * 1.08 + 0.5]})
    return go.Figure({"data": data_traces, "layout": layout})


def _vertical(step: int, colour: str, dash: str) -> dict:
    return {"type": "line", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
            "line": {"color": colour, "width": 1.5, "dash": dash}}


def _label(step: int, text: str, colour: str, y: float) -> dict:
    return {"x": step, "y": y, "yref": "paper", "text": text, "showarrow": False, "xanchor": "left",
            "font": {"color": colour, "size": 11}, "bgcolor": "rgba(255,255,255,0.8)"}


def told_for(events: pd.DataFrame, lane: int, tensor: str | None = None, format_name: str | None = None,
             limit: str | None = None) -> pd.DataFrame:
    """The lane's told forecasts (its `forecast` events, by step), of one tensor, format and limit where given."""
    if events.empty:
        return events
    told = events[(events["kind"] == FORECAST_EVENT) & (events["lane"] == lane)]
    keep = [all(want is None or data.get(key) == want for key, want in
                (("tensor", tensor), ("format", format_name), ("limit", limit))) for data in told["data"]]
    return told[np.asarray(keep, dtype=bool)].sort_values("step", kind="stable") if len(told) else told


FORECAST_COLUMNS = ("step", "what failed", "forecast", "told at", "steps ahead", "predicted", "interval", "layer")


def was_it_forecast(steps: pd.DataFrame, events: pd.DataFrame, lane: int, limit_rows: int = 500) -> pd.DataFrame:
    """For each of the lane's failed steps (a non-finite loss, or a step the GradScaler skipped), whether a forecast
    was told before it (the first warning of the lane's latest forecast at that step) and how many steps ahead,
    its predicted step and interval, and its layer. A skip for a scaled gradient's overflow is the scaler's routine,
    which the forecaster leaves alone: it reads "no forecast" unless a layer's forecast was running."""
    if steps.empty:
        return pd.DataFrame(columns=list(FORECAST_COLUMNS))
    mine = steps[steps["lane"] == lane].sort_values("step")
    loss = mine["loss"].astype(float)
    skipped = mine["skipped"].fillna(False).astype(bool) if "skipped" in mine else pd.Series(False, index=mine.index)
    failed = mine[skipped | ~loss.map(math.isfinite)].head(limit_rows)
    told = told_for(events, lane)
    rows = []
    for step, value, skip in zip(failed["step"].astype(int), failed["loss"].astype(float),
                                 skipped[failed.index], strict=True):
        what = f"loss {value}" if not math.isfinite(value) else "skipped (gradients inf/NaN)" if skip else ""
        before = told[told["step"] < step] if not told.empty else told
        found = first_warning(list(zip(before["step"], before["data"], strict=True))) if not before.empty else None
        if found is None:
            rows.append((step, what, "no", None, None, None, "", ""))
            continue
        at, data = found
        lo, hi = data["lo_step"], data["hi_step"]
        timing = "yes, within its interval" if lo <= step <= hi else \
            f"yes, {lo - step} steps before its interval" if step < lo else f"yes, {step - hi} steps after its interval"
        what_layer = data["module"] if data["tensor"] == "output" else f"{data['module']} (gradient)"
        rows.append((step, what, timing, at, step - at, data["predicted_step"], f"{lo}–{hi}",
                     f"{what_layer} → {data['format']} {data['limit']}"))
    return pd.DataFrame(rows, columns=list(FORECAST_COLUMNS))


def fix_race_frame(race: FixRace) -> pd.DataFrame:
    """A fix race's lanes: recipe, what it changes, where it broke (or that it trained through), its last loss."""
    return pd.DataFrame([{"recipe": lane.recipe, "broke at": "—" if lane.broke_at is None else f"step {lane.broke_at}",
                          "trained": f"{lane.steps} steps", "skipped": lane.skipped,
                          "last finite loss": lane.last_loss if math.isfinite(lane.last_loss) else None,
                          "what it changes": lane.why or ("the lane as it is" if index == 0 else "the fp32 reference")}
                         for index, lane in enumerate(race.lanes)])
