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
