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
from amp_core.views import summary
from amp_core.views.plots import (
    MAX_POINTS,
    chart_layout,
    decimate,
    decimate_indices,
    line_trace,
    marker_trace,
    mode_color,
)
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
def _y_axis(title: str, log: bool) -> dict:
    """A y axis, log or linear. A log axis labels its in-between ticks in full ("200", "500", "0.02"): plotly's
    default writes them as bare digits ("2, 5, 100, 2, 5"), which read as numbers of their own."""
    axis = {"title": {"text": title}, "type": "log" if log else "linear"}
    if log:
        axis.update(minorloglabels="complete", tickfont={"size": 13})  # plotly draws in-between labels at 3/4 size
    return axis


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
    layout = chart_layout(title, "loss", xaxis={"title": {"text": x_title}}, yaxis=_y_axis("loss", log_y),
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
    layout = {"title": {"text": "Step time per lane"}, "yaxis": _y_axis("ms per step", log_y),
              "showlegend": False, "margin": {"t": 50, "b": 40}}
    return go.Figure({"data": data, "layout": layout})


# --- lanes that hide each other -----------------------------------------------------------------------------------
OVERLAP_TOLERANCE = 0.01
"""Lanes whose losses stay within this relative difference at every common step cover each other on a loss chart."""
OUTLIER_IQRS = 5.0
"""The difference chart's bulk: points within this many interquartile ranges of the middle half (Tukey's fences,
widened)."""
SPIKE_SPAN = 100.0
"""The axis leaves the rest out only when they reach this many times farther than the bulk: spikes, not a lane
that drifts away or a long tail of early steps."""


def _every_record(records: pd.DataFrame | list[LaneSeries]) -> list[LaneSeries]:
    """Lanes holding every record: overlaps and differences compare losses step by step, not envelopes (a list of
    LaneSeries must have been read that way)."""
    return summary.lanes(records, max_points=max(len(records), 1)) if isinstance(records, pd.DataFrame) else records


def _aligned_losses(first: LaneSeries, second: LaneSeries) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(common steps, first's losses there, second's losses there)."""
    a, b = first["step"], second["step"]
    if len(a) == len(b) and np.array_equal(a, b):  # lanes of one run, or runs of one length: nothing to match
        return a, first["loss"], second["loss"]
    steps, i, j = np.intersect1d(a, b, assume_unique=True, return_indices=True)
    return steps, first["loss"][i], second["loss"][j]


def loss_overlaps(records: pd.DataFrame | list[LaneSeries], labels: dict[str, str] | None = None,
                  tolerance: float = OVERLAP_TOLERANCE) -> list[dict]:
    """Groups of lanes whose loss curves lie on top of each other: linked when, at every one of their common steps
    (at least two), their losses are equal bit for bit, or within `tolerance` of each other (relative; inf/NaN at
    the same steps). Per group: lanes (labels, in order), steps (fewest common steps of a linked pair), identical
    (every pair of the group equal bit for bit), same (its pairs that are, as label pairs) and max_rel_diff (the
    largest relative difference among its pairs)."""
    lanes = [((labels or {}).get(lane.key, lane.key), lane) for lane in _every_record(records)]
    parent = list(range(len(lanes)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    pairs = {}
    for a in range(len(lanes)):
        for b in range(a + 1, len(lanes)):
            steps, x, y = _aligned_losses(lanes[a][1], lanes[b][1])
            finite = np.isfinite(x) & np.isfinite(y)
            if len(steps) < 2 or not np.array_equal(np.isfinite(x), np.isfinite(y)) or not finite.any():
                continue
            identical = np.array_equal(x, y, equal_nan=True)
            x, y = x[finite], y[finite]
            rel = float(np.max(np.abs(x - y) / np.maximum(np.maximum(np.abs(x), np.abs(y)), 1e-12)))
            pairs[a, b] = (identical, rel, len(steps))
            if identical or rel <= tolerance:
                parent[root(b)] = root(a)
    members: dict[int, list[int]] = {}
    for i in range(len(lanes)):
        members.setdefault(root(i), []).append(i)
    out = []
    for group in (g for g in members.values() if len(g) > 1):
        linked = [pairs[a, b] for a in group for b in group if (a, b) in pairs]
        same = [(lanes[a][0], lanes[b][0]) for a in group for b in group if pairs.get((a, b), (False,))[0]]
        out.append({"lanes": [lanes[i][0] for i in group], "steps": min(n for _, _, n in linked),
                    "identical": len(same) == len(group) * (len(group) - 1) // 2, "same": same,
                    "max_rel_diff": max(rel for _, rel, _ in linked)})
    return out


def _names(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def overlap_notes(frame: pd.DataFrame, labels: dict[str, str] | None = None) -> list[str]:
    """One sentence per group of `loss_overlaps`, saying which lines hide which, and by how much they differ."""
    notes = []
    for group in loss_overlaps(frame, labels):
        names = _names(group["lanes"])
        if group["identical"]:
            notes.append(f"{names} recorded the same loss, bit for bit, at every one of their {group['steps']:,} "
                         "common steps: their lines lie exactly on top of each other (the last drawn hides the rest).")
        else:
            same = "".join(f" {a} and {b} recorded the same loss, bit for bit." for a, b in group["same"])
            notes.append(f"{names} stay within {group['max_rel_diff']:.2%} of each other at every common step: at "
                         f"this scale their lines cover each other.{same} The chart *Loss minus the baseline's* tells "
                         "them apart.")
    return notes


def loss_difference_figure(records: pd.DataFrame | list[LaneSeries], baseline: str,
                           labels: dict[str, str] | None = None, max_points: int = MAX_POINTS) -> go.Figure:
    """Each lane's loss minus the baseline lane's at the same step (common steps only), so lanes whose loss curves
    cover each other come apart. Points far beyond the bulk (a loss spike in one lane) would flatten the rest: when
    the points within OUTLIER_IQRS interquartile ranges of the middle half span less than 1/SPIKE_SPAN of all, the
    axis spans them (and 0) and the others sit on its edge as ▲/▼, their true difference in the hover."""
    labels = labels or {}
    lanes = {lane.key: lane for lane in _every_record(records)}
    title = f"Loss minus the baseline's ({labels.get(baseline, baseline)}), step by step"
    if baseline not in lanes:
        raise ValueError(f"baseline lane {baseline!r} has no records here")
    dashes = {run_id: RUN_DASHES[i % len(RUN_DASHES)]
              for i, run_id in enumerate(dict.fromkeys(lane.run_id for lane in lanes.values()))}
    curves = []
    for key, lane in lanes.items():
        if key == baseline:
            continue
        steps, loss, base_loss = _aligned_losses(lane, lanes[baseline])
        with np.errstate(invalid="ignore"):  # two diverged lanes: inf - inf is NaN, and drawn as a gap
            curves.append((key, labels.get(key, key), lane.mode, lane.run_id, steps, loss - base_loss))
    finite = np.concatenate([d[np.isfinite(d)] for *_, d in curves] or [np.array([])])
    axis = {"title": {"text": "loss − baseline loss"}, "zeroline": True}
    low = high = None
    if finite.size >= 8:
        q1, q3 = np.quantile(finite, [0.25, 0.75])
        reach = OUTLIER_IQRS * (q3 - q1)
        inside = finite[(finite >= q1 - reach) & (finite <= q3 + reach)]
        bottom, top = min(float(inside.min()), 0.0), max(float(inside.max()), 0.0)
        if reach > 0 and finite.max() - finite.min() > SPIKE_SPAN * (top - bottom):
            low, high = bottom - 0.1 * (top - bottom), top + 0.1 * (top - bottom)
            axis["range"] = [low, high]
    data = []
    for key, label, mode, run_id, steps, difference in curves:
        idx = decimate_indices(difference, max_points)
        data.append(line_trace(
            mode, steps[idx], difference[idx], name=label, legendgroup=key,
            line={"color": mode_color(mode), "dash": dashes[run_id], "width": 2},
            hovertemplate=f"{label}<br>step %{{x}}<br>loss − baseline %{{y:.4g}}<extra></extra>"))
        if low is None:
            continue
        edges = ((difference > high, high, "triangle-up"), (difference < low, low, "triangle-down"))
        for beyond, edge, symbol in edges:
            if beyond.any():
                data.append(marker_trace(
                    mode, steps[beyond], np.full(int(beyond.sum()), edge), f"{label}: beyond the axis",
                    symbol=symbol, legendgroup=key, showlegend=False, customdata=difference[beyond],
                    hovertemplate=f"{label}<br>step %{{x}}<br>loss − baseline %{{customdata:.4g}} (beyond the axis)"
                                  "<extra></extra>"))
    if low is not None:
        title += " · ▲▼ beyond the axis"
    layout = chart_layout(title, "loss − baseline loss", yaxis=axis, hovermode="closest",
                          legend={"title": {"text": "lane (colour: mode, dash: run)"}}, margin={"t": 50, "b": 40},
                          height=None)
    return go.Figure({"data": data, "layout": layout})


# --- tables and downloads -----------------------------------------------------------------------------------------
def _number(value: float, spec: str, suffix: str = "") -> str:
    return "—" if value is None or pd.isna(value) else f"{value:{spec}}{suffix}"


def format_summary(summary: pd.DataFrame, labels: dict[str, str] | None = None, baseline: str | None = None,
                   last_k: int = 20) -> pd.DataFrame:
    """`amp_core.summary.summarize` output as the table a person reads: speedup "1.23×", memory in MiB, ratios,
    the latest loss (what the Train page shows), the final loss named by its window ("final loss (mean of last 20)",
    the figure `last_k` gave summarize) and its signed delta to the baseline; the baseline lane marked ★."""
    labels = labels or {}
    keys = [lane_key(r, int(n)) for r, n in zip(summary["run_id"], summary["lane"], strict=True)]
    final = final_loss_column(last_k)
    columns = {
        "lane": [("★ " if key == baseline else "") + labels.get(key, key) for key in keys],
        "mode": summary["mode"].tolist(),
        "steps": summary["steps"].astype(int).tolist(),
        "median ms/step": [_number(v, ".3g") for v in summary["median_ms"]],
        "speedup": [_number(v, ".2f", "×") for v in summary["speedup"]],
        "peak memory": [_number(v, ".3g", " MiB") for v in summary["peak_mib"]],
        "memory ratio": [_number(v, ".2f", "×") for v in summary["mem_ratio"]],
        "latest loss": [_number(v, ".4g") for v in summary["latest_loss"]],
        final: [_number(v, ".4g") for v in summary["final_loss"]],
        "final loss Δ": [_number(v, "+.3g") for v in summary["loss_delta"]],
        "skipped steps": summary["skipped_steps"].astype(int).tolist(),
        "diverged": ["💥 yes" if v else "no" for v in summary["diverged"]],
    }
    return pd.DataFrame(columns, columns=list(columns))


def final_loss_column(last_k: int) -> str:
    """The summary table's name for the final loss: it says which steps it averages, so it is never taken for the
    latest loss."""
    return f"final loss (mean of last {last_k})"


def csv_bytes(frame: pd.DataFrame) -> bytes:
    return frame.to_csv(index=False).encode()


def parquet_bytes(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def figure_html(fig: go.Figure) -> bytes:
    """A standalone HTML page of `fig` with plotly.js inlined (opens offline, about 4.5 MB)."""
    return fig.to_html(include_plotlyjs=True, full_html=True).encode()

