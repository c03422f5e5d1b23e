"""Reading a track for charts and headlines, the same way from memory and from the store.

A chart asks for a step range and at most about `max_points` points per figure, and gets either every record of the
range (when there are that few) or an exact min/max envelope: per bucket the smallest and largest finite value at the
step where it occurs and the bucket's last value, plus every marked record of the range (skipped steps, non-finite
figures) as it is. A range that is zoomed into is read finer. A headline gets the track's exact totals (records,
skipped steps, peak bytes, the exact median step time) and its last records, without reading the run.

A track source (`TrackRecords` in memory, `StoredTrack` in the store) provides: extent(), raw_rows(start, stop,
names), tail(records, names), level_bound(level), complete(level, lo, hi), marks(start, stop), median_step_ms(),
and `problems` (what could not be read, e.g. a damaged chunk: the rest is read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from amp_core.records.levels import (
    FIELD_INDEX,
    FLAG_FIELDS,
    LEVEL_BASE,
    LEVEL_FACTOR,
    MAX_LEVEL,
    Buckets,
    choose_level,
    concat,
    empty_buckets,
    from_records,
    level_steps,
    merge,
    total,
    unit_buckets,
)
from amp_core.records.schema import HELD_PARTS, OPTIONAL_COLUMNS, STEP_COLUMNS

MAX_POINTS = 1200
"""At most about this many points per trace: 400 envelope buckets, one per 1-3 pixels of a chart at 1440 px wide. A
live page redraws each chart every second in every session watching, and on a small machine the browser drawing them
takes cores from the training run (bench/viewers.py, two sessions watching: Chromium kept 0.53 of a core busy with
1200 points against 0.6 with 2000). Spikes and skipped steps survive any count."""
POINTS_PER_BUCKET = 3
"""An envelope bucket draws its min, its max and its last value."""
RAW_BUCKETING_SPAN = 4
"""A range of up to this many times max_points steps is bucketed from its records (finer than level 1); a longer one
reads the stored levels (at least max_points * 4 / 64 buckets of level 1, so ~370 buckets and up)."""
TAIL_RECORDS = 256
"""Records at the end of a track read with every headline (the latest values, a final-loss window)."""


def level_buckets(source, level: int, lo: int, hi: int, names=None) -> Buckets:
    """Buckets of `level` with ids in [lo, hi): the complete ones the source holds, the rest rebuilt from the level
    below (and from the records under level 1) — the open end of a live track, or blocks not stored yet.
    `names`: the bucket columns the caller reads (a stored track decodes only those; others may be left out)."""
    if hi <= lo:
        return empty_buckets()
    bound = source.level_bound(level)
    parts = [source.complete(level, lo, min(hi, bound), names)] if lo < bound else []
    if hi > bound:
        first = max(lo, bound)
        if level == 1:
            parts.append(from_records(source.raw_rows(first * LEVEL_BASE, hi * LEVEL_BASE), LEVEL_BASE))
        else:
            children = level_buckets(source, level - 1, first * LEVEL_FACTOR, hi * LEVEL_FACTOR)
            parts.append(merge(children, children["id"] // LEVEL_FACTOR))
    return concat(parts)


def _cover(source, start: int, stop: int, level: int) -> Buckets:
    """Buckets that together hold exactly the records of [start, stop), as coarse as the range allows."""
    if stop <= start:
        return empty_buckets()
    if level == 0:
        return total(unit_buckets(source.raw_rows(start, stop)))
    size = level_steps(level)
    lo, hi = -(-start // size), stop // size
    if lo >= hi:
        return _cover(source, start, stop, level - 1)
    return concat([_cover(source, start, lo * size, level - 1), level_buckets(source, level, lo, hi),
                   _cover(source, hi * size, stop, level - 1)])


def aggregate(source, start: int, stop: int) -> Buckets:
    """One bucket holding exactly the records of steps [start, stop) (empty if there are none)."""
    span = stop - start
    level = 0
    while level < MAX_LEVEL and level_steps(level + 1) <= span:
        level += 1
    return total(_cover(source, start, stop, level))


def envelope(source, start: int, stop: int, max_points: int) -> tuple[int, dict | None, Buckets | None]:
    """(steps per bucket, records, buckets) for [start, stop): (1, every record, None) when the range holds at most
    `max_points` steps, else (bucket steps, None, an exact envelope in at most about max_points / 3 buckets, at least
    half that many)."""
    span = stop - start
    if span <= max_points:
        return 1, source.raw_rows(start, stop), None
    target = max(1, max_points // POINTS_PER_BUCKET)
    if span <= RAW_BUCKETING_SPAN * max_points:  # a short range reads its records: finer than level 1 would be
        # A power of two: a live range that grows keeps its buckets until it doubles (a size that followed the span
        # step by step moved every bucket, and a live chart then got every point again, not the new ones).
        size = 1 << (-(-span // target) - 1).bit_length()
        return size, None, from_records(source.raw_rows(start, stop), size)
    level = choose_level(span, target)
    size = level_steps(level)
    lo, hi = -(-start // size), stop // size
    parts = []
    left_end = min(stop, lo * size)
    if start < left_end:
        parts.append(_with_id(aggregate(source, start, left_end), start // size))
    if lo < hi:
        parts.append(level_buckets(source, level, lo, hi))
    right_start = max(start, hi * size, left_end)
    if right_start < stop:
        parts.append(_with_id(aggregate(source, right_start, stop), right_start // size))
    return size, None, concat(parts)


def _with_id(bucket: Buckets, bucket_id: int) -> Buckets:
    if len(bucket["id"]):
        bucket = {**bucket, "id": np.array([bucket_id], dtype=np.int64)}
    return bucket


@dataclass(frozen=True, slots=True)
class LaneStats:
    """A whole track's exact figures (whatever range a chart reads)."""

    records: int
    first_step: int
    last_step: int
    skipped_steps: int
    median_step_ms: float
    peak_bytes: float
    """The lane's own peak (lane_peak_bytes) where the track measured it, else the largest bytes held (HELD_PARTS) at
    a step."""
    latest: dict[str, float]
    """The last record's columns."""
    tail_loss: np.ndarray
    """Losses of the last TAIL_RECORDS records."""
    dense: bool
    """One record per step from the first to the last (the runner's tracks are)."""


