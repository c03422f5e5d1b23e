"""What one flush writes for a track: its new records as a chunk (one encoded array per column, the marked records
apart) and the summary blocks that became complete. The sink and the store's migration both write through here.

A chunk row: (run_id, lane, rank, first_step, last_step, records, marks, marks_data) in `chunks`, and one row per
column in `chunk_columns` (run_id, lane, rank, name, first_step, data = `codec.encode_array` of the column), so a
reader decodes only the columns it needs. A chunk of fewer than CHUNK_MIN records (a slow run's flush) is rewritten
with the next flush's records, so a day of slow steps is not a million tiny rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from amp_core.records.codec import encode_array, encode_columns, encode_rows
from amp_core.records.levels import BLOCK_BUCKETS, LEVEL_BASE, MAX_LEVEL
from amp_core.records.tracks import TrackRecords

CHUNK_MIN = 256
CHUNK_MAX = 8192


@dataclass(slots=True)
class ChunkRow:
    first_step: int
    last_step: int
    records: int
    columns: dict[str, bytes]
    marks: int
    marks_data: bytes | None


@dataclass(slots=True)
class TrackFlush:
    """A track's part of one flush (written in the flush's one transaction)."""

    lane: int
    rank: int
    mode: str
    records: int
    first_step: int
    last_step: int
    t_last: float
    chunks: list[ChunkRow] = field(default_factory=list)
    blocks: list[tuple[int, int, bytes]] = field(default_factory=list)
    """(level, block, encoded buckets) of newly complete blocks."""
    stats: dict | None = None
    """Set on the last flush of a track: what a reader then needs no scan for."""
    written: tuple[int, int, int] = (0, 0, 0)
    """What the writer holds once this flush is committed: (rows stored, first row of the last chunk, its records)."""


def encode_chunk(track: TrackRecords, start: int, stop: int) -> ChunkRow:
    """Rows [start, stop) of a track as a chunk row."""
    columns = track.raw.rows(start, stop)
    marks = track.mark_rows
    rows = marks.column("row", marks.search("row", start), marks.search("row", stop)) - start
    marks_data = encode_rows({name: values[rows] for name, values in columns.items()}) if len(rows) else None
    steps = columns["step"]
    return ChunkRow(int(steps[0]), int(steps[-1]), stop - start, {name: encode_array(values)
                                                                    for name, values in columns.items()},
                    len(rows), marks_data)


def encode_marks(track: TrackRecords, start: int, stop: int) -> ChunkRow | None:
    """Only the marked rows (skipped steps, non-finite figures) of rows [start, stop), as a chunk row (None: none)."""
    marks = track.mark_rows
    rows = marks.column("row", marks.search("row", start), marks.search("row", stop))
    if not len(rows):
        return None
    columns = {name: track.raw.take(name, rows) for name in track.raw.dtypes}
    steps = columns["step"]
    return ChunkRow(int(steps[0]), int(steps[-1]), len(rows), {name: encode_array(values)
                                                                for name, values in columns.items()},
                    len(rows), encode_rows(columns))


@dataclass(frozen=True, slots=True)
class Dropped:
    """Detail a writer gave up on (its store was unreachable past the backlog bound); the summary covers it."""

    lane: int
    rank: int
    first_step: int
    last_step: int
    records: int
    marks_kept: int


class TrackWriter:
    """Which of a track's records the store holds; builds what the next flush writes (`pending`), and moves on only
    once that flush committed (`committed`). Summary blocks and kept marks wait here until a flush commits them."""

    def __init__(self, track: TrackRecords):
        self.track = track
        self.stored_rows = 0
        self.open_chunk = (0, 0)
        """(first row, records) of the last chunk written."""
        self.detail_from = 0
        """Rows below this (and not yet stored) are dropped: only their marks go to the store (see `drop`)."""
        self._blocks: list[tuple[int, int]] = []
        self._kept: list[ChunkRow] = []

    def held(self) -> int:
        """Rows the store does not hold yet (their detail still to be written)."""
        return self.track.raw.count - max(self.stored_rows, self.detail_from)

    def due(self, blocks: list[tuple[int, int]]) -> None:
        """Summary blocks `track.seal()` completed: written with the next flush that commits."""
        self._blocks += blocks

    def pending(self, blocks: list[tuple[int, int]], final: bool = False) -> TrackFlush | None:
        """Call after `track.seal()` (every row is a column then), with the blocks it completed."""
        track = self.track
        count = track.raw.count
        self.due(blocks)
        resume = max(self.stored_rows, self.detail_from)
        if count == resume and not self._blocks and not self._kept and not final:
            return None
        records, first, last = track.extent()
        out = TrackFlush(track.lane, track.rank, track.mode, records, first, last,
                         float(track.raw.column("t_wall_s", count - 1, count)[0]) if count else 0.0,
                         chunks=list(self._kept))
        open_row, open_records = self.open_chunk
        rewrite = 0 < open_records < CHUNK_MIN and count > resume == self.stored_rows
        start = open_row if rewrite else resume
        piece = (open_row, open_records) if resume == self.stored_rows else (resume, 0)
        while start < count:
            stop = min(count, start + CHUNK_MAX)
            out.chunks.append(encode_chunk(track, start, stop))
            piece, start = (start, stop - start), stop
        for level, block in self._blocks:
            buckets = track.complete(level, block * BLOCK_BUCKETS, (block + 1) * BLOCK_BUCKETS)
            if len(buckets["id"]):
                out.blocks.append((level, block, encode_columns(buckets)))
        if final:
            out.stats = {"records": records, **track.stats()}
        out.written = (count, *piece)
        return out

    def committed(self, flush: TrackFlush) -> None:
        count, open_row, open_records = flush.written
        self.stored_rows, self.open_chunk = count, (open_row, open_records)
        self._blocks, self._kept = [], []

    def drop(self, records: int) -> Dropped | None:
        """Give up on the detail of up to `records` of the oldest rows not yet stored, within the summarised steps
        (complete level-1 blocks, which the store gets): their marks are kept and written. None: nothing to drop."""
        track = self.track
        start = max(self.stored_rows, self.detail_from)
        summarised = track.level_bound(1) // BLOCK_BUCKETS * BLOCK_BUCKETS * LEVEL_BASE
        stop = min(start + records, track.raw.search("step", summarised, track.raw.count))
        if stop <= start:
            return None
        kept = encode_marks(track, start, stop)
        if kept is not None:
            self._kept.append(kept)
        self.detail_from = stop
        steps = track.raw.column("step", start, stop)
        return Dropped(track.lane, track.rank, int(steps[0]), int(steps[-1]), stop - start,
                       kept.records if kept else 0)


def encode_track(track: TrackRecords) -> TrackFlush | None:
    """All of a track at once (a migrated store, a bulk import): every chunk and every complete block."""
    track.seal()
    blocks = [(level, block) for level in range(1, MAX_LEVEL + 1)
              for block in range(track.level_bound(level) // BLOCK_BUCKETS)]
    return TrackWriter(track).pending(blocks, final=True)
