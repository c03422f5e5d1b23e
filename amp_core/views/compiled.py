"""Compiled lanes in the views: what torch.compile cost and said (compile time, graph breaks, recompiles, from the
run's events) and how far a compiled lane's loss drifts from the eager lane of the same recipe and seed, step by
step, and from 32-true; with seed replicates, drift is set against the spread across seeds (noise)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from amp_core.precision import BASELINE_MODE
from amp_core.race.compiled import (
    COMPILE_SLOW_EVENT,
    COMPILED_EVENT,
    GRAPH_BREAK_EVENT,
    RECOMPILE_EVENT,
    RECOMPILE_STORM_EVENT,
    eager_recipe,
    is_compiled_recipe,
)
from amp_core.runs import LaneInfo, RunReader

DRIFT_COLUMNS = ["run_id", "lane", "mode", "seed", "step", "vs_eager", "vs_fp32", "eager_vs_fp32"]


def has_compiled(modes) -> bool:
    return any(is_compiled_recipe(str(mode)) for mode in modes)


def _relative(values: np.ndarray, reference: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return (values - reference) / np.abs(reference)


def drift_frame(steps: pd.DataFrame, seeds: dict[str, int]) -> pd.DataFrame:
    """Per compiled lane and step: its loss relative to the eager lane of the same recipe and seed in the same run
    ((compiled - eager) / |eager|), relative to the 32-true lane of that seed, and the eager lane's own relative
    difference from 32-true. `steps`: step records (run_id, lane, mode, step, loss); `seeds`: lane key -> seed."""
    parts = []
    for run_id, run_steps in steps.groupby("run_id", sort=False):
        lanes = run_steps[["lane", "mode"]].drop_duplicates()
        seed_of = {int(lane): seeds.get(f"{run_id}/{int(lane)}", 0) for lane in lanes["lane"]}
        by_key = {(mode, seed_of[int(lane)]): int(lane) for lane, mode in lanes.itertuples(index=False)}
        losses = {int(lane): frame.set_index("step")["loss"] for lane, frame in run_steps.groupby("lane")}
        for lane, mode in lanes.itertuples(index=False):
            if not is_compiled_recipe(mode):
                continue
            seed = seed_of[int(lane)]
            eager = by_key.get((eager_recipe(mode), seed))
            if eager is None:
                continue
            fp32 = by_key.get((BASELINE_MODE, seed))
            joined = pd.concat({"compiled": losses[int(lane)], "eager": losses[eager],
                                "fp32": losses[fp32] if fp32 is not None else losses[eager] * np.nan},
                               axis=1, join="inner").dropna(subset=["compiled", "eager"])
            parts.append(pd.DataFrame({
                "run_id": run_id, "lane": int(lane), "mode": mode, "seed": seed, "step": joined.index.to_numpy(),
                "vs_eager": _relative(joined["compiled"].to_numpy(), joined["eager"].to_numpy()),
                "vs_fp32": _relative(joined["compiled"].to_numpy(), joined["fp32"].to_numpy()),
                "eager_vs_fp32": _relative(joined["eager"].to_numpy(), joined["fp32"].to_numpy())}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=DRIFT_COLUMNS)


def seed_noise(steps: pd.DataFrame, run_id: str, mode: str, seeds: dict[str, int]) -> float:
    """The eager recipe's loss spread across its seeds, relative: median over steps of (max - min) / |mean| of
    the seed replicates; NaN with fewer than two seeds."""
    lanes = steps[(steps["run_id"] == run_id) & (steps["mode"] == mode)]
    if lanes["lane"].nunique() < 2 or not all(f"{run_id}/{int(lane)}" in seeds for lane in lanes["lane"].unique()):
        return float("nan")
    table = lanes.pivot_table(index="step", columns="lane", values="loss").dropna()
    if table.empty:
        return float("nan")
    spread = (table.max(axis=1) - table.min(axis=1)) / table.mean(axis=1).abs()
    return float(np.nanmedian(spread.to_numpy()))


def drift_summary(drift: pd.DataFrame, steps: pd.DataFrame, seeds: dict[str, int]) -> pd.DataFrame:
    """One row per compiled lane: its median and largest |relative loss difference| from the eager lane of its
    recipe, the same against 32-true beside the eager lane's, and the seed noise it is judged against."""
    rows = []
    for (run_id, lane, mode, seed), frame in drift.groupby(["run_id", "lane", "mode", "seed"], sort=False):
        vs_eager = np.abs(frame["vs_eager"].to_numpy(dtype=float))
        noise = seed_noise(steps, run_id, eager_recipe(mode), seeds)
        median = float(np.nanmedian(vs_eager)) if len(vs_eager) else float("nan")
        if np.isnan(noise):
            verdict = "one seed: no noise to judge by"  # DRIFT_NOTE: seeds >= 2 tell drift from noise
        elif median <= noise:
            verdict = "within seed noise"
        else:
            verdict = f"{median / noise:.1f}x the seed noise" if noise > 0 else "beyond seed noise"
        rows.append({"run_id": run_id, "lane": int(lane), "recipe": mode, "seed": int(seed), "steps": len(frame),
                     "median |drift vs eager|": median,
                     "max |drift vs eager|": float(np.nanmax(vs_eager)) if len(vs_eager) else float("nan"),
                     "median |vs 32-true| compiled": float(np.nanmedian(np.abs(frame["vs_fp32"].to_numpy(float)))),
                     "median |vs 32-true| eager": float(np.nanmedian(np.abs(frame["eager_vs_fp32"].to_numpy(float)))),
                     "seed noise": noise, "verdict": verdict})
    return pd.DataFrame(rows)