def _peak(bucket: Buckets) -> float:
    if not len(bucket["id"]):
        return math.nan
    measured, held = FIELD_INDEX["lane_peak_bytes"], FIELD_INDEX["held_bytes"]
    return float(bucket["max"][0, measured] if bucket["n"][0, measured] else bucket["max"][0, held])


@dataclass(frozen=True, slots=True, eq=False)
class LaneSeries:
    """One track read for charts: every record of [start, stop) (`bucket_steps` 1) or an exact envelope of it;
    the range's marked records; the whole track's stats."""

    run_id: str
    lane: int
    mode: str
    start: int
    stop: int
    bucket_steps: int
    raw: dict[str, np.ndarray] | None
    buckets: Buckets | None
    marks: dict[str, np.ndarray]
    stats: LaneStats
    rank: int = 0
    source: Any = field(default=None, repr=False)
    problems: tuple[str, ...] = ()
    """What could not be read (a damaged chunk): the charts show the rest."""

    @property
    def key(self) -> str:
        return f"{self.run_id}/{self.lane}"

    def __getitem__(self, column: str) -> np.ndarray:
        """A column of the records, when the series holds every record of its range."""
        if self.raw is None:
            raise KeyError(f"{column}: this series is an envelope of {self.bucket_steps}-step buckets; use points()")
        return _figure(self.raw, column)

    def points(self, figure: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) to draw for a figure: every record, or per bucket its min and max where they occur and its
        last value, with the range's skipped steps and the figure's non-finite values at their steps. Sorted by step,
        one value per step."""
        if self.raw is not None:
            return np.asarray(self.raw["step"]), _figure(self.raw, figure)
        b, i = self.buckets, FIELD_INDEX[figure]
        steps = np.concatenate([b["argmin"][:, i], b["argmax"][:, i], b["last_step"]])
        values = np.concatenate([b["min"][:, i], b["max"][:, i], b["last"][:, i]])
        if len(self.marks["step"]):
            marked_steps, marked = self._marked(figure)
            steps, values = np.concatenate([steps, marked_steps]), np.concatenate([values, marked])
        keep = steps >= 0
        steps, values = steps[keep], values[keep]
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
        first = np.r_[True, steps[1:] != steps[:-1]]
        return steps[first], values[first]

    def _marked(self, figure: str) -> tuple[np.ndarray, np.ndarray]:
        """The range's skipped steps and the non-finite values of `figure`, at their steps; of a run of non-finite
        values on consecutive steps (a lane that went NaN and stayed) only its ends, which draw the same gap."""
        steps, values = self.marks["step"], _figure(self.marks, figure)
        skipped = np.asarray(self.marks["skipped"], dtype=bool)
        odd = ~np.isfinite(values) & (figure not in OPTIONAL_COLUMNS) & ~skipped
        inside = np.zeros(len(steps), dtype=bool)
        if len(steps) > 2:
            kind = np.where(np.isnan(values), 0, np.sign(np.nan_to_num(values, nan=0.0, posinf=1, neginf=-1)))
            same = odd[1:] & odd[:-1] & (np.diff(steps) == 1) & (kind[1:] == kind[:-1])
            inside[1:-1] = same[:-1] & same[1:]
        keep = (skipped | odd) & ~inside
        return steps[keep], values[keep]

    def means(self, figure: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, mean of the finite values, how many) per record or bucket (a bucket sits at its last step)."""
        if self.raw is not None:
            values = _figure(self.raw, figure)
            return np.asarray(self.raw["step"]), values, np.isfinite(values).astype(np.int64)
        b, i = self.buckets, FIELD_INDEX[figure]
        with np.errstate(invalid="ignore", divide="ignore"):
            return b["last_step"], b["sum"][:, i] / b["n"][:, i], b["n"][:, i]

    def skipped(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Steps the optimizer skipped in the range, and every column of those records."""
        hit = np.asarray(self.marks["skipped"], dtype=bool)
        return self.marks["step"][hit], {name: values[hit] for name, values in self.marks.items()}

    def final_loss(self, last_k: int) -> float:
        """Mean of the finite losses among the last `last_k` records (the last loss itself if none is finite)."""
        stats = self.stats
        if stats.records == 0:
            return math.nan
        if last_k <= len(stats.tail_loss) or stats.records <= len(stats.tail_loss):
            window = stats.tail_loss[-last_k:]
        elif stats.dense and self.source is not None:
            bucket = aggregate(self.source, max(stats.first_step, stats.last_step - last_k + 1), stats.last_step + 1)
            i = FIELD_INDEX["loss"]
            count = int(bucket["n"][0, i]) if len(bucket["id"]) else 0
            return float(bucket["sum"][0, i] / count) if count else float(stats.latest.get("loss", math.nan))
        else:
            window = self.source.tail(last_k, ["loss"])["loss"]
        finite = window[np.isfinite(window)]
        return float(finite.astype(np.float64).mean()) if finite.size else float(window[-1])


def _figure(columns: dict[str, np.ndarray], figure: str) -> np.ndarray:
    if figure == "held_bytes":
        return sum(np.asarray(columns[name], dtype=np.float64) for name in HELD_PARTS)
    return np.asarray(columns[figure], dtype=np.float64)


def read_lane(source, start: int | None = None, stop: int | None = None, max_points: int = MAX_POINTS) -> LaneSeries:
    """Read a track for charts and headlines: [start, stop) (default: all of it) in about `max_points` points."""
    records, first, last = source.extent()
    start = first if start is None else max(start, first)
    stop = last + 1 if stop is None else min(stop, last + 1)
    stop = max(start, stop)
    bucket_steps, raw, buckets = envelope(source, start, stop, max_points)
    if start == first and stop == last + 1:  # the chart reads the whole track: its totals come with it
        whole = total(unit_buckets(raw) if raw is not None else buckets)
    else:
        whole = aggregate(source, first, last + 1)
    tail = source.tail(TAIL_RECORDS) if records else {name: np.empty(0, dtype=d) for name, d in STEP_COLUMNS.items()}
    latest = {name: values[-1].item() for name, values in tail.items()} if len(tail["step"]) else {}
    flags = whole["flags"][0] if len(whole["id"]) else np.zeros(len(FLAG_FIELDS), dtype=np.int64)
    stats = LaneStats(records=records, first_step=first, last_step=last,
                      skipped_steps=int(flags[FLAG_FIELDS.index("skipped")]),
                      median_step_ms=source.median_step_ms(), peak_bytes=_peak(whole), latest=latest,
                      tail_loss=np.asarray(tail["loss"], dtype=np.float64), dense=records == last - first + 1)
    return LaneSeries(source.run_id, source.lane, source.mode, start, stop, bucket_steps, raw, buckets,
                      source.marks(start, stop), stats, source.rank, source, tuple(source.problems))
