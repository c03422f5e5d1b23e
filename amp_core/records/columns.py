"""ChunkedColumns: append-only numpy columns grown in chunks that are never reallocated, safe to read from other
threads while one writer appends (a reader takes the published row count first and reads only below it)."""

from __future__ import annotations

import bisect

import numpy as np

FIRST_CHUNK_ROWS = 256
"""The first chunk is small (a short run holds little); each next one doubles, up to `max_chunk_rows`."""


class ChunkedColumns:
    """Named columns of equal length; a column may have a trailing shape (a row of a matrix per entry)."""

    def __init__(self, dtypes: dict[str, np.dtype], max_chunk_rows: int = 8192,
                 shapes: dict[str, tuple[int, ...]] | None = None, first_chunk_rows: int = FIRST_CHUNK_ROWS):
        self.dtypes = {name: np.dtype(dtype) for name, dtype in dtypes.items()}
        self.shapes = shapes or {}
        self.max_chunk_rows = max_chunk_rows
        self.first_chunk_rows = first_chunk_rows
        self._chunks: list[dict[str, np.ndarray]] = []
        self._starts: list[int] = []
        self._capacity = 0
        self.count = 0
        """Rows written and readable; the writer raises it only after the rows are in place."""

    def __len__(self) -> int:
        return self.count

    def _grow(self) -> None:
        rows = min(self.max_chunk_rows, self.first_chunk_rows << len(self._chunks))
        self._chunks.append({name: np.empty((rows, *self.shapes.get(name, ())), dtype=dtype)
                             for name, dtype in self.dtypes.items()})
        self._starts.append(self._capacity)
        self._capacity += rows

    def extend(self, columns: dict[str, np.ndarray]) -> None:
        """Append rows (every column, equal lengths); readers see them once all are written."""
        n = len(next(iter(columns.values()))) if columns else 0
        done = 0
        while done < n:
            if self.count + done == self._capacity:
                self._grow()
            chunk, start = self._chunks[-1], self._starts[-1]
            at = self.count + done - start
            take = min(n - done, len(next(iter(chunk.values()))) - at)
            for name, values in columns.items():
                chunk[name][at:at + take] = values[done:done + take]
            done += take
        self.count += n

    def column(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of one column: a view when they lie in one chunk, else a copy of just those rows."""
        stop = self.count if stop is None else min(stop, self.count)
        if stop <= start:
            return np.empty((0, *self.shapes.get(name, ())), dtype=self.dtypes[name])
        first = bisect.bisect_right(self._starts, start) - 1
        last = bisect.bisect_right(self._starts, stop - 1) - 1
        if first == last:
            base = self._starts[first]
            return self._chunks[first][name][start - base:stop - base]
        parts = []
        for index in range(first, last + 1):
            base, chunk = self._starts[index], self._chunks[index][name]
            parts.append(chunk[max(start, base) - base:min(stop, base + len(chunk)) - base])
        return np.concatenate(parts)

    def search(self, name: str, value, count: int | None = None) -> int:
        """The first row below `count` whose `name` is >= `value` (a column sorted ascending): a binary search over
        chunks, then within one, so no column is copied."""
        count = self.count if count is None else count
        used = bisect.bisect_right(self._starts, count - 1) if count else 0
        lo, hi = 0, used
        while lo < hi:
            mid = (lo + hi) // 2
            if self._chunks[mid][name][0] < value:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return 0
        base, chunk = self._starts[lo - 1], self._chunks[lo - 1][name]
        return base + int(np.searchsorted(chunk[:min(count - base, len(chunk))], value, side="left"))

    def take(self, name: str, rows: np.ndarray) -> np.ndarray:
        """The values at sorted row positions (below `count`), gathered chunk by chunk (no range is copied)."""
        which = np.searchsorted(self._starts, rows, side="right") - 1
        out = np.empty((len(rows), *self.shapes.get(name, ())), dtype=self.dtypes[name])
        for index in np.unique(which):
            hit = which == index
            out[hit] = self._chunks[index][name][rows[hit] - self._starts[index]]
        return out

    def rows(self, start: int = 0, stop: int | None = None, names=None) -> dict[str, np.ndarray]:
        stop = self.count if stop is None else min(stop, self.count)
        return {name: self.column(name, start, stop) for name in (names or self.dtypes)}

    def nbytes(self) -> int:
        return sum(array.nbytes for chunk in self._chunks for array in chunk.values())
