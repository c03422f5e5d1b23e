"""The multi-resolution summary of a track: buckets of steps at several levels, exact min / max / last per figure.

Level 1 buckets hold LEVEL_BASE steps (bucket id = step // 64); each next level's buckets hold LEVEL_FACTOR buckets of
the level below. A bucket is complete once a record past its last step exists; complete buckets never change, so the
store keeps them in immutable blocks of BLOCK_BUCKETS buckets and a reader rebuilds the open end from the level below
(and, under level 1, from the raw records). Every figure is summarized the same way, so a figure added to StepRecord
gets its envelope for free.

A bucket holds, per summarized figure (columns of the matrices, in SUMMARY_FIELDS order):
  min / max     the smallest / largest finite value (NaN if none), argmin / argmax: the step where it first occurs;
  last          the value of the bucket's last record (as it is, NaN or inf included);
  sum / n       the sum and the number of its finite values (means, EMA smoothing, time axes);
and per bucket: id, count (records), first_step, last_step, flags (how many records had each bool column set).
Non-finite values and skipped steps are not lost in an envelope: the records they belong to are kept apart, exactly
(the marks). To add a statistic: one BUCKET_COLUMNS entry, its reduction in `merge` and in `unit_buckets`.
"""

from __future__ import annotations

import numpy as np

from amp_core.records.schema import HELD_PARTS, STEP_COLUMNS

LEVEL_BASE = 64
LEVEL_FACTOR = 4
BLOCK_BUCKETS = 64
"""Buckets per stored block (a block covers 4,096 steps at level 1, 16,384 at level 2, ...)."""
MAX_LEVEL = 12

FLAG_FIELDS: tuple[str, ...] = tuple(name for name, dtype in STEP_COLUMNS.items() if dtype.kind == "b")
SUMMARY_FIELDS: tuple[str, ...] = (*(name for name, dtype in STEP_COLUMNS.items()
                                     if name != "step" and dtype.kind != "b"), "held_bytes")
"""Figures with an envelope: every numeric column, and `held_bytes` (the sum of HELD_PARTS at each step)."""
FIELD_INDEX = {name: i for i, name in enumerate(SUMMARY_FIELDS)}

_F, _C = len(SUMMARY_FIELDS), len(FLAG_FIELDS)
BUCKET_COLUMNS: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    "id": (np.dtype(np.int64), ()), "count": (np.dtype(np.int64), ()),
    "first_step": (np.dtype(np.int64), ()), "last_step": (np.dtype(np.int64), ()),
    "flags": (np.dtype(np.int64), (_C,)),
    "min": (np.dtype(np.float64), (_F,)), "max": (np.dtype(np.float64), (_F,)),
    "argmin": (np.dtype(np.int64), (_F,)), "argmax": (np.dtype(np.int64), (_F,)),
    "last": (np.dtype(np.float64), (_F,)), "sum": (np.dtype(np.float64), (_F,)), "n": (np.dtype(np.int64), (_F,)),
}

Buckets = dict[str, np.ndarray]


def level_steps(level: int) -> int:
    """Steps in one bucket of `level` (1, 2, ...)."""
    return LEVEL_BASE * LEVEL_FACTOR ** (level - 1)


def empty_buckets() -> Buckets:
    return {name: np.empty((0, *shape), dtype=dtype) for name, (dtype, shape) in BUCKET_COLUMNS.items()}


def value_matrix(raw: dict[str, np.ndarray]) -> np.ndarray:
    """Records' summarized figures as one float64 matrix (records x SUMMARY_FIELDS)."""
    steps = raw["step"]
    out = np.empty((len(steps), _F), dtype=np.float64)
    for i, name in enumerate(SUMMARY_FIELDS[:-1]):
        out[:, i] = raw[name]
    out[:, -1] = sum(np.asarray(raw[name], dtype=np.float64) for name in HELD_PARTS) if len(steps) else 0.0
    return out


