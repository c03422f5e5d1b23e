"""Lanes and their summary (pure pandas/numpy): records split per lane once, then speed, memory, final loss and skips
against a baseline lane. The Train page's headline cards, the Compare table and the CLI all read `summarize`.

A lane is a `LaneSeries` (amp_core.records.query): read from a run's tracks through the multi-resolution summary, or
split here from a DataFrame of records; either way its totals are exact."""

from __future__ import annotations

import numpy as np
import pandas as pd

from amp_core.precision import BASELINE_MODE
from amp_core.records.query import MAX_POINTS, LaneSeries, read_lane
from amp_core.records.schema import HELD_PARTS, STEP_COLUMNS, typed
from amp_core.records.tracks import TrackRecords

MEMORY_COLUMNS = HELD_PARTS
SUMMARY_COLUMNS = ("run_id", "lane", "mode", "steps", "median_ms", "speedup", "peak_bytes", "peak_mib", "mem_ratio",
                   "final_loss", "loss_delta", "latest_loss", "skipped_steps", "scale", "diverged", "is_baseline")


def lane_key(run_id: str, lane: int) -> str:
    return f"{run_id}/{lane}"


def lanes(records: pd.DataFrame | list[LaneSeries], max_points: int = MAX_POINTS) -> list[LaneSeries]:
    """Records split into lanes once, in order of first appearance (a list of LaneSeries is returned as it is): each
    lane's exact totals, and its records as an exact envelope of about `max_points` points per figure."""
    if not isinstance(records, pd.DataFrame):
        return records
    if records.empty:
        return []
    ranks = records["rank"].fillna(0).to_numpy(dtype=np.int64) if "rank" in records else np.zeros(len(records),
                                                                                                     dtype=np.int64)
    keys = pd.DataFrame({"run_id": records["run_id"].to_numpy(), "lane": records["lane"].to_numpy(dtype=np.int64),
                         "rank": ranks})
    codes, _ = pd.factorize(pd.MultiIndex.from_frame(keys))
    out = []
    for code in range(codes.max() + 1):
        rows = np.flatnonzero(codes == code)
        part = records.iloc[rows].sort_values("step", kind="stable")
        track = TrackRecords(str(part["run_id"].iat[0]), int(part["lane"].iat[0]), str(part["mode"].iat[0]),
                             int(ranks[rows[0]]))
        missing = np.full(len(part), np.nan)  # a frame without a figure (an export of an older run): not measured
        track.extend({name: typed(part[name].to_numpy(dtype=np.float64, na_value=np.nan) if name in part else missing,
                                  dtype) for name, dtype in STEP_COLUMNS.items()})
        track.seal()
        out.append(read_lane(track, max_points=max_points))
    return out


def peak_bytes(frame: pd.DataFrame) -> pd.Series:
    """Per row: the lane's own peak (lane_peak_bytes) where it was measured, else the bytes held
    (params+grads+optimizer+saved)."""
    held = frame[list(MEMORY_COLUMNS)].astype(float).sum(axis=1)
    if "lane_peak_bytes" in frame:
        return pd.to_numeric(frame["lane_peak_bytes"], errors="coerce").fillna(held)
    return held


def default_baseline(lanes_or_frame: pd.DataFrame | list[LaneSeries]) -> str | None:
    """The first 32-true lane, else the first lane ("run_id/lane"); a frame needs run_id, lane and mode columns."""
    if isinstance(lanes_or_frame, pd.DataFrame):
        if lanes_or_frame.empty:
            return None
        keys = lanes_or_frame[["run_id", "lane", "mode"]].drop_duplicates()
        found = [(run_id, int(lane), mode) for run_id, lane, mode in keys.itertuples(index=False)]
    else:
        found = [(s.run_id, s.lane, s.mode) for s in lanes_or_frame]
    if not found:
        return None
    run_id, lane, _ = next((f for f in found if f[2] == BASELINE_MODE), found[0])
    return lane_key(run_id, lane)


def summarize(records: pd.DataFrame | list[LaneSeries], baseline: str | None = None, last_k: int = 20) -> pd.DataFrame:
    """One row per (run, lane), in order of first appearance, compared with the `baseline` lane ("run_id/lane";
    None: `default_baseline`).

    - median_ms: median step time; speedup = baseline median_ms / median_ms (above 1: faster than the baseline).
    - peak_bytes / peak_mib: the largest per-step memory figure (`peak_bytes`: the lane's own peak, which other lanes
      do not inflate); mem_ratio = peak / baseline peak.
    - final_loss: mean of the last `last_k` steps' losses (non-finite ones left out); loss_delta = final - baseline.
      latest_loss: the loss of the lane's last step (what a live view shows as "loss now").
    - skipped_steps: optimizer steps the GradScaler skipped; scale: the GradScaler scale at the last step (NaN
      without one); diverged: the lane's last recorded loss is inf/NaN (it never came back: a transient inf loss on
      a skipped step does not count); is_baseline: the row is the baseline lane.

    Raises ValueError if `last_k` < 1 or `baseline` names a lane that has no records.
    """
    if last_k < 1:
        raise ValueError(f"last_k must be at least 1, got {last_k}")
    series = lanes(records)
    if not series:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    baseline = baseline or default_baseline(series)
    rows = []
    for lane in series:
        stats = lane.stats
        latest_loss = float(stats.latest.get("loss", np.nan))
        rows.append({
            "run_id": lane.run_id, "lane": lane.lane, "mode": lane.mode, "steps": stats.records,
            "median_ms": stats.median_step_ms, "peak_bytes": stats.peak_bytes,
            "final_loss": lane.final_loss(last_k), "latest_loss": latest_loss,
            "skipped_steps": stats.skipped_steps, "scale": float(stats.latest.get("scale", np.nan)),
            "diverged": bool(not np.isfinite(latest_loss)), "is_baseline": lane.key == baseline,
        })
    out = pd.DataFrame(rows)
    base = out[out["is_baseline"]]
    if base.empty:
        keys = ", ".join(lane.key for lane in series)
        raise ValueError(f"baseline lane {baseline!r} has no records here; lanes: {keys}")
    base = base.iloc[0]
    out["speedup"] = base["median_ms"] / out["median_ms"]
    out["peak_mib"] = out["peak_bytes"] / 2**20
    out["mem_ratio"] = out["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else float("nan")
    out["loss_delta"] = out["final_loss"] - base["final_loss"]
    return out[list(SUMMARY_COLUMNS)]
