"""What the Train page's live view reads: a run's lanes through the multi-resolution summary; how its headline
figures read."""

from __future__ import annotations

import math

import numpy as np

from amp_core.records.query import MAX_POINTS, LaneSeries


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
        self._sources: list = []

    def update(self, manager) -> list[LaneSeries]:
        """Read the run through `manager` (a RunManager); returns its lanes (also kept in `series`)."""
        self._sources = manager.track_sources(self.run_id, reuse=self._sources)
        self.series = manager.lane_series(self.run_id, max_points=self.max_points, sources=self._sources)
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


def control_note(info: dict, held_here: bool) -> str:
    """Why a run that is still going offers no pause or stop on this page ('' when it does, or has ended): another
    process runs it, a Monitor in the user's own script or a CLI run (or a torchrun job of either)."""
    if held_here or info["status"] not in ("pending", "running", "paused"):
        return ""
    config = info["config"]
    ranks = config.get("world_size", 1)
    job = f" (a torchrun job of {ranks} ranks)" if ranks > 1 else ""
    if config.get("source") == "monitor":
        script = f"`{config['script']}`" if config.get("script") else "a script"
        where = f", pid {config['pid']} on {config['host']}" if config.get("pid") else ""
        return (f"Watched live: a Monitor in {script}{where}{job} writes this run. Pause and stop belong to that "
                "script (its own loop decides), so they are not offered here.")
    return (f"Watched live: another process{job} writes this run (e.g. `amp-lab run`), so pause and stop are not "
            "offered here: stop it where it runs (Ctrl-C).")


def progress(done: int, total: int) -> tuple[float, str]:
    """(fraction for a progress bar, 'done/total' or 'done steps') — a Monitor's run may not know its total."""
    if total and total > 0:
        return min(1.0, done / total), f"{done}/{total}"
    return 0.0, f"{done} steps"