def unit_buckets(raw: dict[str, np.ndarray]) -> Buckets:
    """Each record as a bucket of its own (ids: the steps)."""
    steps = np.asarray(raw["step"], dtype=np.int64)
    values = value_matrix(raw)
    finite = np.isfinite(values)
    at = np.broadcast_to(steps[:, None], values.shape)
    envelope = np.where(finite, values, np.nan)
    return {"id": steps, "count": np.ones(len(steps), dtype=np.int64), "first_step": steps, "last_step": steps,
            "flags": np.stack([np.asarray(raw[name], dtype=np.int64) for name in FLAG_FIELDS], axis=1)
            if _C else np.zeros((len(steps), 0), dtype=np.int64),
            "min": envelope, "max": envelope, "argmin": at, "argmax": at, "last": values,
            "sum": np.where(finite, values, 0.0), "n": finite.astype(np.int64)}


def _first_at(children: np.ndarray, found: np.ndarray, child_steps: np.ndarray, starts: np.ndarray,
              lengths: np.ndarray) -> np.ndarray:
    """Per group and figure: the child step where the child value equals the group's value first (-1: none)."""
    hit = children == np.repeat(found, lengths, axis=0)
    rows = np.where(hit, np.arange(len(children))[:, None], len(children))
    first = np.minimum.reduceat(rows, starts, axis=0)
    exists = first < len(children)
    steps = np.take_along_axis(child_steps, np.where(exists, first, 0), axis=0)
    return np.where(exists, steps, -1)


def merge(buckets: Buckets, group_ids: np.ndarray) -> Buckets:
    """Buckets merged by `group_ids` (non-decreasing, one per bucket): one bucket per group, exact."""
    if len(group_ids) == 0:
        return empty_buckets()
    group_ids = np.asarray(group_ids, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, group_ids[1:] != group_ids[:-1]])
    ends = np.r_[starts[1:], len(group_ids)]
    lengths = ends - starts
    low = np.fmin.reduceat(buckets["min"], starts, axis=0)
    high = np.fmax.reduceat(buckets["max"], starts, axis=0)
    return {
        "id": group_ids[starts], "count": np.add.reduceat(buckets["count"], starts),
        "first_step": buckets["first_step"][starts], "last_step": buckets["last_step"][ends - 1],
        "flags": np.add.reduceat(buckets["flags"], starts, axis=0),
        "min": low, "max": high,
        "argmin": _first_at(buckets["min"], low, buckets["argmin"], starts, lengths),
        "argmax": _first_at(buckets["max"], high, buckets["argmax"], starts, lengths),
        "last": buckets["last"][ends - 1], "sum": np.add.reduceat(buckets["sum"], starts, axis=0),
        "n": np.add.reduceat(buckets["n"], starts, axis=0),
    }


def from_records(raw: dict[str, np.ndarray], bucket_steps: int) -> Buckets:
    """Records (ordered by step) summarized in buckets of `bucket_steps` steps (ids: step // bucket_steps)."""
    steps = np.asarray(raw["step"], dtype=np.int64)
    if len(steps) == 0:
        return empty_buckets()
    return merge(unit_buckets(raw), steps // bucket_steps)


def concat(parts: list[Buckets]) -> Buckets:
    parts = [p for p in parts if len(p["id"])]
    if not parts:
        return empty_buckets()
    if len(parts) == 1:
        return parts[0]
    names = [name for name in parts[0] if all(name in part for part in parts)]  # a reader may have asked for a few
    return {name: np.concatenate([p[name] for p in parts]) for name in names}


def select(buckets: Buckets, rows) -> Buckets:
    return {name: values[rows] for name, values in buckets.items()}


def total(buckets: Buckets) -> Buckets:
    """All buckets merged into one (id 0); empty stays empty."""
    return merge(buckets, np.zeros(len(buckets["id"]), dtype=np.int64))


def choose_level(span_steps: int, max_buckets: int) -> int:
    """The finest level whose buckets cover `span_steps` in at most `max_buckets` buckets."""
    level = 1
    while level < MAX_LEVEL and -(-span_steps // level_steps(level)) > max_buckets:
        level += 1
    return level
