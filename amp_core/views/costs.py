"""What each mode costs before a launch, as the Train page shows it: the cost probe's table, the estimates of a step
from counted FLOPs, and the largest-batch search's table (the page draws them; the shaping is here)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from amp_core.precision import BASELINE_MODE
from amp_core.views.live import format_ratio

ESTIMATE_COLUMNS = ["mode", "estimated time / step", "basis"]


def cost_table(costs: pd.DataFrame) -> pd.DataFrame:
    """The cost probe's figures (diagnostics.cost.relative_costs) as the page's table: one row a mode, in words."""
    return pd.DataFrame({
        "mode": costs["mode"],
        "ms / step": costs["ms_per_step"].map(lambda v: f"{v:.3g}"),
        f"time vs {BASELINE_MODE}": costs["time_vs_baseline"].map(format_ratio),
        "steps timed": costs["steps_timed"].map(lambda n: f"{n:,}") + costs["capped"].map({True: " (capped)",
                                                                                          False: ""}),
        "measured by": costs["source"],
    })


def step_estimates(estimates: dict[str, Any]) -> pd.DataFrame:
    """Per mode: its estimate of one step's time (diagnostics.cost.estimate_step: counted FLOPs ÷ this device's
    measured matmul rate), or why there is none (a string), as the page's table. (The view is handed the estimates:
    the cost module drives a Run, which no view reaches.)"""
    rows = []
    for mode, estimate in estimates.items():
        if isinstance(estimate, str):
            rows.append({"mode": mode, "estimated time / step": f"cannot estimate: {estimate}", "basis": ""})
            continue
        seconds = estimate.ms_per_step / 1e3
        rows.append({"mode": mode, "estimated time / step": f"≈ {seconds:.3g} s (estimate)" if seconds >= 1
                     else f"≈ {estimate.ms_per_step:.3g} ms (estimate)",
                     "basis": f"{estimate.flops_per_step / 1e9:,.0f} GFLOP ÷ {estimate.matmul_flops_per_s / 1e9:.3g} "
                              f"GFLOP/s ({estimate.compute_dtype} matmul)"})
    return pd.DataFrame(rows, columns=ESTIMATE_COLUMNS)


def maxbatch_table(rows: list[dict]) -> tuple[pd.DataFrame, bool]:
    """The largest-batch search's rows (MaxBatchJob.rows) as the page's table, and whether they were modelled (no
    batch tried at that size: the model's columns shown) rather than found by real steps (samples/s shown)."""
    table = pd.DataFrame(rows)
    modelled = bool((table["found by"] == "modelled").any())
    return table.drop(columns=["samples / s"] if modelled else ["bytes / sample", "fixed MiB"]), modelled