def drift_figure(drift: pd.DataFrame, labels: dict[str, str] | None = None) -> go.Figure:
    """Relative loss difference of each compiled lane from its eager twin, step by step."""
    fig = go.Figure()
    for (run_id, lane), frame in drift.groupby(["run_id", "lane"], sort=False):
        key = f"{run_id}/{int(lane)}"
        name = (labels or {}).get(key, f"{frame['mode'].iloc[0]} (seed {int(frame['seed'].iloc[0])})")
        fig.add_trace(go.Scatter(x=frame["step"], y=frame["vs_eager"], mode="lines", name=f"{name} vs eager"))
    fig.add_hline(y=0, line_dash="dot", line_color="grey")
    fig.update_layout(title="Compiled vs eager: (loss compiled − loss eager) / |loss eager|", xaxis_title="step",
                      yaxis_title="relative loss difference", height=360, margin={"t": 50, "b": 40})
    return fig


def _data(row) -> dict:
    return row["data"] if isinstance(row["data"], dict) else {}


def compile_summary(events: pd.DataFrame, lanes_info: Sequence[LaneInfo]) -> pd.DataFrame:
    """One row per compiled lane, from the run's events: its first compile's time, graphs, graph breaks (named, with
    dynamo's reason), recompiles (each with its reason) and their time, storms, slow-compile warnings."""
    rows = []
    for lane in lanes_info:
        if not is_compiled_recipe(lane.mode):
            continue
        index = lane.lane
        mine = events[events["lane"] == index] if len(events) else events
        compiled = [_data(row) for _, row in mine.iterrows() if row["kind"] == COMPILED_EVENT]
        recompiles = [_data(row) for _, row in mine.iterrows() if row["kind"] == RECOMPILE_EVENT]
        breaks = [_data(row) for _, row in mine.iterrows() if row["kind"] == GRAPH_BREAK_EVENT]
        first = compiled[0] if compiled else {}
        rows.append({
            "lane": index, "recipe": lane.mode, "status": lane.status,
            "compile s": round(first["compile_ms"] / 1e3, 2) if "compile_ms" in first else float("nan"),
            "graphs": first.get("graphs", float("nan")), "graph breaks": first.get("graph_breaks", float("nan")),
            "break reasons": "; ".join(f"{b.get('what', '')}" + (f" ({b['why']})" if b.get("why") else "")
                                       for b in breaks) or "none",
            "recompiles": len(recompiles),
            "recompile s": round(sum(r.get("compile_ms", 0.0) for r in recompiles) / 1e3, 2),
            "recompile reasons": "; ".join(dict.fromkeys(str(r.get("reason") or "new frame") for r in recompiles))
                                 or "none",
            "storm": "yes" if (mine["kind"] == RECOMPILE_STORM_EVENT).any() else "no",
            "slow-compile warnings": int((mine["kind"] == COMPILE_SLOW_EVENT).sum()),
            "error": lane.error if lane.status == "failed" else "",
        })
    return pd.DataFrame(rows)


TRAIN_COLUMNS = ["lane", "recipe", "status", "compile s", "graphs", "graph breaks", "break reasons", "recompiles",
                 "recompile reasons", "storm"]
"""The compile summary's columns the Train page shows (the rest are on Compare and in the report)."""


def train_table(summary: pd.DataFrame) -> pd.DataFrame:
    """`compile_summary`'s TRAIN_COLUMNS as the Train page shows them: a lane whose first compile has not ended yet
    has "–" for its compile time, graphs and graph breaks (a table would draw its missing numbers as a grey None)."""
    shown = summary[TRAIN_COLUMNS].copy()
    for column, text in (("compile s", "{:g}"), ("graphs", "{:.0f}"), ("graph breaks", "{:.0f}")):
        shown[column] = ["–" if pd.isna(value) else text.format(value) for value in shown[column]]
    return shown


COMPARE_DRIFT_HEADERS = {"median |drift vs eager|": "median |drift|", "max |drift vs eager|": "max |drift|",
                         "median |vs 32-true| compiled": "vs 32-true, compiled",
                         "median |vs 32-true| eager": "vs 32-true, eager"}
