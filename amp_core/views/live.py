"""What the Train page's live view reads: a run's lanes through the multi-resolution summary; how its headline
figures read."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from amp_core.precision import BASELINE_MODE
from amp_core.records.query import MAX_POINTS, LaneSeries
from amp_core.records.schema import WHAT_RAN_EVENTS
from amp_core.runs import RunInfo, RunReader, SourceKind, is_live
from amp_core.views.plots import StepTimeBands
from amp_core.views.summary import default_baseline, summarize
from amp_core.views.tables import TABLE_WIDTH_PX, content_widths


class RecordFollower:
    """Follows one run for a live view: each `update` reads every lane of the run through the summary, so a redraw
    reads a few thousand points however long the run is.

    A run held by this process is read from its in-memory tracks. A run known only from the store (finished, or
    written by another process) is read through StoredTracks the follower keeps between updates: what never changes
    (complete summary blocks, chunks but the last) is read once, so each update reads only what is new.
    """

    def __init__(self, run_id: str, max_points: int = MAX_POINTS):
        self.run_id = run_id
        self.max_points = max_points
        self.series: list[LaneSeries] = []
        self.bands = StepTimeBands()
        """The step-time bands of the run's finished buckets, kept between updates."""
        self._sources: list = []

    def update(self, reader: RunReader) -> list[LaneSeries]:
        """Read the run through `reader`; returns its lanes (also kept in `series`)."""
        self._sources = reader.track_sources(self.run_id, reuse=self._sources)
        self.series = reader.lane_series(self.run_id, max_points=self.max_points, sources=self._sources)
        return self.series


def format_ratio(value: float) -> str:
    """1.234 -> '1.23×'; NaN -> '–'."""
    return "–" if value is None or not math.isfinite(value) else f"{value:.2f}×"


def format_scale(value: float) -> str:
    """65536.0 -> '2^16'; a scale that is not a power of two in its natural form; NaN -> 'no scaler'."""
    if value is None or not np.isfinite(value) or value <= 0:
        return "no scaler"
    exponent = math.log2(value)
    return f"2^{int(exponent)}" if exponent.is_integer() else f"{value:g}"


LANE_COLUMNS = {
    "lane": "The precision mode of the lane (and its seed, in a run with several seeds per mode).",
    "status": "What the lane is doing now (a lane of a paused run is paused).",
    "steps": "Steps done of the steps asked.",
    "progress": "Steps done of the steps asked.",
    "loss now": "The loss of the lane's last step (Compare also shows the mean of the last k steps).",
    "ms/step": "Median time of one step of this lane: one slow step does not move it.",
    "speed": "The baseline lane's median ms/step ÷ this lane's: above 1× is faster than the baseline.",
    "memory": "The lane's own peak memory ÷ the baseline lane's: what the lane holds plus, on CUDA, its step's "
              "allocator peak above the step's start (other lanes do not inflate it).",
    "skipped": "Optimizer steps the GradScaler skipped (inf/NaN gradients).",
    "scale": "The GradScaler's loss scale at the last step (only 16-mixed has one).",
}
"""The live lanes table's columns, with what each means (the page's help on hover)."""


def lane_status(run_status: str, lane_status: str) -> str:
    """What a lane is doing, in one word: a running lane of a paused run is paused."""
    return "paused" if run_status == "paused" and lane_status == "running" else lane_status


