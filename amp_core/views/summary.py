"""Lane summaries over step records (pure pandas): speed, memory, final loss and skips against a baseline lane."""

from __future__ import annotations

import numpy as np
import pandas as pd

MEMORY_COLUMNS = ("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes")
SUMMARY_COLUMNS = ("run_id", "lane", "mode", "steps", "median_ms", "speedup", "peak_bytes", "peak_mib", "mem_ratio",
                   "final_loss", "loss_delta", "skipped_steps", "diverged")


def lane_key(run_id: str, lane: int) -> str:
    return f"{run_id}/{lane}"


def peak_bytes(frame: pd.DataFrame) -> pd.Series:
    """Per row: the CUDA allocator peak where there is one, else the bytes held (params+grads+optimizer+saved)."""
    held = frame[list(MEMORY_COLUMNS)].astype(float).sum(axis=1)
    if "cuda_peak_bytes" in frame:
        return pd.to_numeric(frame["cuda_peak_bytes"], errors="coerce").fillna(held)
    return held


def default_baseline(frame: pd.DataFrame) -> str | None:
    """The first 32-true lane, else the first lane (`frame` needs run_id, lane and mode columns)."""
    if frame.empty:
        return None
    lanes = frame[["run_id", "lane", "mode"]].drop_duplicates()
    fp32 = lanes[lanes["mode"] == "32-true"]
    row = (fp32 if not fp32.empty else lanes).iloc[0]
    return lane_key(row["run_id"], int(row["lane"]))


def _final_loss(losses: np.ndarray, last_k: int) -> float:
    """Mean of the finite losses among the last `last_k` steps; the last loss itself if none of them is finite."""
    window = losses[-last_k:]
    finite = window[np.isfinite(window)]
    return float(finite.mean()) if finite.size else float(window[-1])


def summarize(frame: pd.DataFrame, baseline: str | None = None, last_k: int = 20) -> pd.DataFrame:
    """One row per (run, lane), in order of first appearance, compared with the `baseline` lane ("run_id/lane";
    None: `default_baseline`).

    - median_ms: median step time; speedup = baseline median_ms / median_ms (above 1: faster than the baseline).
    - peak_bytes / peak_mib: the largest per-step memory figure (`peak_bytes`); mem_ratio = peak / baseline peak.
    - final_loss: mean of the last `last_k` steps' losses (non-finite ones left out); loss_delta = final - baseline.
    - skipped_steps: optimizer steps the GradScaler skipped; diverged: the lane's last recorded loss is inf/NaN
      (it never came back: a transient inf loss on a skipped step does not count).

    Raises ValueError if `last_k` < 1 or `baseline` names a lane that has no records in `frame`.
    """
    if last_k < 1:
        raise ValueError(f"last_k must be at least 1, got {last_k}")
    if frame.empty:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    baseline = baseline or default_baseline(frame)
    frame = frame.assign(_peak=peak_bytes(frame))
    rows = []
    for (run_id, lane), group in frame.groupby(["run_id", "lane"], sort=False):
        group = group.sort_values("step")
        losses = pd.to_numeric(group["loss"], errors="coerce").to_numpy(dtype=float)
        rows.append({
            "run_id": run_id, "lane": int(lane), "mode": group["mode"].iloc[0], "steps": len(group),
            "median_ms": float(group["step_ms"].median()), "peak_bytes": float(group["_peak"].max()),
            "final_loss": _final_loss(losses, last_k),
            "skipped_steps": int(group["skipped"].astype(bool).sum()),
            "diverged": bool(not np.isfinite(losses[-1])), "_key": lane_key(run_id, int(lane)),
        })
    out = pd.DataFrame(rows)
    base = out[out["_key"] == baseline]
    if base.empty:
        raise ValueError(f"baseline lane {baseline!r} has no records here; lanes: {', '.join(out['_key'])}")
    base = base.iloc[0]
    out["speedup"] = base["median_ms"] / out["median_ms"]
    out["peak_mib"] = out["peak_bytes"] / 2**20
    out["mem_ratio"] = out["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else float("nan")
    out["loss_delta"] = out["final_loss"] - base["final_loss"]
    return out[list(SUMMARY_COLUMNS)]
