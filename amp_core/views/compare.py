"""Compare lanes across runs (pure pandas/plotly): pick lanes, gather their records, chart them, export them.

A lane is named by its key "run_id/lane" (`amp_core.summary.lane_key`). Colour says the mode (the same as on
every page); dash style says the run, so two 16-mixed lanes from two runs stay apart.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.records import STEP_FIELDS, empty_steps_frame
from amp_core.records.query import LaneSeries
from amp_core.records.schema import steps_frame
from amp_core.records.store import LIVE_STATUSES
from amp_core.views.plots import MAX_POINTS, chart_layout, decimate, line_trace, marker_trace, mode_color
from amp_core.views.summary import lane_key

if TYPE_CHECKING:
    from amp_core.runner import RunManager

RUN_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
"""Dash style of the i-th run in a comparison (cycled past six runs)."""
DIST_POINTS = 2001
"""Step times drawn per lane in the box/violin; longer lanes are drawn as this many evenly spaced quantiles."""
DIST_KINDS = ("box", "violin")
TIME_AXES = {"compute": "time in the lane's own steps (Σ step time, s)",
             "wall": "wall clock since the lane's first step (s)"}
LANE_TABLE_COLUMNS = ("key", "run_id", "lane", "mode", "status", "live", "label")
FLOAT_STEP_COLUMNS = ("t_wall_s", "loss", "step_ms", "samples_per_s", "lr", "scale", "grad_norm", "probe_ms")
BYTE_STEP_COLUMNS = ("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes", "peak_above_start_bytes",
                     "lane_peak_bytes")


# --- choosing lanes -----------------------------------------------------------------------------------------------
def short_run_id(run_id: str) -> str:
    """The random tail of a run id ("20250101-120000-a1b2c3" -> "a1b2c3"): enough to tell runs apart on a chart."""
    tail = run_id.rsplit("-", 1)[-1]
    return tail if tail else run_id[-6:]


def split_lane_key(key: str) -> tuple[str, int]:
    """"run_id/lane" -> (run_id, lane); ValueError for anything else."""
    run_id, sep, lane = key.rpartition("/")
    if not sep or not run_id or not lane.isdigit():
        raise ValueError(f"a lane key is 'run_id/lane', got {key!r}")
    return run_id, int(lane)


def _run_lanes(manager: RunManager, run_id: str) -> tuple[list[dict], bool] | None:
    """[{lane, mode, status}] of a run and whether it is held live here; None if unknown. Cheaper than
    `RunManager.run_info` for a stored run (which counts every step record)."""
    run = manager.get(run_id)
    if run is not None:
        return [{"lane": lane.index, "mode": lane.mode, "status": lane.status} for lane in run.lanes], run.alive
    row = manager.store.run(run_id) if manager.store is not None else None
    return (row["lanes"], False) if row is not None else None


def lane_table(manager: RunManager, run_ids: Iterable[str]) -> pd.DataFrame:
    """The lanes of `run_ids` (live or stored), in run then lane order: key, run_id, lane, mode, status, live,
    label ("mode · short id"). Runs the manager does not know are left out."""
    rows = []
    for run_id in dict.fromkeys(run_ids):
        found = _run_lanes(manager, run_id)
        if found is None:
            continue
        lanes, live = found
        rows.extend({"key": lane_key(run_id, int(lane["lane"])), "run_id": run_id, "lane": int(lane["lane"]),
                     "mode": lane["mode"], "status": lane["status"], "live": live,
                     "label": f"{lane['mode']} · {short_run_id(run_id)}"} for lane in lanes)
    table = pd.DataFrame(rows, columns=list(LANE_TABLE_COLUMNS))
    # Two runs whose ids end alike (or a foreign run id) must still give distinct labels.
    repeated = table["label"].duplicated(keep=False)
    table.loc[repeated, "label"] = table.loc[repeated, "mode"] + " · " + table.loc[repeated, "key"]
    return table


def live_run_ids(manager: RunManager, run_ids: Iterable[str]) -> list[str]:
    """Those of `run_ids` whose records still grow: a run this manager holds whose thread is alive, or a run that
    another process (the CLI) is writing to the store (its stored status is still pending/running/paused)."""
    def growing(run_id: str) -> bool:
        run = manager.get(run_id)
        if run is not None:
            return run.alive
        row = manager.store.run(run_id) if manager.store is not None else None
        return row is not None and row["status"] in LIVE_STATUSES

    return [run_id for run_id in run_ids if growing(run_id)]


def _wanted(lane_keys: Sequence[str]) -> dict[str, list[int]]:
    wanted: dict[str, list[int]] = {}
    for key in lane_keys:
        run_id, lane = split_lane_key(key)
        wanted.setdefault(run_id, []).append(lane)
    return wanted


def gather_steps(manager: RunManager, lane_keys: Sequence[str]) -> pd.DataFrame:
    """Every step record of the chosen lanes (for downloads and tables that need them all), read column by column
    through the manager (memory for runs it holds, else the store's chunks of just those lanes); lanes in the order
    given, each ordered by step. The same dtypes whatever the source: floats (None -> NaN), byte counts as nullable
    integers (None -> <NA>), `skipped` as bool."""
    parts = []
    for run_id, lanes in _wanted(lane_keys).items():
        sources = manager.track_sources(run_id)
        for lane in lanes:
            parts += [(run_id, s.lane, s.mode, s.rank, s.raw_rows(0, np.iinfo(np.int64).max))
                      for s in sources if s.lane == lane]
    parts = [part for part in parts if len(part[-1]["step"])]
    frame = steps_frame(parts) if parts else empty_steps_frame()
    for column in FLOAT_STEP_COLUMNS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype(float)
    for column in BYTE_STEP_COLUMNS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce").round().astype("Int64")
    frame["lane"] = frame["lane"].astype(int)
    frame["step"] = frame["step"].astype(int)
    frame["skipped"] = frame["skipped"].astype(bool)
    return frame[list(STEP_FIELDS)]


def gather_lanes(manager: RunManager, lane_keys: Sequence[str], max_points: int = MAX_POINTS) -> list[LaneSeries]:
    """The chosen lanes read for charts and the summary table (in the order given): exact totals, and an exact
    envelope of about `max_points` points per figure, so a comparison of long runs reads a few thousand points."""
    found: dict[str, list[LaneSeries]] = {}
    for run_id, lanes in _wanted(lane_keys).items():
        chosen = [s for s in manager.track_sources(run_id) if s.lane in lanes]
        for series in manager.lane_series(run_id, max_points=max_points, sources=chosen):
            found.setdefault(series.key, []).append(series)
    return [series for key in dict.fromkeys(lane_keys) for series in found.get(key, [])]


def frame_lane_keys(frame: pd.DataFrame) -> list[str]:
    """Lane keys present in a records frame, in order of first appearance."""
    pairs = frame[["run_id", "lane"]].drop_duplicates()
    return [lane_key(run_id, int(lane)) for run_id, lane in pairs.itertuples(index=False)]


def add_time_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` (lanes in order of first appearance, each then ordered by step) plus, per lane, `compute_s` (running
    sum of its step times) and `elapsed_s` (wall clock since its first step began: its end minus its duration)."""
    if frame.empty:
        return frame.assign(compute_s=pd.Series(dtype=float), elapsed_s=pd.Series(dtype=float))
    order = {key: i for i, key in enumerate(frame_lane_keys(frame))}
    lane_order = [order[lane_key(r, int(n))] for r, n in zip(frame["run_id"], frame["lane"], strict=True)]
    frame = frame.assign(_order=lane_order).sort_values(["_order", "step"], kind="stable").drop(columns="_order")
    groups = frame.groupby(["run_id", "lane"], sort=False)
    start = groups["t_wall_s"].transform("first") - groups["step_ms"].transform("first") / 1e3
    return frame.assign(compute_s=groups["step_ms"].cumsum() / 1e3, elapsed_s=frame["t_wall_s"] - start)


# --- figures ------------------------------------------------------------------------------------------------------
def run_dashes(frame: pd.DataFrame) -> dict[str, str]:
    """run_id -> dash style, by order of first appearance."""
    return {run_id: RUN_DASHES[i % len(RUN_DASHES)] for i, run_id in enumerate(frame["run_id"].drop_duplicates())}


def _lane_groups(frame: pd.DataFrame, labels: dict[str, str]):
    """(key, label, mode, run_id, rows ordered by step) per lane, in order of first appearance."""
    for (run_id, lane), group in frame.groupby(["run_id", "lane"], sort=False):
        key = lane_key(run_id, int(lane))
        yield key, labels.get(key, key), group["mode"].iloc[0], run_id, group.sort_values("step")


def _loss_figure(frame: pd.DataFrame, labels: dict[str, str], x: str, x_title: str, title: str, log_y: bool,
                 max_points: int) -> go.Figure:
    data = []
    dashes = run_dashes(frame) if not frame.empty else {}
    for key, label, mode, run_id, group in _lane_groups(frame, labels):
        drawn = decimate(group, "loss", max_points, keep="skipped")
        at_x = "" if x == "step" else f"<br>{x_title}: %{{x:.4g}}"
        data.append(line_trace(
            mode, drawn[x].to_numpy(), drawn["loss"].to_numpy(), name=label, legendgroup=key,
            line={"color": mode_color(mode), "dash": dashes[run_id], "width": 2}, customdata=drawn["step"].to_numpy(),
            hovertemplate=f"{label}<br>step %{{customdata}}{at_x}<br>loss %{{y:.5g}}<extra></extra>"))
        skipped = drawn[drawn["skipped"]]
        if not skipped.empty:
            data.append(marker_trace(
                mode, skipped[x].to_numpy(), skipped["loss"].to_numpy(), f"{label}: skipped steps", legendgroup=key,
                showlegend=False, customdata=skipped["step"].to_numpy(),
                hovertemplate=f"{label}<br>step %{{customdata}} skipped<br>loss %{{y:.5g}}<extra></extra>"))
    layout = chart_layout(title, "loss", xaxis={"title": {"text": x_title}},
                          yaxis={"title": {"text": "loss"}, "type": "log" if log_y else "linear"},
                          hovermode="closest", legend={"title": {"text": "lane (colour: mode, dash: run)"}},
                          margin={"t": 50, "b": 40}, height=None)
    return go.Figure({"data": data, "layout": layout})


def loss_vs_step_figure(frame: pd.DataFrame, labels: dict[str, str] | None = None, log_y: bool = False,
                        max_points: int = MAX_POINTS) -> go.Figure:
    """Loss against step, one line per lane (colour: mode, dash: run); skipped steps marked ×; long lanes
    decimated (spikes, non-finite losses and skipped steps kept)."""
    return _loss_figure(frame, labels or {}, "step", "step", "Loss vs step", log_y, max_points)


def loss_vs_time_figure(frame: pd.DataFrame, labels: dict[str, str] | None = None, time_axis: str = "compute",
                        log_y: bool = False, max_points: int = MAX_POINTS) -> go.Figure:
    """Loss against time. `time_axis` "compute": the lane's own step times summed (what the mode would take on
    its own: lanes of one run take turns, so their wall clocks advance together); "wall": wall clock since the
    lane's first step (includes the other lanes' turns and pauses)."""
    if time_axis not in TIME_AXES:
        raise ValueError(f"time_axis must be one of {', '.join(TIME_AXES)}, got {time_axis!r}")
    column = "compute_s" if time_axis == "compute" else "elapsed_s"
    return _loss_figure(add_time_columns(frame), labels or {}, column, TIME_AXES[time_axis], "Loss vs time", log_y,
                        max_points)


def distribution_sample(values: np.ndarray, max_points: int = DIST_POINTS) -> np.ndarray:
    """The finite `values` as they are if there are at most `max_points`, else `max_points` evenly spaced quantiles
    of them: a bounded payload with the same min, max and (for an odd `max_points`) median, and the same shape."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size <= max_points:
        return values
    return np.quantile(values, np.linspace(0.0, 1.0, max_points))


def step_time_spread_figure(frame: pd.DataFrame, labels: dict[str, str] | None = None, kind: str = "box",
                            log_y: bool = False, max_points: int = DIST_POINTS) -> go.Figure:
    """Spread of step time (ms) per lane as a box or violin, coloured by mode (mean marked); long lanes are drawn
    from `distribution_sample`. `log_y` keeps a slow first step (warm-up) from flattening the boxes."""
    if kind not in DIST_KINDS:
        raise ValueError(f"kind must be one of {', '.join(DIST_KINDS)}, got {kind!r}")
    data = []
    for key, label, mode, _, group in _lane_groups(frame, labels or {}):
        values = distribution_sample(group["step_ms"].to_numpy(dtype=float), max_points)
        trace = {"type": kind, "y": values, "name": label, "legendgroup": key, "marker": {"color": mode_color(mode)},
                 "line": {"color": mode_color(mode)}, "hoverinfo": "y+name", "quartilemethod": "linear"}
        if kind == "box":
            trace.update(boxpoints="outliers", boxmean=True)
        else:
            trace.update(points=False, box={"visible": True}, meanline={"visible": True}, spanmode="hard")
        data.append(trace)
    layout = {"title": {"text": "Step time per lane"}, "yaxis": {"title": {"text": "ms per step"},
                                                                 "type": "log" if log_y else "linear"},
              "showlegend": False, "margin": {"t": 50, "b": 40}}
    return go.Figure({"data": data, "layout": layout})


# --- tables and downloads -----------------------------------------------------------------------------------------
def _number(value: float, spec: str, suffix: str = "") -> str:
    return "—" if value is None or pd.isna(value) else f"{value:{spec}}{suffix}"


def format_summary(summary: pd.DataFrame, labels: dict[str, str] | None = None,
                   baseline: str | None = None) -> pd.DataFrame:
    """`amp_core.summary.summarize` output as the table a person reads: speedup "1.23×", memory in MiB, ratios,
    signed loss deltas; the baseline lane marked ★."""
    labels = labels or {}
    keys = [lane_key(r, int(n)) for r, n in zip(summary["run_id"], summary["lane"], strict=True)]
    return pd.DataFrame({
        "lane": [("★ " if key == baseline else "") + labels.get(key, key) for key in keys],
        "mode": summary["mode"].tolist(),
        "steps": summary["steps"].astype(int).tolist(),
        "median ms/step": [_number(v, ".3g") for v in summary["median_ms"]],
        "speedup": [_number(v, ".2f", "×") for v in summary["speedup"]],
        "peak memory": [_number(v, ".3g", " MiB") for v in summary["peak_mib"]],
        "memory ratio": [_number(v, ".2f", "×") for v in summary["mem_ratio"]],
        "final loss": [_number(v, ".4g") for v in summary["final_loss"]],
        "loss Δ": [_number(v, "+.3g") for v in summary["loss_delta"]],
        "skipped steps": summary["skipped_steps"].astype(int).tolist(),
        "diverged": ["💥 yes" if v else "no" for v in summary["diverged"]],
    }, columns=["lane", "mode", "steps", "median ms/step", "speedup", "peak memory", "memory ratio", "final loss",
                "loss Δ", "skipped steps", "diverged"])


def csv_bytes(frame: pd.DataFrame) -> bytes:
    return frame.to_csv(index=False).encode()


def parquet_bytes(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def figure_html(fig: go.Figure) -> bytes:
    """A standalone HTML page of `fig` with plotly.js inlined (opens offline, about 4.5 MB)."""
    return fig.to_html(include_plotlyjs=True, full_html=True).encode()