def lanes_table(info: RunInfo, series: list[LaneSeries]) -> pd.DataFrame:
    """One row per lane of a run (`RunReader.run_info`), its figures from `series`: every figure of the run's
    headline, readable whole in a narrow table however many lanes there are (LANE_COLUMNS)."""
    total = int(info.settings.steps)
    alone = len(info.lanes) == 1
    replicated = len({lane.mode for lane in info.lanes}) < len(info.lanes)
    heads = summarize(series).set_index("lane") if series else pd.DataFrame()
    rows = []
    for lane in info.lanes:
        fraction, done = progress(lane.steps_done, total)
        seed = lane.meta.get("seed")
        label = f"{lane.mode} · seed {seed}" if replicated and seed is not None else lane.mode
        row = {"lane": label, "status": lane_status(info.status, lane.status),
               "steps": done, "progress": fraction if total > 0 else None}  # an unknown length: no bar
        head = heads.loc[lane.lane] if lane.lane in heads.index else None
        row.update({
            "loss now": "–" if head is None else f"{head['latest_loss']:.4g}",
            "ms/step": "–" if head is None else f"{head['median_ms']:.3g}",
            # One lane (a Monitor's run) has nothing to compare with: no 1.00× against itself.
            "speed": "–" if head is None or alone else format_ratio(head["speedup"]),
            "memory": "–" if head is None or alone else format_ratio(head["mem_ratio"]),
            "skipped": "–" if head is None else f"{int(head['skipped_steps']):,}",
            "scale": "–" if head is None else format_scale(head["scale"]),
        })
        rows.append(row)
    return pd.DataFrame(rows, columns=list(LANE_COLUMNS))


def baseline_mode(series: list[LaneSeries]) -> str:
    """The mode the speed and memory ratios of a live run are against (its first 32-true lane, else its first)."""
    key = default_baseline(series)
    return next((lane.mode for lane in series if lane.key == key), BASELINE_MODE)


PROGRESS_PX = 110
"""The lane table's progress bar column (a drawn bar, not text: its width is fixed)."""


def lane_headers(table: pd.DataFrame, base: str) -> tuple[dict[str, str], dict[str, int], str]:
    """The lane table's headers, text columns' pixel widths and a caption: "speed vs BASE" / "memory vs BASE" where
    every column then fits the page's table width, else "speed" / "memory" and one caption naming `base` (a long
    baseline's name in two headers would push the last column out of sight)."""
    text = table.drop(columns="progress")
    labels = {"speed": f"speed vs {base}", "memory": f"memory vs {base}"}
    widths = content_widths(text, labels)
    if "speed" not in table or sum(widths.values()) + PROGRESS_PX <= TABLE_WIDTH_PX:
        return labels, widths, ""
    labels = {"speed": "speed", "memory": "memory"}
    return labels, content_widths(text, labels), f"Speed and memory: each lane against {base}."


def lane_medians(series: list[LaneSeries]) -> dict[str, tuple[float, int]]:
    """{mode: (median ms/step, records)} of a run's lanes (rank 0): what its run teaches the cost probe."""
    return {lane.mode: (float(lane.stats.median_step_ms), int(lane.stats.records)) for lane in series
            if lane.rank == 0}


def control_note(info: RunInfo) -> str:
    """Why a run that is still going offers no pause or stop on this page ('' when it does, or has ended): another
    process runs it, a Monitor in the user's own script or a CLI run (or a torchrun job of either)."""
    if info.controllable or not is_live(info):
        return ""
    ranks = info.settings.world_size
    job = f" (a torchrun job of {ranks} ranks)" if ranks > 1 else ""
    where = f", pid {info.pid} on {info.host}" if info.pid else ""
    if info.attached:
        owner = f"that {info.settings.integration}" if info.kind is SourceKind.INTEGRATION else \
            "that script (its own loop decides)"
        return (f"Watched live: {info.writer}{where}{job} writes this run. Pause and stop belong to {owner}, so they "
                "are not offered here.")
    return (f"Watched live: {info.writer}{where}{job} writes this run (e.g. `amp-lab run`), so pause and stop are "
            "not offered here: stop it where it runs (Ctrl-C).")


def what_ran_warnings(events: pd.DataFrame) -> list[str]:
    """The messages of a run's events about what really ran (a precision asked and not applied, fp16 without loss
    scaling), once each, in order."""
    if events.empty:
        return []
    return list(dict.fromkeys(events.loc[events["kind"].isin(WHAT_RAN_EVENTS), "message"].astype(str)))


def progress(done: int, total: int) -> tuple[float, str]:
    """(fraction for a progress bar, 'done/total' or 'done steps') — a Monitor's run may not know its total."""
    if total and total > 0:
        return min(1.0, done / total), f"{done:,} / {total:,}"
    return 0.0, f"{done:,} steps"
