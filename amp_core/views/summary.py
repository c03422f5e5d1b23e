"""Lanes and their summary (pure pandas/numpy): records split per lane once, then speed, memory, final loss and skips
against a baseline lane. The Train page's headline cards, the Compare table and the CLI all read `summarize`.

A lane is a `LaneSeries` (amp_core.records.query) per track: read from a run's tracks through the multi-resolution
summary, or split here from a DataFrame of records; either way its totals are exact. A lane of a torchrun job has one
track per rank: `summarize` gives the lane one row (its ranks together), `rank_table` one row per rank.

Seed replicates (RunConfig.seeds): a run with several seeds per mode has one lane per mode and seed; `seed_groups`
puts the lanes of one mode of one run together (their seeds from the run's lane metadata, `lane_seeds`),
`replicate_table` gives each group the mean and standard deviation across seeds of its final loss and median step
time, and `replicate_differences` says whether two modes differ by more than that spread (DIFFERENCE_RULE)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from amp_core.config import FINAL_LOSS_WINDOW
from amp_core.diagnostics.seednoise import (
    DIFFERENCE_RULE as DIFFERENCE_RULE,  # the rule lives with the engine; said here too
)
from amp_core.diagnostics.seednoise import DIFFERENCE_SDS, difference_verdict
from amp_core.precision import BASELINE_MODE
from amp_core.records.query import MAX_POINTS, LaneSeries, read_lane
from amp_core.records.schema import HELD_PARTS, STEP_COLUMNS, typed
from amp_core.records.tracks import TrackRecords

if TYPE_CHECKING:
    from amp_core.runs import LaneInfo

MEMORY_COLUMNS = HELD_PARTS
SUMMARY_COLUMNS = ("run_id", "lane", "mode", "steps", "median_ms", "speedup", "peak_bytes", "peak_mib", "mem_ratio",
                   "final_loss", "loss_delta", "latest_loss", "skipped_steps", "scale", "diverged", "is_baseline",
                   "ranks", "rank_imbalance")
REPLICATE_COLUMNS = ("run_id", "mode", "group", "lanes", "seeds", "final_loss_mean", "final_loss_sd", "final_loss_n",
                     "median_ms_mean", "median_ms_sd", "median_ms_n", "diverged")
DIFFERENCE_COLUMNS = ("run_id", "figure", "mode_a", "mode_b", "mean_a", "mean_b", "difference", "threshold", "seeds_a",
                      "seeds_b", "verdict")
VERDICTS = ("different", "within the spread", "cannot tell")
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


def rank_table(records: pd.DataFrame | list[LaneSeries], last_k: int = FINAL_LOSS_WINDOW) -> pd.DataFrame:
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


def summarize(records: pd.DataFrame | list[LaneSeries], baseline: str | None = None,
              last_k: int = FINAL_LOSS_WINDOW) -> pd.DataFrame:
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


# --- seed replicates -----------------------------------------------------------------------------------------------
def lane_seeds(run_id: str, lanes_info: Sequence[LaneInfo]) -> dict[str, int]:
    """Lane key -> seed, from a run's lanes as `RunReader.run_info` gives them (`meta["seed"]`); lanes without one
    (runs from before seed replicates, a Monitor's) are left out."""
    return {lane_key(run_id, lane.lane): int(lane.meta["seed"]) for lane in lanes_info
            if lane.meta.get("seed") is not None}


def group_key(run_id: str, mode: str) -> str:
    """The key of a run's lanes of one mode ("run_id/mode"), what a seed group is named by."""
    return f"{run_id}/{mode}"


def seed_groups(series: list[LaneSeries], seeds: dict[str, int] | None = None) -> dict[str, list[list[LaneSeries]]]:
    """Lanes (each a list of its ranks, as `by_lane`) grouped for drawing, in order of first appearance: the lanes of
    one mode of one run whose seed is known (`seeds`: lane key -> seed) form one group ("run_id/mode"), one lane per
    seed; any other lane is a group of its own (keyed by its lane key). A group of two or more lanes is drawn as its
    mean across seeds inside a band."""
    seeds = seeds or {}
    groups: dict[str, list[list[LaneSeries]]] = {}
    for key, ranks in by_lane(series).items():
        first = ranks[0]
        seeded = key in seeds and len(ranks) == 1
        groups.setdefault(group_key(first.run_id, first.mode) if seeded else key, []).append(ranks)
    return groups


def has_replicates(series: list[LaneSeries], seeds: dict[str, int] | None) -> bool:
    """Whether some mode of some run has lanes of several seeds here."""
    return any(len(group) > 1 for group in seed_groups(series, seeds).values())


def replicated_keys(series: list[LaneSeries], seeds: dict[str, int] | None) -> set[str]:
    """Keys of the lanes drawn as part of a mode's seed band (a group of two or more seeds), not as lines of their
    own."""
    return {ranks[0].key for group in seed_groups(series, seeds).values() if len(group) > 1 for ranks in group}


def seed_spread(columns: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                        np.ndarray]:
    """(steps, min, mean, max) across seeds of (steps, values) pairs, at the steps every seed has; a value that is
    not finite is left out of its step (a step where none is finite is NaN: a gap)."""
    table = pd.concat([pd.Series(np.where(np.isfinite(v), v, np.nan), index=s).loc[lambda x: ~x.index.duplicated()]
                       for s, v in columns], axis=1, join="inner").sort_index()
    values = table.to_numpy(dtype=float)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return (table.index.to_numpy(), np.nanmin(values, axis=1), np.nanmean(values, axis=1),
                np.nanmax(values, axis=1))


def _mean_sd(values: list[float]) -> tuple[float, float, int]:
    """(mean, sample standard deviation, n) of the finite values (sd NaN below two)."""
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return np.nan, np.nan, 0
    return float(finite.mean()), float(finite.std(ddof=1)) if finite.size > 1 else np.nan, int(finite.size)


def replicate_table(series: list[LaneSeries], seeds: dict[str, int] | None,
                    last_k: int = FINAL_LOSS_WINDOW) -> pd.DataFrame:
    """One row per mode of a run (`seed_groups`, lanes of one seed each), in order of first appearance: how many
    lanes (seeds) it has, the mean and sample standard deviation across them of the final loss (mean of each lane's
    last `last_k` losses) and of the median ms/step, with n (the seeds whose figure is finite: a diverged lane's
    final loss is left out, and counted in `diverged`). Lanes of several ranks are left out (a torchrun job has no
    seed replicates)."""
    if last_k < 1:
        raise ValueError(f"last_k must be at least 1, got {last_k}")
    rows = []
    for key, group in seed_groups(series, seeds).items():
        if any(len(ranks) > 1 for ranks in group):
            continue
        lanes_ = [ranks[0] for ranks in group]
        loss_mean, loss_sd, loss_n = _mean_sd([lane.final_loss(last_k) for lane in lanes_])
        ms_mean, ms_sd, ms_n = _mean_sd([lane.stats.median_step_ms for lane in lanes_])
        latest = [lane.stats.latest.get("loss", np.nan) for lane in lanes_]
        rows.append({"run_id": lanes_[0].run_id, "mode": lanes_[0].mode, "group": key, "lanes": len(lanes_),
                     "seeds": sorted({(seeds or {}).get(lane.key, -1) for lane in lanes_}),
                     "final_loss_mean": loss_mean, "final_loss_sd": loss_sd, "final_loss_n": loss_n,
                     "median_ms_mean": ms_mean, "median_ms_sd": ms_sd, "median_ms_n": ms_n,
                     "diverged": int(sum(not np.isfinite(v) for v in latest))})
    return pd.DataFrame(rows, columns=list(REPLICATE_COLUMNS))


def replicate_differences(table: pd.DataFrame, sds: float = DIFFERENCE_SDS) -> pd.DataFrame:
    """Each mode of a run in a `replicate_table` against the run's baseline mode (its 32-true, else its first mode),
    for the final loss and the median ms/step: the difference of their means across seeds (b - a, a the baseline),
    the threshold of DIFFERENCE_RULE and the verdict: "different" (the gap is larger than the spread across seeds),
    "within the spread", or "cannot tell" (a mode has fewer than 2 seeds with a finite figure)."""
    rows = []
    figures = (("final loss", "final_loss"), ("median ms/step", "median_ms"))
    for run_id, part in table.groupby("run_id", sort=False):
        records = part.to_dict("records")
        a = next((row for row in records if row["mode"] == BASELINE_MODE), records[0])
        for b in records:
            if b is a:
                continue
            for figure, column in figures:
                verdict, threshold = difference_verdict(a[f"{column}_mean"], a[f"{column}_sd"], a[f"{column}_n"],
                                                        b[f"{column}_mean"], b[f"{column}_sd"], b[f"{column}_n"],
                                                        sds)
                rows.append({"run_id": run_id, "figure": figure, "mode_a": a["mode"], "mode_b": b["mode"],
                             "mean_a": a[f"{column}_mean"], "mean_b": b[f"{column}_mean"],
                             "difference": b[f"{column}_mean"] - a[f"{column}_mean"], "threshold": threshold,
                             "seeds_a": a[f"{column}_n"], "seeds_b": b[f"{column}_n"], "verdict": verdict})
    return pd.DataFrame(rows, columns=list(DIFFERENCE_COLUMNS))


def difference_sentences(differences: pd.DataFrame, several_runs: bool = False) -> list[str]:
    """Each row of `replicate_differences` as a sentence a person reads (the run's short id first when
    `several_runs`)."""
    out = []
    for row in differences.to_dict("records"):
        where = f"run …{row['run_id'][-6:]}: " if several_runs else ""
        pair = f"{row['mode_b']} vs {row['mode_a']}"
        if row["verdict"] == "cannot tell":
            out.append(f"{where}{pair}, {row['figure']}: cannot tell (needs at least 2 seeds with a finite figure "
                       f"per mode; has {row['seeds_b']} and {row['seeds_a']}).")
            continue
        larger = row["verdict"] == "different"
        out.append(f"{where}{pair}, {row['figure']}: {row['mean_b']:.4g} vs {row['mean_a']:.4g}, a difference of "
                   f"{row['difference']:+.3g}; the spread across seeds allows ±{row['threshold']:.3g}: "
                   + ("**larger than the spread — a real difference**." if larger else
                      "within the spread — not told apart by these seeds."))
    return out
