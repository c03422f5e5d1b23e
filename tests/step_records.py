"""Hand-made step records in the runner's layout, for figure and headline tests."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from amp_core.records import STEP_FIELDS

MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def records(n_steps: int, modes=MODES, skipped_at=(), spike_at=None, cuda=False, run_id: str = "r") -> pd.DataFrame:
    """Hand-made step records, lanes interleaved as the runner writes them; 16-mixed has a scale."""
    rows = []
    rng = np.random.default_rng(0)
    for step in range(n_steps):
        for lane, mode in enumerate(modes):
            scaled = mode == "16-mixed"
            loss = 2.0 * math.exp(-step / 500) + 0.01 * rng.random()
            if spike_at is not None and step == spike_at and lane == 0:
                loss = 50.0
            rows.append({
                "run_id": run_id, "lane": lane, "mode": mode, "step": step, "t_wall_s": 1e9 + step,
                "loss": loss, "step_ms": 1.0 + lane + (100.0 if step == n_steps // 3 else 0.0),
                "samples_per_s": 1000.0, "lr": 1e-3, "scale": 2.0 ** (16 - sum(s <= step for s in skipped_at))
                if scaled else None, "skipped": scaled and step in skipped_at, "grad_norm": 1.0,
                "params_bytes": 4000 * (lane + 1), "grads_bytes": 4000, "optim_bytes": 8000,
                "activations_bytes": 100 * step, "peak_above_start_bytes": 2**20 if cuda else None,
                "lane_peak_bytes": 3 * 2**20 if cuda else None, "probe_ms": 0.0, "rank": 0,
            })
    return pd.DataFrame(rows, columns=list(STEP_FIELDS))
