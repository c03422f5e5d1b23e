"""RecordSink: where a run's records go — held columnar in memory for readers in this process, written to the store
in batches.

The runner writes through one, and so does a Monitor in a user's own loop (and a torchrun job's rank 0): the same
records, the same store, the same flush policy. Readers on other threads read the in-memory tracks (see
records/tracks.py). Each flush completes the summary buckets in memory and writes, in one transaction, each track's
new records as a chunk, the summary blocks that became complete, the new events and gradient statistics, and the
writer's heartbeat.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from amp_core.records.chunks import TrackWriter
from amp_core.records.schema import Event, GradStats, StepRecord
from amp_core.records.store import RunStore, StoreError, pack_grad_stats, unpack_grad_stats
from amp_core.records.tracks import RunRecords, TrackRecords

FLUSH_EVERY_S = 0.5
"""The store gets what was gathered at least this often (a kill -9 loses less than a second)."""


def new_run_id() -> str:
    """A run's id: when it began (sortable) and six random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


class GradStatsLog:
    """Sampled gradient statistics, held packed (as objects one sample of a few parameters takes ~10 KiB, which
    over a long run outweighs the step records): one (lane, step, packed) entry per sampled lane step. Iterating
    gives (run_id, lane, step, GradStats) per parameter."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._samples: list[tuple[int, int, bytes]] = []

    def add(self, lane: int, step: int, stats: list[GradStats]) -> None:
        self._samples.append((lane, step, pack_grad_stats(stats)))

    def __len__(self) -> int:
        return len(self._samples)

    def packed(self, start: int, stop: int) -> list[tuple[int, int, bytes]]:
        return self._samples[start:stop]

    def steps(self, lane: int) -> list[int]:
        return sorted({step for ln, step, _ in self._samples if ln == lane})

    def get(self, lane: int, step: int | None = None) -> list[GradStats]:
        """A lane's statistics at one sampled step (every parameter), or at every one (by step, then parameter)."""
        return [stats for ln, st, data in self._samples[:] if ln == lane and (step is None or st == step)
                for stats in unpack_grad_stats(data)]

    def __iter__(self):
        for lane, step, data in self._samples[:]:
            for stats in unpack_grad_stats(data):
                yield self.run_id, lane, step, stats


class RecordSink:
    """A run's step records, events and gradient statistics; `flush` writes what is new in one transaction."""

    def __init__(self, run_id: str, store: RunStore | None = None, flush_every_s: float = FLUSH_EVERY_S):
        self.run_id = run_id
        self.store = store
        self.flush_every_s = flush_every_s
        self.records = RunRecords(run_id)
        self.events: list[Event] = []
        self.grad_stats = GradStatsLog(run_id)
        self.store_error = ""
        """Why records are no longer saved (the store failed); training goes on in memory."""
        self.write_seconds = 0.0
        """Wall seconds the writer spent encoding and writing to the store (what a run pays for being stored)."""
        self._writers: dict[tuple[int, int], TrackWriter] = {}
        self._flushed = (0, 0)
        self._last_flush = time.monotonic()

    def open(self, config: dict[str, Any], device: str, torch_version: str,
             lane_meta: list[dict] | None = None, lane_modes: list[str] | None = None) -> None:
        """Register the run in the store (StoreError if the store cannot take it: nothing is started then)."""
        if self.store is not None:
            self.store.create_run(self.run_id, config, device, torch_version, lane_meta, lane_modes)

    def step(self, record: StepRecord) -> None:
        """One lane step's record (the training thread: a tuple appended, nothing more)."""
        self.records.append(record)

    def track(self, lane: int, mode: str) -> TrackRecords:
        """The in-memory records of lane `lane` (this process's track), to append rows to."""
        return self.records.track(lane, mode)

    def extend_steps(self, lane: int, mode: str, columns: dict[str, np.ndarray], rank: int = 0) -> None:
        """Many records of one track at once, as columns (every STEP_COLUMNS column; steps increasing)."""
        self.records.track(lane, mode, rank).extend(columns)

    def event(self, kind: str, message: str, lane: int | None = None, step: int | None = None, **data) -> Event:
        event = Event(self.run_id, kind, message, lane, step, data=data)
        self.events.append(event)
        return event

    def add_grad_stats(self, lane: int, step: int, stats: list[GradStats]) -> None:
        """Every parameter's statistics of one sampled lane step."""
        self.grad_stats.add(lane, step, stats)

    def flush_if_due(self) -> None:
        """Flush when `flush_every_s` has passed since the last flush (one clock read otherwise)."""
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Complete the summary in memory, then write what was gathered since the last flush in one transaction
        (never one per step). `final`: the tracks are done; their exact stats go with them."""
        self._last_flush = time.monotonic()
        sealed = [(track, track.seal()) for track in self.records.tracks()]
        if self.store is None or self.store_error:
            return
        started = time.perf_counter()
        events_at, stats_at = len(self.events), len(self.grad_stats)
        done_events, done_stats = self._flushed
        pending = []
        for track, blocks in sealed:
            writer = self._writers.get((track.lane, track.rank))
            if writer is None:
                writer = self._writers[(track.lane, track.rank)] = TrackWriter(track)
            flush = writer.pending(blocks, final)
            if flush is not None:
                pending.append((writer, flush))
        try:
            self.store.write_flush(self.run_id, [flush for _, flush in pending], self.events[done_events:events_at],
                                   self.grad_stats.packed(done_stats, stats_at))
        except StoreError as exc:  # training goes on in memory; the page shows why nothing more is saved
            self.store_error = str(exc)
            return
        finally:
            self.write_seconds += time.perf_counter() - started
        for writer, flush in pending:
            writer.committed(flush)
        self._flushed = (events_at, stats_at)

    def close(self, status: str, lanes: list[tuple[int, str, str]]) -> None:
        """Final flush, then the run's and each lane's (index, status, error) final status."""
        self.flush(final=True)
        if self.store is None or self.store_error:
            return
        try:
            for index, lane_status, error in lanes:
                self.store.set_lane_status(self.run_id, index, lane_status, error)
            self.store.set_run_status(self.run_id, status, ended=True)
        except StoreError as exc:
            self.store_error = str(exc)
