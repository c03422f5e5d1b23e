"""Compare lanes across runs (pure pandas/plotly): pick lanes, gather their records, chart them, export them.

A lane is named by its key "run_id/lane" (`amp_core.summary.lane_key`). Colour says the mode (the same as on
every page); dash style says the run, so two 16-mixed lanes from two runs stay apart. The lanes of one mode of a run
with several seeds per mode (RunConfig.seeds) are drawn together: their mean across seeds inside a min-max band.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.config import FINAL_LOSS_WINDOW
from amp_core.records import STEP_FIELDS, empty_steps_frame
from amp_core.records.query import LaneSeries
from amp_core.records.schema import steps_frame
from amp_core.runs import is_live
from amp_core.views import summary
from amp_core.views.plots import (
    MAX_POINTS,
    StepTimeBands,
    band_traces,
    bulk_range,
    chart_figure,
    chart_layout,
    decimate_indices,
    edge_markers,
    line_trace,
    log_axis,
    marker_trace,
    mode_color,
    seed_band_traces,
)
from amp_core.views.summary import group_key, lane_key, seed_groups, seed_spread

if TYPE_CHECKING:
    from amp_core.runs import LaneInfo, RunReader

RUN_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
"""Dash style of the i-th run in a comparison (cycled past six runs)."""
TIME_AXES = {"compute": "time at the lane's median speed (Σ median step time, s)",
             "wall": "wall clock since the lane's first step (s)"}
LANE_TABLE_COLUMNS = ("key", "run_id", "lane", "mode", "seed", "status", "live", "label")
FLOAT_STEP_COLUMNS = ("t_wall_s", "loss", "step_ms", "samples_per_s", "lr", "scale", "grad_norm", "probe_ms")
BYTE_STEP_COLUMNS = ("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes", "peak_above_start_bytes",
                     "lane_peak_bytes")


# --- choosing lanes -----------------------------------------------------------------------------------------------
def short_run_id(run_id: str) -> str:
    """The last 6 hex digits of a run id's random tail ("20250101-120000-9f8e7da1b2c3" -> "a1b2c3"): enough to tell
    runs apart on a chart (the tail's 48 random bits keep ids from colliding across hosts; 24 tell runs apart)."""
    return run_id.rsplit("-", 1)[-1][-6:] or run_id[-6:]


def split_lane_key(key: str) -> tuple[str, int]:
    """"run_id/lane" -> (run_id, lane); ValueError for anything else."""
    run_id, sep, lane = key.rpartition("/")
    if not sep or not run_id or not lane.isdigit():
        raise ValueError(f"a lane key is 'run_id/lane', got {key!r}")
    return run_id, int(lane)


def _run_lanes(reader: RunReader, run_id: str) -> tuple[list[LaneInfo], bool] | None:
    """The lanes of a run and whether it is live; None if unknown. (Its steps are not counted: cheaper.)"""
    info = reader.run_info(run_id, count_steps=False)
    return (list(info.lanes), is_live(info)) if info is not None else None


def lane_name(lane: LaneInfo, replicated: bool = False) -> str:
    """A stored lane (run info's) by its recipe in full, with the FSDP2 policy it trained under where it was sharded
    ("bf16-mixed · FSDP2 param bf16 · reduce fp32"), and its seed in a run of several seeds per mode (`replicated`)."""
    meta = lane.meta
    policy = f" · {meta['policy']}" if meta.get("policy") else ""
    seed = f" · seed {meta['seed']}" if replicated and meta.get("seed") is not None else ""
    return f"{lane.mode}{policy}{seed}"


def lane_table(reader: RunReader, run_ids: Iterable[str]) -> pd.DataFrame:
    """The lanes of `run_ids` (live or stored), in run then lane order: key, run_id, lane, mode, seed (None where the
    run did not record one), status, live, label ("mode · short id", "mode · seed N · short id" in a run with several
    seeds per mode, the FSDP2 policy after the mode: `lane_name`). Runs the reader does not know are left out."""
    rows = []
    for run_id in dict.fromkeys(run_ids):
        found = _run_lanes(reader, run_id)
        if found is None:
            continue
        lanes, live = found
        replicated = len({lane.mode for lane in lanes}) < len(lanes)
        rows.extend({"key": lane_key(run_id, lane.lane), "run_id": run_id, "lane": lane.lane, "mode": lane.mode,
                     "seed": lane.meta.get("seed"), "status": lane.status, "live": live,
                     "label": f"{lane_name(lane, replicated)} · {short_run_id(run_id)}"} for lane in lanes)
    table = pd.DataFrame(rows, columns=list(LANE_TABLE_COLUMNS))
    # Two runs whose ids end alike (or a foreign run id) must still give distinct labels.
    repeated = table["label"].duplicated(keep=False)
    table.loc[repeated, "label"] = table.loc[repeated, "mode"] + " · " + table.loc[repeated, "key"]
    return table


def table_seeds(table: pd.DataFrame) -> dict[str, int]:
    """Lane key -> seed of a `lane_table`'s lanes that recorded one (what the charts group seed replicates by)."""
    known = table[table["seed"].notna()]
    return {key: int(seed) for key, seed in zip(known["key"], known["seed"], strict=True)}


def group_label(run_id: str, mode: str, seeds: int) -> str:
    """The legend name of a mode's seed replicates: "mode · short id · mean of S seeds"."""
    return f"{mode} · {short_run_id(run_id)} · mean of {seeds} seeds"


def live_run_ids(reader: RunReader, run_ids: Iterable[str]) -> list[str]:
    """Those of `run_ids` whose records still grow (`is_live`): a run this process trains, or a run that another
    process (the CLI, a Monitor) is writing to the store."""
    return [run_id for run_id in run_ids if is_live(reader.run_info(run_id))]


def _wanted(lane_keys: Sequence[str]) -> dict[str, list[int]]:
    wanted: dict[str, list[int]] = {}
    for key in lane_keys:
        run_id, lane = split_lane_key(key)
        wanted.setdefault(run_id, []).append(lane)
    return wanted


def gather_steps(reader: RunReader, lane_keys: Sequence[str]) -> pd.DataFrame:
    """Every step record of the chosen lanes (for downloads and tables that need them all), read column by column
    through the reader (memory for runs it holds, else the store's chunks of just those lanes); lanes in the order
    given, each ordered by step. The same dtypes whatever the source: floats (None -> NaN), byte counts as nullable
    integers (None -> <NA>), `skipped` as bool."""
    parts = []
    for run_id, lanes in _wanted(lane_keys).items():
        sources = reader.track_sources(run_id)
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


def gather_lanes(reader: RunReader, lane_keys: Sequence[str], max_points: int = MAX_POINTS) -> list[LaneSeries]:
    """The chosen lanes read for charts and the summary table (in the order given): exact totals, and an exact
    envelope of about `max_points` points per figure, so a comparison of long runs reads a few thousand points."""
    found: dict[str, list[LaneSeries]] = {}
    for run_id, lanes in _wanted(lane_keys).items():
        chosen = [s for s in reader.track_sources(run_id) if s.lane in lanes]
        for series in reader.lane_series(run_id, max_points=max_points, sources=chosen):
            found.setdefault(series.key, []).append(series)
    return [series for key in dict.fromkeys(lane_keys) for series in found.get(key, [])]


def frame_lane_keys(frame: pd.DataFrame) -> list[str]:
    """Lane keys present in a records frame, in order of first appearance."""
    pairs = frame[["run_id", "lane"]].drop_duplicates()
    return [lane_key(run_id, int(lane)) for run_id, lane in pairs.itertuples(index=False)]


def lane_keys(lanes: list[LaneSeries]) -> list[str]:
    """The lanes' keys, in order, each once (a lane's ranks share its key)."""
    return list(dict.fromkeys(lane.key for lane in lanes))


# --- figures ------------------------------------------------------------------------------------------------------
def _y_axis(title: str, log: bool) -> dict:
    """A y axis, log or linear. A log axis labels its in-between ticks in full ("200", "500", "0.02"): plotly's
    default writes them as bare digits ("2, 5, 100, 2, 5"), which read as numbers of their own."""
    return log_axis(title) if log else {"title": {"text": title}, "type": "linear"}


def run_dashes(lanes: list[LaneSeries]) -> dict[str, str]:
    """run_id -> dash style, by order of first appearance."""
    return {run_id: RUN_DASHES[i % len(RUN_DASHES)] for i, run_id in enumerate(dict.fromkeys(s.run_id for s in lanes))}


def _wall_start(lane: LaneSeries) -> float:
    """When the lane's first step began (its end minus its duration), from its first record."""
    first = lane.source.raw_rows(lane.stats.first_step, lane.stats.first_step + 1, ["t_wall_s", "step_ms"])
    return float(first["t_wall_s"][0] - first["step_ms"][0] / 1e3) if len(first["step"]) else math.nan


def _time_of(lane: LaneSeries, time_axis: str, bands: StepTimeBands, steps: np.ndarray) -> np.ndarray:
    """The x of `steps` on a time axis (TIME_AXES)."""
    if time_axis == "compute":
        known_steps, seconds = bands.median_time_s(lane)
    else:
        known_steps, seconds = lane.points("t_wall_s")
        seconds = seconds - _wall_start(lane)
    return np.interp(steps, known_steps, seconds) if len(known_steps) else np.full(len(steps), np.nan)


def _seed_loss_traces(members: list[LaneSeries], labels: dict[str, str], time_axis: str | None, dash: str,
                      bands: StepTimeBands) -> list[dict]:
    """One mode's seed replicates on a loss chart: the mean loss across seeds inside their min-max band (on a time
    axis at the seeds' mean time of each step), and each seed's skipped steps."""
    first = members[0]
    name = labels.get(group_key(first.run_id, first.mode), group_label(first.run_id, first.mode, len(members)))
    curves = [lane.means("loss")[:2] for lane in members]
    steps, low, mean, high = seed_spread(curves)
    at = ""
    x = steps
    if time_axis is not None:
        _, _, x, _ = seed_spread([(s, _time_of(lane, time_axis, bands, s)) for lane, (s, _) in zip(members, curves,
                                                                                                    strict=True)])
        at = f"<br>{TIME_AXES[time_axis]}: %{{x:.4g}}"
    data = seed_band_traces(first.mode, x, low, mean, high, len(members), name=name, dash=dash, customdata=steps,
                            hover=f"{name}<br>step %{{customdata}}{at}<br>loss")
    for lane in members:
        skipped, at_skips = lane.skipped()
        if len(skipped):
            label = labels.get(lane.key, lane.key)
            data.append(marker_trace(
                lane.mode, skipped if time_axis is None else _time_of(lane, time_axis, bands, skipped),
                np.asarray(at_skips["loss"], dtype=float), f"{label}: skipped steps", legendgroup=name,
                showlegend=False, customdata=at_skips["step"],
                hovertemplate=f"{label}<br>step %{{customdata}} skipped<br>loss %{{y:.5g}}<extra></extra>"))
    return data


def _loss_figure(lanes: list[LaneSeries], labels: dict[str, str], time_axis: str | None, title: str, log_y: bool,
                 bands: StepTimeBands | None, seeds: dict[str, int] | None = None) -> go.Figure:
    data = []
    dashes = run_dashes(lanes)
    bands = bands or StepTimeBands()
    replicates = [[ranks[0] for ranks in group] for group in seed_groups(lanes, seeds).values() if len(group) > 1]
    for members in replicates:
        data += _seed_loss_traces(members, labels, time_axis, dashes[members[0].run_id], bands)
    grouped = {lane.key for members in replicates for lane in members}
    for lane in (lane for lane in lanes if lane.key not in grouped):
        label = labels.get(lane.key, lane.key)
        steps, loss = lane.points("loss")
        skipped, at_skips = lane.skipped()
        if time_axis is None:
            x, at = steps, ""
        else:
            x = _time_of(lane, time_axis, bands, steps)
            skipped = _time_of(lane, time_axis, bands, skipped)
            at = f"<br>{TIME_AXES[time_axis]}: %{{x:.4g}}"
        data.append(line_trace(
            lane.mode, x, loss, name=label, legendgroup=lane.key,
            line={"color": mode_color(lane.mode), "dash": dashes[lane.run_id], "width": 2}, customdata=steps,
            hovertemplate=f"{label}<br>step %{{customdata}}{at}<br>loss %{{y:.5g}}<extra></extra>"))
        if len(skipped):
            data.append(marker_trace(
                lane.mode, skipped, np.asarray(at_skips["loss"], dtype=float), f"{label}: skipped steps",
                legendgroup=lane.key, showlegend=False, customdata=at_skips["step"],
                hovertemplate=f"{label}<br>step %{{customdata}} skipped<br>loss %{{y:.5g}}<extra></extra>"))
    x_title = "step" if time_axis is None else TIME_AXES[time_axis]
    layout = chart_layout(title, "loss", xaxis={"title": {"text": x_title}}, yaxis=_y_axis("loss", log_y),
                          hovermode="closest", legend={"title": {"text": "lane (colour: mode, dash: run)"}},
                          margin={"t": 50, "b": 40}, height=None)
    return chart_figure({"data": data, "layout": layout})


def loss_vs_step_figure(records: pd.DataFrame | list[LaneSeries], labels: dict[str, str] | None = None,
                        log_y: bool = False, max_points: int = MAX_POINTS,
                        seeds: dict[str, int] | None = None) -> go.Figure:
    """Loss against step, one line per lane (colour: mode, dash: run); skipped steps marked ×; long lanes drawn as
    their exact min/max envelope (spikes, non-finite losses and skipped steps kept). A mode with several seed
    replicates (`seeds`: lane key -> seed) is one line, its mean loss across seeds, inside their min-max band."""
    return _loss_figure(summary.lanes(records, max_points), labels or {}, None, "Loss vs step", log_y, None, seeds)


def loss_vs_time_figure(records: pd.DataFrame | list[LaneSeries], labels: dict[str, str] | None = None,
                        time_axis: str = "compute", log_y: bool = False, max_points: int = MAX_POINTS,
                        bands: StepTimeBands | None = None, seeds: dict[str, int] | None = None) -> go.Figure:
    """Loss against time. `time_axis` "compute": the running sum of the lane's median step time (StepTimeBands) —
    what the mode would take on its own at its typical speed (lanes of one run take turns, so their wall clocks
    advance together; a stall adds its step's median, not its own length); "wall": wall clock since the lane's
    first step (includes the other lanes' turns, stalls and pauses). Seed replicates (`seeds`) as in
    `loss_vs_step_figure`, each step at the seeds' mean time."""
    if time_axis not in TIME_AXES:
        raise ValueError(f"time_axis must be one of {', '.join(TIME_AXES)}, got {time_axis!r}")
    return _loss_figure(summary.lanes(records, max_points), labels or {}, time_axis, "Loss vs time", log_y, bands,
                        seeds)


def step_time_figure(records: pd.DataFrame | list[LaneSeries], labels: dict[str, str] | None = None,
                     raw: bool = False, log_y: bool = False, max_points: int = MAX_POINTS,
                     bands: StepTimeBands | None = None, seeds: dict[str, int] | None = None) -> go.Figure:
    """Step time per lane: its rolling median and p10-p90 band (StepTimeBands: robust to one-off stalls), coloured
    by mode, dashed by run; `raw` adds each measured step time (their envelope on a long lane), faint. A mode with
    several seed replicates (`seeds`) is the mean of its seeds' median lines inside the min-max band of those."""
    lanes = summary.lanes(records, max_points)
    labels, dashes, bands = labels or {}, run_dashes(lanes), bands or StepTimeBands()
    data = []
    replicates = [[ranks[0] for ranks in group] for group in seed_groups(lanes, seeds).values() if len(group) > 1]
    for members in replicates:
        first = members[0]
        name = labels.get(group_key(first.run_id, first.mode), group_label(first.run_id, first.mode, len(members)))
        medians = [(band["step"], band["p50"]) for band in (bands.band(lane) for lane in members)]
        data += seed_band_traces(first.mode, *seed_spread(medians), len(members), name=name, unit=" ms",
                                 dash=dashes[first.run_id])
    grouped = {lane.key for members in replicates for lane in members}
    for lane in (lane for lane in lanes if lane.key not in grouped):
        label = labels.get(lane.key, lane.key)
        if raw:
            steps, ms = lane.points("step_ms")
            data.append({"type": "scattergl" if len(steps) > 1000 else "scatter", "mode": "markers", "x": steps,
                         "y": ms, "name": f"{label} (each step)", "legendgroup": lane.key, "showlegend": False,
                         "marker": {"color": mode_color(lane.mode), "size": 3, "opacity": 0.35},
                         "hovertemplate": "step %{x}: %{y:.3g} ms<extra>" + label + "</extra>"})
        data += band_traces(lane.mode, bands.band(lane), label, lane.key, dashes[lane.run_id])
    axis = _y_axis("ms per step", log_y)
    if not log_y:
        axis["rangemode"] = "tozero"
    layout = chart_layout("Step time per lane · median and p10-p90 band" + (" · dots: each step" if raw else "")
                          + (" · several seeds: mean of their medians, min-max band" if replicates else ""),
                          "ms per step", yaxis=axis, hovermode="closest", margin={"t": 50, "b": 40}, height=None,
                          legend={"title": {"text": "lane (colour: mode, dash: run)"}})
    return chart_figure({"data": data, "layout": layout})


# --- lanes that hide each other -----------------------------------------------------------------------------------
OVERLAP_TOLERANCE = 0.01
"""Lanes whose losses stay within this relative difference at every common step cover each other on a loss chart."""


def _compared(records: pd.DataFrame | list[LaneSeries]) -> list[LaneSeries]:
    """Lanes to compare loss by loss: a frame's with every record; a list as read (a long lane as bucket means)."""
    return summary.lanes(records, max_points=max(len(records), 1)) if isinstance(records, pd.DataFrame) else records


def bucket_note(lanes: list[LaneSeries]) -> str:
    """"" when every lane holds every record, else how the comparisons below were made."""
    sizes = sorted({lane.bucket_steps for lane in lanes if lane.bucket_steps > 1})
    if not sizes:
        return ""
    return (f"on the mean loss of each {' / '.join(f'{size:,}' for size in sizes)}-step bucket, not step by step "
            "(the lanes are long: a comparison reads a few thousand points)")


def _aligned_losses(first: LaneSeries, second: LaneSeries) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(steps, first's losses there, second's, exact): the losses (or bucket means) at the steps both have; lanes
    bucketed differently are compared on the first's steps, the second's interpolated (exact False)."""
    a, loss_a, _ = first.means("loss")
    b, loss_b, _ = second.means("loss")
    if len(a) == len(b) and np.array_equal(a, b):  # lanes of one run, or runs of one length: nothing to match
        return a, loss_a, loss_b, True
    if first.bucket_steps == second.bucket_steps:
        steps, i, j = np.intersect1d(a, b, assume_unique=True, return_indices=True)
        return steps, loss_a[i], loss_b[j], True
    inside = (a >= b.min()) & (a <= b.max()) if len(b) else np.zeros(len(a), dtype=bool)
    return a[inside], loss_a[inside], np.interp(a[inside], b, loss_b), False


def loss_overlaps(records: pd.DataFrame | list[LaneSeries], labels: dict[str, str] | None = None,
                  tolerance: float = OVERLAP_TOLERANCE) -> list[dict]:
    """Groups of lanes whose loss curves lie on top of each other: linked when, at every one of their common steps
    (at least two), their losses (bucket means, for long lanes) are equal bit for bit, or within `tolerance` of each
    other (relative; inf/NaN at the same steps). Per group: lanes (labels, in order), steps (fewest common points of a
    linked pair), identical (every pair of the group equal bit for bit, step by step), same (its pairs that are, as
    label pairs) and max_rel_diff (the largest relative difference among its pairs)."""
    lanes = [((labels or {}).get(lane.key, lane.key), lane) for lane in _compared(records)]
    parent = list(range(len(lanes)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    pairs = {}
    for a in range(len(lanes)):
        for b in range(a + 1, len(lanes)):
            steps, x, y, exact = _aligned_losses(lanes[a][1], lanes[b][1])
            finite = np.isfinite(x) & np.isfinite(y)
            if len(steps) < 2 or not np.array_equal(np.isfinite(x), np.isfinite(y)) or not finite.any():
                continue
            identical = exact and lanes[a][1].raw is not None and np.array_equal(x, y, equal_nan=True)
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


def overlap_notes(records: pd.DataFrame | list[LaneSeries], labels: dict[str, str] | None = None) -> list[str]:
    """One sentence per group of `loss_overlaps`, saying which lines hide which, and by how much they differ (and,
    for long lanes, that this was judged on bucket means)."""
    how = bucket_note(_compared(records))
    notes = []
    for group in loss_overlaps(records, labels):
        names = _names(group["lanes"])
        if group["identical"]:
            notes.append(f"{names} recorded the same loss, bit for bit, at every one of their {group['steps']:,} "
                         "common steps: their lines lie exactly on top of each other (the last drawn hides the rest).")
        else:
            same = "".join(f" {a} and {b} recorded the same loss, bit for bit." for a, b in group["same"])
            where = f"at every common point ({how})" if how else "at every common step"
            notes.append(f"{names} stay within {group['max_rel_diff']:.2%} of each other {where}: at this scale "
                         f"their lines cover each other.{same} The chart *Loss minus the baseline's* tells them "
                         "apart.")
    return notes


def loss_difference_figure(records: pd.DataFrame | list[LaneSeries], baseline: str,
                           labels: dict[str, str] | None = None, max_points: int = MAX_POINTS) -> go.Figure:
    """Each lane's loss minus the baseline lane's at the same step (common steps only; long lanes on their bucket
    means, said in the title), so lanes whose loss curves cover each other come apart. Points far beyond the bulk (a
    loss spike in one lane) would flatten the rest: the axis then spans the bulk (`plots.bulk_range`, and 0) and the
    others sit on its edge as ▲/▼, their true difference in the hover."""
    labels = labels or {}
    lanes = {lane.key: lane for lane in _compared(records)}
    how = bucket_note(list(lanes.values()))
    title = f"Loss minus the baseline's ({labels.get(baseline, baseline)}), " + ("bucket by bucket" if how else
                                                                                 "step by step")
    if baseline not in lanes:
        raise ValueError(f"baseline lane {baseline!r} has no records here")
    dashes = run_dashes(list(lanes.values()))
    curves = []
    for key, lane in lanes.items():
        if key == baseline:
            continue
        steps, loss, base_loss, _ = _aligned_losses(lane, lanes[baseline])
        with np.errstate(invalid="ignore"):  # two diverged lanes: inf - inf is NaN, and drawn as a gap
            curves.append((key, labels.get(key, key), lane.mode, lane.run_id, steps, loss - base_loss))
    finite = np.concatenate([d[np.isfinite(d)] for *_, d in curves] or [np.array([])])
    axis = {"title": {"text": "loss − baseline loss"}, "zeroline": True}
    clip = bulk_range(finite, include_zero=True)
    if clip is not None:
        axis["range"] = list(clip)
    data = []
    for key, label, mode, run_id, steps, difference in curves:
        idx = decimate_indices(difference, max_points)
        data.append(line_trace(
            mode, steps[idx], difference[idx], name=label, legendgroup=key,
            line={"color": mode_color(mode), "dash": dashes[run_id], "width": 2},
            hovertemplate=f"{label}<br>step %{{x}}<br>loss − baseline %{{y:.4g}}<extra></extra>"))
        if clip is not None:
            data += edge_markers(mode, steps, difference, clip, f"{label}: beyond the axis", legendgroup=key)
    if clip is not None:
        title += " · ▲▼ beyond the axis"
    layout = chart_layout(title, "loss − baseline loss", yaxis=axis, hovermode="closest",
                          legend={"title": {"text": "lane (colour: mode, dash: run)"}}, margin={"t": 50, "b": 40},
                          height=None)
    return chart_figure({"data": data, "layout": layout})


# --- tables and downloads -----------------------------------------------------------------------------------------
def _number(value: float, spec: str, suffix: str = "") -> str:
    return "—" if value is None or pd.isna(value) else f"{value:{spec}}{suffix}"


def format_summary(summary: pd.DataFrame, labels: dict[str, str] | None = None, baseline: str | None = None,
                   last_k: int = FINAL_LOSS_WINDOW) -> pd.DataFrame:
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
        "diverged": ["yes" if v else "no" for v in summary["diverged"]],
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



def _mean_sd_text(mean: float, sd: float, spec: str) -> str:
    """"mean ± sd", the sd to two significant digits (it is known no better from a few seeds)."""
    if mean is None or pd.isna(mean):
        return "—"
    return f"{mean:{spec}}" + ("" if sd is None or pd.isna(sd) else f" ± {sd:.2g}")


def format_replicates(table: pd.DataFrame, last_k: int = FINAL_LOSS_WINDOW, several_runs: bool = False) -> pd.DataFrame:
    """`summary.replicate_table` as the table a person reads: per mode (of a run), its seeds and, across them, the
    final loss and median ms/step as "mean ± sd" (sample standard deviation; no ± with one seed)."""
    columns = {
        "mode": [f"{mode} · {short_run_id(run_id)}" if several_runs else mode
                 for run_id, mode in zip(table["run_id"], table["mode"], strict=True)],
        "seeds": [", ".join(str(seed) for seed in seeds) for seeds in table["seeds"]],
        f"{final_loss_column(last_k)}, mean ± sd": [_mean_sd_text(m, s, ".4g") for m, s in
                                                    zip(table["final_loss_mean"], table["final_loss_sd"], strict=True)],
        "median ms/step, mean ± sd": [_mean_sd_text(m, s, ".3g") for m, s in
                                      zip(table["median_ms_mean"], table["median_ms_sd"], strict=True)],
        "diverged seeds": table["diverged"].astype(int).tolist(),
    }
    return pd.DataFrame(columns, columns=list(columns))