"""The drift summary's headers as Compare shows them (the report keeps the long ones; DRIFT_NOTE says what each is)."""


def _short_runs(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with its run_id column as the short run id the lane labels carry ("32-true · c60155")."""
    from amp_core.views.compare import short_run_id

    shown = table.drop(columns="run_id")
    shown.insert(0, "run", [short_run_id(run_id) for run_id in table["run_id"]])
    return shown


def compare_tables(compiles: pd.DataFrame, drift_table: pd.DataFrame
                   ) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """`compiled_view`'s compile summary and drift summary as the Compare page shows them, every column inside the
    page's width: the run as its short id, the columns that say nothing for these lanes left out (no slow-compile
    warning, no failed lane, no recompile), the drift headers short, and each compiled lane's verdict as a sentence
    under the table (returned third) rather than a column cut at the page's edge."""
    compiles = _short_runs(compiles)
    empty = [column for column, nothing in (("slow-compile warnings", 0), ("error", ""))
             if (compiles[column].fillna(nothing) == nothing).all()]
    if (compiles["recompiles"] == 0).all():  # the recompiles column says so
        empty += ["recompile s", "recompile reasons"]
    compiles = compiles.drop(columns=empty)
    if drift_table.empty:
        return compiles, drift_table, []
    drift = _short_runs(drift_table).rename(columns=COMPARE_DRIFT_HEADERS)
    drift["seed noise"] = ["–" if pd.isna(noise) else f"{noise:.4g}" for noise in drift["seed noise"]]  # one seed
    verdicts = [f"**{row['recipe']} · {row['run']}** (seed {row['seed']}) against its eager twin: {row['verdict']}"
                for _, row in drift.iterrows()]
    return compiles, drift.drop(columns="verdict"), verdicts


COMPILE_NOTE = ("Compile time is its own figure: each compiled lane compiles once before its first step, on a batch "
                "of the training's shape it does not train on, so step times exclude it; a recompile later in the run "
                "is an event with its guard failure and its time (that step's record still holds it; step-time views "
                "take the median). Graph breaks and their reasons are dynamo's own counters; recompile reasons are "
                "its guard failures.")
DRIFT_NOTE = ("Drift = (loss compiled − loss eager) / |loss eager| per step, against the eager lane of the same recipe "
              "and seed in the same run (same weights, same batches); vs 32-true the same against that seed's 32-true "
              "lane. Seed noise = median over steps of the eager recipe's (max − min) / |mean| across seeds: with one "
              "seed there is none, and drift cannot be told from noise (race seeds >= 2).")


def compiled_view(reader: RunReader, run_ids: Sequence[str]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(compile summary, drift per step, drift summary) of the compiled lanes of `run_ids` (a RunReader's runs);
    every lane of those runs is read, so a compiled lane's eager twin counts even when it is not on show."""
    from amp_core.views.compare import gather_steps
    from amp_core.views.summary import lane_seeds

    tables, keys, seeds = [], [], {}
    for run_id in run_ids:
        info = reader.run_info(run_id)
        if info is None or not has_compiled(lane.mode for lane in info.lanes):
            continue
        table = compile_summary(reader.events(run_id), info.lanes)
        table.insert(0, "run_id", run_id)
        tables.append(table)
        keys += [f"{run_id}/{lane.lane}" for lane in info.lanes]
        seeds.update(lane_seeds(run_id, info.lanes))
    if not tables:
        return pd.DataFrame(), pd.DataFrame(columns=DRIFT_COLUMNS), pd.DataFrame()
    steps = gather_steps(reader, keys)
    drift = drift_frame(steps, seeds)
    return pd.concat(tables, ignore_index=True), drift, drift_summary(drift, steps, seeds)


# --- a compiled lane's own compile, as the op inspector shows it (amp_core.race.compiled.LaneCompile) -----------------
def compiled_lanes(info) -> dict[int, str]:
    """A run's compiled lanes (RunInfo): lane -> recipe."""
    return {lane.lane: lane.mode for lane in info.lanes if is_compiled_recipe(lane.mode)} if info else {}


def capture_label(capture) -> str:
    """One compile of a lane as a picker lists it."""
    ids = ", ".join(capture.compile_ids)
    if capture.trigger == "recompile":
        reason = " ".join((capture.reason or "no guard failed").splitlines()[0].split())
        return f"recompile at step {capture.step} ({ids}): {reason[:120]}"
    return f"{capture.trigger} ({ids})" + (" · reused" if capture.reused else "")


def cast_counts(capture) -> dict[str, int | None]:
    """The casts of one compile against eager's: eager's cast ops (same step, eager copy), casts in the compiled
    graphs, kernels that only cast (kept), kernels that cast and compute (fused away)."""
    summary = capture.summary
    return {"eager": capture.eager_casts, "graph": summary.graph_casts, "kept": summary.kept_cast_kernels,
            "fused": summary.fusing_kernels, "kernels": summary.generated_kernels}
