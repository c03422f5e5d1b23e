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
from amp_core.records.levels import BLOCK_BUCKETS, MAX_LEVEL
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


class TrackWriter:
    """Which of a track's records the store holds; builds what the next flush writes (`pending`), and moves on only
    once that flush committed (`committed`)."""

    def __init__(self, track: TrackRecords):
        self.track = track
        self.stored_rows = 0
        self.open_chunk = (0, 0)
        """(first row, records) of the last chunk written."""

    def pending(self, blocks: list[tuple[int, int]], final: bool = False) -> TrackFlush | None:
        """Call after `track.seal()` (every row is a column then), with the blocks it completed."""
        track = self.track
        count = track.raw.count
        if count == self.stored_rows and not blocks and not final:
            return None
        records, first, last = track.extent()
        out = TrackFlush(track.lane, track.rank, track.mode, records, first, last,
                         float(track.raw.column("t_wall_s", count - 1, count)[0]) if count else 0.0)
        open_row, open_records = self.open_chunk
        start = open_row if 0 < open_records < CHUNK_MIN and count > self.stored_rows else self.stored_rows
        piece = (open_row, open_records)
        while start < count:
            stop = min(count, start + CHUNK_MAX)
            out.chunks.append(encode_chunk(track, start, stop))
            piece, start = (start, stop - start), stop
        for level, block in blocks:
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


def encode_track(track: TrackRecords) -> TrackFlush | None:
    """All of a track at once (a migrated store, a bulk import): every chunk and every complete block."""
    track.seal()
    blocks = [(level, block) for level in range(1, MAX_LEVEL + 1)
              for block in range(track.level_bound(level) // BLOCK_BUCKETS)]
    return TrackWriter(track).pending(blocks, final=True)
