"""Lanes and their summary (pure pandas/numpy): records split per lane once, then speed, memory, final loss and skips
against a baseline lane. The Train page's headline cards, the Compare table and the CLI all read `summarize`.

A lane is a `LaneSeries` (amp_core.records.query) per track: read from a run's tracks through the multi-resolution
summary, or split here from a DataFrame of records; either way its totals are exact. A lane of a torchrun job has one
track per rank: `summarize` gives the lane one row (its ranks together), `rank_table` one row per rank."""

from __future__ import annotations

import numpy as np
import pandas as pd

from amp_core.precision import BASELINE_MODE
from amp_core.records.query import MAX_POINTS, LaneSeries, read_lane
from amp_core.records.schema import HELD_PARTS, STEP_COLUMNS, typed
from amp_core.records.tracks import TrackRecords

MEMORY_COLUMNS = HELD_PARTS
SUMMARY_COLUMNS = ("run_id", "lane", "mode", "steps", "median_ms", "speedup", "peak_bytes", "peak_mib", "mem_ratio",
                   "final_loss", "loss_delta", "latest_loss", "skipped_steps", "scale", "diverged", "is_baseline",
                   "ranks", "rank_imbalance")
RANK_COLUMNS = ("run_id", "lane", "mode", "rank", "steps", "median_ms", "vs_fastest", "skipped_steps", "latest_loss",
                "final_loss")


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


def by_lane(series: list[LaneSeries]) -> dict[str, list[LaneSeries]]:
    """Tracks grouped by lane key ("run_id/lane"), lanes in order of first appearance, each lane's ranks in order."""
    grouped: dict[str, list[LaneSeries]] = {}
    for lane in series:
        grouped.setdefault(lane.key, []).append(lane)
    return {key: sorted(ranks, key=lambda lane: lane.rank) for key, ranks in grouped.items()}


def first_rank(frame: pd.DataFrame) -> pd.DataFrame:
    """The records of each lane's first rank (all of them outside torchrun): what a chart of one line per lane draws
    (lanes of a DDP job share their steps, skips and scale)."""
    if frame.empty or "rank" not in frame or not frame["rank"].any():
        return frame
    lowest = frame.groupby(["run_id", "lane"])["rank"].transform("min")
    return frame[frame["rank"] == lowest].reset_index(drop=True)


def _mean_finite(values) -> float:
    """Mean of the finite values; the first value itself (inf/NaN) when none is finite."""
    values = np.asarray(values, dtype=float)
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else float(values[0]) if values.size else np.nan


def rank_table(records: pd.DataFrame | list[LaneSeries], last_k: int = 20) -> pd.DataFrame:
    """One row per rank of every lane that has more than one: its steps, median ms/step and how that compares with
    the lane's fastest rank (vs_fastest: 1.0 is the fastest), skipped steps, latest and final loss (mean of its last
    `last_k` steps). Empty when no lane has several ranks."""
    rows = []
    for ranks in by_lane(lanes(records)).values():
        if len(ranks) < 2:
            continue
        fastest = min(lane.stats.median_step_ms for lane in ranks)
        rows += [{"run_id": lane.run_id, "lane": lane.lane, "mode": lane.mode, "rank": lane.rank,
                  "steps": lane.stats.records, "median_ms": lane.stats.median_step_ms,
                  "vs_fastest": lane.stats.median_step_ms / fastest if fastest > 0 else np.nan,
                  "skipped_steps": lane.stats.skipped_steps,
                  "latest_loss": float(lane.stats.latest.get("loss", np.nan)),
                  "final_loss": lane.final_loss(last_k)} for lane in ranks]
    return pd.DataFrame(rows, columns=list(RANK_COLUMNS))


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
    - A lane of a torchrun job (ranks > 1 tracks): median_ms is the median of its ranks' medians, rank_imbalance the
      slowest rank's median ÷ the fastest's (NaN with one rank); the losses are means over its ranks (each rank
      trains on its own batches); peak_bytes the largest rank's; steps, skips and scale are rank 0's.

    Raises ValueError if `last_k` < 1 or `baseline` names a lane that has no records.
    """
    if last_k < 1:
        raise ValueError(f"last_k must be at least 1, got {last_k}")
    series = lanes(records)
    if not series:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    baseline = baseline or default_baseline(series)
    rows = []
    for ranks in by_lane(series).values():
        first = ranks[0]  # rank 0: the steps, skips and scale of a DDP job are every rank's
        stats = first.stats
        latest = np.array([lane.stats.latest.get("loss", np.nan) for lane in ranks], dtype=float)
        medians = np.array([lane.stats.median_step_ms for lane in ranks], dtype=float)
        rows.append({
            "run_id": first.run_id, "lane": first.lane, "mode": first.mode, "steps": stats.records,
            "median_ms": float(np.median(medians)), "peak_bytes": max(lane.stats.peak_bytes for lane in ranks),
            "final_loss": _mean_finite([lane.final_loss(last_k) for lane in ranks]),
            "latest_loss": _mean_finite(latest), "skipped_steps": stats.skipped_steps,
            "scale": float(stats.latest.get("scale", np.nan)), "diverged": bool(not np.isfinite(latest).all()),
            "is_baseline": first.key == baseline, "ranks": len(ranks),
            "rank_imbalance": float(medians.max() / medians.min()) if len(ranks) > 1 and medians.min() > 0 else
            np.nan,
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
