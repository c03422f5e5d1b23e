"""Lanes and their summary (pure pandas/numpy): records split per lane once, then speed, memory, final loss and skips
against a baseline lane. The Train page's headline cards, the Compare table and the CLI all read `summarize`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from amp_core.precision import BASELINE_MODE

MEMORY_COLUMNS = ("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes")
LANE_COLUMNS = ("step", "loss", "step_ms", "lr", "scale", "skipped", *MEMORY_COLUMNS, "peak_above_start_bytes",
                "lane_peak_bytes")
"""The columns a lane is split into (what the charts and the summary read)."""
SUMMARY_COLUMNS = ("run_id", "lane", "mode", "steps", "median_ms", "speedup", "peak_bytes", "peak_mib", "mem_ratio",
                   "final_loss", "loss_delta", "latest_loss", "skipped_steps", "scale", "diverged", "is_baseline")


def lane_key(run_id: str, lane: int) -> str:
    return f"{run_id}/{lane}"


@dataclass(frozen=True, slots=True)
class LaneSeries:
    """One lane's records as numpy columns, ordered by step."""

    run_id: str
    lane: int
    mode: str
    columns: dict[str, np.ndarray]

    def __getitem__(self, column: str) -> np.ndarray:
        return self.columns[column]

    @property
    def key(self) -> str:
        return lane_key(self.run_id, self.lane)

    def peak_bytes(self) -> np.ndarray:
        """Per step: the lane's own peak (lane_peak_bytes) where it was measured, else the bytes held
        (params+grads+optimizer+saved)."""
        held = sum(self.columns[column] for column in MEMORY_COLUMNS)
        return np.where(np.isnan(self.columns["lane_peak_bytes"]), held, self.columns["lane_peak_bytes"])


def lanes(frame: pd.DataFrame) -> list[LaneSeries]:
    """Split records (any runs, any lanes, any order) into lanes once, in order of first appearance (numpy, no
    groupby): the summary and every chart of a redraw reuse the split."""
    if frame.empty:
        return []
    arrays = {column: frame[column].to_numpy(dtype=float, na_value=np.nan)
              for column in LANE_COLUMNS if column != "skipped"}
    arrays["skipped"] = frame["skipped"].to_numpy(dtype=bool)
    run_codes, run_ids = pd.factorize(frame["run_id"])
    lane_numbers = frame["lane"].to_numpy(dtype=np.int64)
    codes, _ = pd.factorize(run_codes.astype(np.int64) * (int(lane_numbers.max()) + 1) + lane_numbers)
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    out = []
    for rows in np.split(order, bounds):
        steps = arrays["step"][rows]
        if len(rows) > 1 and (np.diff(steps) < 0).any():
            rows = rows[np.argsort(steps, kind="stable")]
        first = rows[0]
        out.append(LaneSeries(str(run_ids[run_codes[first]]), int(lane_numbers[first]), str(frame["mode"].iat[first]),
                              {c: a[rows] for c, a in arrays.items()}))
    return out


def _split(records: pd.DataFrame | list[LaneSeries]) -> list[LaneSeries]:
    return lanes(records) if isinstance(records, pd.DataFrame) else records


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


def _final_loss(losses: np.ndarray, last_k: int) -> float:
    """Mean of the finite losses among the last `last_k` steps; the last loss itself if none of them is finite."""
    window = losses[-last_k:]
    finite = window[np.isfinite(window)]
    return float(finite.mean()) if finite.size else float(window[-1])


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
    series = _split(records)
    if not series:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    baseline = baseline or default_baseline(series)
    rows = []
    for lane in series:
        losses = lane["loss"]
        rows.append({
            "run_id": lane.run_id, "lane": lane.lane, "mode": lane.mode, "steps": len(losses),
            "median_ms": float(np.median(lane["step_ms"])), "peak_bytes": float(lane.peak_bytes().max()),
            "final_loss": _final_loss(losses, last_k), "latest_loss": float(losses[-1]),
            "skipped_steps": int(lane["skipped"].sum()), "scale": float(lane["scale"][-1]),
            "diverged": bool(not np.isfinite(losses[-1])), "is_baseline": lane.key == baseline,
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
