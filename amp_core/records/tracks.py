"""Step records in memory, columnar: per track (one lane's records from one rank) compact numpy columns grown in
chunks, the rows of its marks (skipped steps, non-finite figures) and the complete buckets of every summary level.

One writer thread appends; readers on any thread read a published snapshot (row count + pending rows) and never see a
half-written row. `append` (the training thread, once per lane step) only adds a tuple to a list: the rows become
columns FOLD_ROWS at a time, and buckets are completed when the sink flushes (`seal`), off the per-step path.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np
import pandas as pd

from amp_core.records.columns import ChunkedColumns
from amp_core.records.levels import (
    BLOCK_BUCKETS,
    BUCKET_COLUMNS,
    LEVEL_BASE,
    LEVEL_FACTOR,
    MAX_LEVEL,
    Buckets,
    from_records,
    level_steps,
    merge,
)
from amp_core.records.schema import (
    MARK_COLUMNS,
    SAMPLED_COLUMNS,
    STEP_COLUMNS,
    StepRecord,
    empty_steps_frame,
    steps_frame,
    typed,
)

FOLD_ROWS = 256
"""Pending rows become numpy columns this many at a time (a list append is all a step pays)."""
_values_of = operator.attrgetter(*STEP_COLUMNS)
_NAMES = tuple(STEP_COLUMNS)


def columns_from_rows(rows: Sequence[tuple]) -> dict[str, np.ndarray]:
    """Rows of values in STEP_COLUMNS order (None for a missing figure) as typed columns."""
    if not rows:
        return {name: np.empty(0, dtype=dtype) for name, dtype in STEP_COLUMNS.items()}
    matrix = np.array(rows, dtype=np.float64)  # None -> NaN; ints and bools are exact in float64 below 2**53
    return {name: typed(matrix[:, i], dtype) for i, (name, dtype) in enumerate(STEP_COLUMNS.items())}


def marked(columns: dict[str, np.ndarray]) -> np.ndarray:
    """Rows that are skipped steps or hold a non-finite figure (their records are kept exactly, apart)."""
    mask = np.asarray(columns["skipped"], dtype=bool).copy()
    for name in MARK_COLUMNS:
        mask |= ~np.isfinite(columns[name])
    for name in SAMPLED_COLUMNS:
        mask |= np.isinf(columns[name])
    return np.flatnonzero(mask)


class TrackRecords:
    """One track's records in memory; also a track source for the readers in `amp_core.records.query`."""

    def __init__(self, run_id: str, lane: int, mode: str, rank: int = 0):
        self.run_id, self.lane, self.mode, self.rank = run_id, lane, mode, rank
        self.problems: list[str] = []
        self.raw = ChunkedColumns(STEP_COLUMNS)
        self.mark_rows = ChunkedColumns({"row": np.int64, "step": np.int64}, first_chunk_rows=16)
        self._pending: list[tuple] = []
        self._state: tuple[int, list[tuple]] = (0, self._pending)
        """Published snapshot: rows held as columns, and the list of rows not yet folded into them."""
        self._levels: list[ChunkedColumns] = []
        self._bounds: tuple[int, ...] = ()
        """Published per level (index 0: level 1): bucket ids below the bound are complete."""
        self._level1_row = 0
        self._merged: list[int] = []
        self._last_step = -1
        self._median = (-1, math.nan)

    # --- writing (one thread) ------------------------------------------------------------------------------
    def append(self, record: StepRecord) -> None:
        self.append_row(_values_of(record))

    def append_row(self, row: tuple) -> None:
        """One record as its values in STEP_COLUMNS order (None for a figure not measured): what a step recorder
        appends, without building a StepRecord."""
        step = row[0]
        if step <= self._last_step:
            raise ValueError(f"lane {self.lane} rank {self.rank}: step {step} after step {self._last_step}; "
                             "a track's steps must increase")
        self._pending.append(row)
        self._last_step = step
        if len(self._pending) >= FOLD_ROWS:
            self._fold()

    def extend(self, columns: dict[str, np.ndarray]) -> None:
        """Many records at once (every STEP_COLUMNS column; steps increasing, after the last one held)."""
        self._fold()
        steps = np.asarray(columns["step"], dtype=np.int64)
        if len(steps) == 0:
            return
        if steps[0] <= self._last_step or (np.diff(steps) <= 0).any():
            raise ValueError(f"lane {self.lane} rank {self.rank}: steps must increase (after {self._last_step})")
        self._append_columns({name: np.asarray(columns[name], dtype=dtype) for name, dtype in STEP_COLUMNS.items()})
        self._last_step = int(steps[-1])

    def _fold(self) -> None:
        if self._pending:
            pending = self._pending
            self._pending = []
            self._append_columns(columns_from_rows(pending))

    def _append_columns(self, columns: dict[str, np.ndarray]) -> None:
        base = self.raw.count
        self.raw.extend(columns)
        rows = marked(columns)
        if len(rows):
            self.mark_rows.extend({"row": rows + base, "step": columns["step"][rows]})
        self._state = (self.raw.count, self._pending)

    def seal(self) -> list[tuple[int, int]]:
        """Fold pending rows and complete every bucket that can be; returns the (level, block) newly complete."""
        self._fold()
        count, last = self.raw.count, self._last_step
        if count == 0:
            return []
        bounds, existed = list(self._bounds), len(self._levels)
        steps = self.raw.column("step", self._level1_row, count)
        done = int(np.searchsorted(steps, (last // LEVEL_BASE) * LEVEL_BASE))
        if done:
            self._add_buckets(1, from_records(self.raw.rows(self._level1_row, self._level1_row + done), LEVEL_BASE))
            self._level1_row += done
        new_bounds = [last // level_steps(level) for level in range(1, MAX_LEVEL + 1)]
        for level in range(2, MAX_LEVEL + 1):
            if new_bounds[level - 1] == 0 or len(self._levels) < level - 1:
                break
            children, start = self._levels[level - 2], self._merged[level - 2]
            parents = children.column("id", start) // LEVEL_FACTOR
            take = int(np.searchsorted(parents, new_bounds[level - 1]))
            if take:
                self._add_buckets(level, merge(children.rows(start, start + take), parents[:take]))
                self._merged[level - 2] += take
        blocks = []
        for level, bound in enumerate(new_bounds[:len(self._levels)], start=1):
            old = bounds[level - 1] if level <= min(len(bounds), existed) else 0
            blocks += [(level, block) for block in range(old // BLOCK_BUCKETS, bound // BLOCK_BUCKETS)]
        self._bounds = tuple(new_bounds)
        return blocks

    def _add_buckets(self, level: int, buckets: Buckets) -> None:
        while len(self._levels) < level:
            self._levels.append(ChunkedColumns({name: dtype for name, (dtype, _) in BUCKET_COLUMNS.items()},
                                               max_chunk_rows=1024, first_chunk_rows=16,
                                               shapes={name: shape for name, (_, shape) in BUCKET_COLUMNS.items()}))
            self._merged.append(0)
        self._levels[level - 1].extend(buckets)

    # --- reading (any thread) ------------------------------------------------------------------------------
    def _snapshot(self) -> tuple[int, list[tuple]]:
        count, pending = self._state
        return count, pending[:len(pending)]

    def extent(self) -> tuple[int, int, int]:
        """(records, first step, last step); (0, 0, -1) when there are none."""
        count, pending = self._snapshot()
        if count + len(pending) == 0:
            return 0, 0, -1
        first = int(self.raw.column("step", 0, 1)[0]) if count else pending[0][0]
        last = pending[-1][0] if pending else int(self.raw.column("step", count - 1, count)[0])
        return count + len(pending), first, last

    def __len__(self) -> int:
        return self.extent()[0]

    def _row_of(self, step: int, count: int) -> int:
        """The first row (below `count`) whose step is >= `step`."""
        return self.raw.search("step", step, count)

    def raw_rows(self, start: int, stop: int, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Records with step in [start, stop): the named columns (and `step`)."""
        names = list(dict.fromkeys(["step", *(names or _NAMES)]))
        count, pending = self._snapshot()
        out = self.raw.rows(self._row_of(start, count), self._row_of(stop, count), names)
        if pending:
            extra = columns_from_rows(pending)
            keep = (extra["step"] >= start) & (extra["step"] < stop)
            if keep.any():
                out = {name: np.concatenate([out[name], extra[name][keep]]) for name in names}
        return out

    def tail(self, records: int, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The last `records` records."""
        names = list(dict.fromkeys(["step", *(names or _NAMES)]))
        count, pending = self._snapshot()
        from_columns = max(0, records - len(pending))
        out = self.raw.rows(max(0, count - from_columns), count, names)
        if pending:
            extra = columns_from_rows(pending[-records:])
            out = {name: np.concatenate([out[name], extra[name]]) for name in names}
        return out

    def level_bound(self, level: int) -> int:
        bounds = self._bounds
        return bounds[level - 1] if level <= len(bounds) and level <= len(self._levels) else 0

    def complete(self, level: int, lo: int, hi: int, names=None) -> Buckets:
        """Complete buckets of `level` with ids in [lo, hi) (hi at most `level_bound(level)`); every column (held
        decoded, `names` costs nothing to ignore)."""
        columns = self._levels[level - 1]
        count = columns.count
        return columns.rows(columns.search("id", lo, count), columns.search("id", hi, count))

    def marks(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Every marked record (skipped, or a non-finite figure) with step in [start, stop): all its columns."""
        count, pending = self._snapshot()
        marks = self.mark_rows
        rows = marks.rows(marks.search("step", start), marks.search("step", stop))
        picked = rows["row"][rows["row"] < count]
        out = {name: self.raw.take(name, picked) for name in STEP_COLUMNS}
        if pending:
            extra = columns_from_rows(pending)
            rows = marked(extra)
            rows = rows[(extra["step"][rows] >= start) & (extra["step"][rows] < stop)]
            if len(rows):
                out = {name: np.concatenate([out[name], extra[name][rows]]) for name in out}
        return out

    def median_step_ms(self) -> float:
        """The exact median step time of every record (remembered until a record is added)."""
        records = self.extent()[0]
        known, value = self._median
        if known != records:
            times = self.tail(records, ["step_ms"])["step_ms"] if records else np.empty(0)
            value = float(np.median(times)) if len(times) else math.nan
            self._median = (records, value)
        return value

    def stats(self) -> dict:
        """What the store keeps with a finished track so a reader needs no scan: the exact median step time."""
        return {"median_step_ms": self.median_step_ms()}

    def nbytes(self) -> int:
        return self.raw.nbytes() + self.mark_rows.nbytes() + sum(level.nbytes() for level in self._levels)


class RunRecords:
    """A run's tracks in memory, keyed by (lane, rank); what a RecordSink holds and in-process readers read."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._tracks: dict[tuple[int, int], TrackRecords] = {}
        self._published: tuple[TrackRecords, ...] = ()

    def track(self, lane: int, mode: str, rank: int = 0) -> TrackRecords:
        """The track of (lane, rank), created on first use."""
        found = self._tracks.get((lane, rank))
        if found is None:
            found = self._tracks[(lane, rank)] = TrackRecords(self.run_id, lane, mode, rank)
            self._published = tuple(sorted(self._tracks.values(), key=lambda t: (t.lane, t.rank)))
        return found

    def append(self, record: StepRecord) -> None:
        track = self._tracks.get((record.lane, record.rank))
        if track is None:
            track = self.track(record.lane, record.mode, record.rank)
        track.append(record)

    def tracks(self) -> tuple[TrackRecords, ...]:
        """Every track, in (lane, rank) order (a snapshot: safe while the writer adds tracks)."""
        return self._published

    def __len__(self) -> int:
        return sum(len(track) for track in self._published)

    def frame(self, since: int = 0) -> pd.DataFrame:
        """Records of steps >= `since` of every track, ordered by step, then lane and rank (as the runner wrote
        them)."""
        parts = [(t.run_id, t.lane, t.mode, t.rank, t.raw_rows(since, np.iinfo(np.int64).max))
                 for t in self._published]
        parts = [part for part in parts if len(part[-1]["step"])]
        if not parts:
            return empty_steps_frame()
        frame = steps_frame(parts)
        if len(parts) > 1:
            order = np.lexsort((frame["rank"].to_numpy(), frame["lane"].to_numpy(), frame["step"].to_numpy()))
            frame = frame.iloc[order].reset_index(drop=True)
        return frame
