"""RecordSink: where a run's records go — held columnar in memory for readers in this process, written to the store
in batches.

The runner writes through one, and so does a Monitor in a user's own loop (and a torchrun job's rank 0): the same
records, the same store, the same flush policy. Readers on other threads read the in-memory tracks (see
records/tracks.py). Each flush completes the summary buckets in memory and writes, in one transaction, each track's
new records as a chunk, the summary blocks that became complete, the new events and gradient statistics, and the
writer's heartbeat.

When the store's server cannot be reached (StoreUnreachable: a PostgreSQL server restarting, a network cut) training
goes on: the records stay in memory, the writer says so once (its log and an event), tries again with a growing
pause, and writes everything when the server answers. Past `store.backlog_records` held records it drops the oldest
detail that the summary already covers (every skipped step and non-finite value is still written) and records what
it dropped as an event.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np

from amp_core.records.chunks import Dropped, TrackWriter
from amp_core.records.schema import Event, GradStats, StepRecord
from amp_core.records.store import RunStore, StoreError, StoreUnreachable, pack_grad_stats, unpack_grad_stats
from amp_core.records.tracks import RunRecords, TrackRecords

FLUSH_EVERY_S = 0.5
"""The store gets what was gathered at least this often (a kill -9 loses less than a second)."""
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 8.0
"""While the store is unreachable the writer tries again after RETRY_FIRST_S, doubling up to RETRY_MAX_S."""
CLOSE_WAIT_S = 120.0
"""How long the end of a run waits for an unreachable store before it gives up on what it still holds."""
log = logging.getLogger("amp_core.store")


def new_run_id() -> str:
    """A run's id: when it began (sortable) and 48 random bits (run ids written from many hosts into one store never
    meet)."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:12]


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

    counts_calls = False
    """`flush_if_due` decides by the clock alone, so a loop may leave it uncalled until `flush_due_at` (a RankSink
    counts the calls instead: every step must make one)."""

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
        self._waiting_since: float | None = None
        """Monotonic time the store became unreachable (None: it answers)."""
        self._retry_in = RETRY_FIRST_S
        self._retry_at = 0.0

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

    @property
    def flush_due_at(self) -> float:
        """When (`time.monotonic()`) `flush_if_due` flushes next."""
        return self._last_flush + self.flush_every_s

    def _writer(self, track) -> TrackWriter:
        writer = self._writers.get((track.lane, track.rank))
        if writer is None:
            writer = self._writers[(track.lane, track.rank)] = TrackWriter(track)
        return writer

    def flush(self, final: bool = False) -> bool:
        """Complete the summary in memory, then write what was gathered since the last flush in one transaction
        (never one per step). `final`: the tracks are done; their exact stats go with them. While the store is
        unreachable a flush before the next retry only keeps the backlog bound. True when the store has it all."""
        self._last_flush = time.monotonic()
        sealed = [(track, track.seal()) for track in self.records.tracks()]
        if self.store is None or self.store_error:
            return self.store is None
        started = time.perf_counter()
        try:
            if self._waiting_since is not None:
                for track, blocks in sealed:  # completed blocks wait in their writer for the flush that commits
                    self._writer(track).due(blocks)
                self._keep_backlog_bound()
                if time.monotonic() < self._retry_at:  # not yet: the next try stays where it was
                    return False
                if not self.store.reachable():
                    self._retry_later()
                    return False
                sealed = [(track, []) for track, _ in sealed]
            self._write(sealed, final)
        except StoreUnreachable as exc:
            self._unreachable(exc)
            return False
        except StoreError as exc:  # training goes on in memory; the page shows why nothing more is saved
            self.store_error = str(exc)
            return False
        finally:
            self.write_seconds += time.perf_counter() - started
        if self._waiting_since is not None:
            self._back()
        return True

    def _write(self, sealed, final: bool) -> None:
        events_at, stats_at = len(self.events), len(self.grad_stats)
        done_events, done_stats = self._flushed
        pending = []
        for track, blocks in sealed:
            writer = self._writer(track)
            flush = writer.pending(blocks, final)
            if flush is not None:
                pending.append((writer, flush))
        self.store.write_flush(self.run_id, [flush for _, flush in pending], self.events[done_events:events_at],
                               self.grad_stats.packed(done_stats, stats_at))
        for writer, flush in pending:
            writer.committed(flush)
        self._flushed = (events_at, stats_at)

    # --- an unreachable store ---------------------------------------------------------------------------------
    def _unreachable(self, exc: StoreUnreachable) -> None:
        if self._waiting_since is None:  # said once per outage, not at every retry
            self._waiting_since = time.monotonic()
            self._retry_in = RETRY_FIRST_S
            message = (f"{exc}; training goes on and its records are kept in memory (up to "
                       f"{self.store.backlog_records:,} step records) until the server answers again")
            log.warning("run %s: %s", self.run_id, message)
            self.event("store_unreachable", message, backlog_records=self.store.backlog_records)
        self._retry_later()

    def _retry_later(self) -> None:
        self._retry_at = time.monotonic() + self._retry_in
        self._retry_in = min(RETRY_MAX_S, self._retry_in * 2)

    def _back(self) -> None:
        waited = time.monotonic() - self._waiting_since
        self._waiting_since = None
        message = f"the writer waited {waited:.1f} s for the store's server; what it held meanwhile is written"
        log.warning("run %s: %s", self.run_id, message)
        self.event("store_waited", message, waited_s=round(waited, 3))
        try:  # now, not at the next flush: a run's last flush has no next one
            self._write([(track, []) for track in self.records.tracks()], False)
        except StoreUnreachable as exc:
            self._unreachable(exc)
        except StoreError as exc:
            self.store_error = str(exc)

    def _keep_backlog_bound(self) -> None:
        """Past the bound, drop the oldest summarised detail of the tracks holding the most (their marks stay)."""
        writers = [self._writer(track) for track in self.records.tracks()]
        excess = sum(writer.held() for writer in writers) - self.store.backlog_records
        for writer in sorted(writers, key=TrackWriter.held, reverse=True):
            if excess <= 0:
                return
            dropped = writer.drop(excess)
            if dropped is not None:
                excess -= dropped.records
                self._say_dropped(dropped)

    def _say_dropped(self, dropped: Dropped) -> None:
        message = (f"the store was unreachable past its backlog of {self.store.backlog_records:,} step records: the "
                   f"detail of steps {dropped.first_step}–{dropped.last_step} ({dropped.records:,} records) was "
                   f"dropped; their summary and {dropped.marks_kept} skipped or non-finite records are kept")
        log.warning("run %s: lane %d rank %d: %s", self.run_id, dropped.lane, dropped.rank, message)
        self.event("store_dropped", message, lane=dropped.lane, rank=dropped.rank, first_step=dropped.first_step,
                   last_step=dropped.last_step, records=dropped.records, marks_kept=dropped.marks_kept)

    def close(self, status: str, lanes: list[tuple[int, str, str]]) -> None:
        """Final flush (waiting up to CLOSE_WAIT_S for an unreachable store), then the run's and each lane's
        (index, status, error) final status."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not self.flush(final=True):
            if self.store_error:
                return
            if time.monotonic() > deadline:
                self.store_error = (f"the store's server was still unreachable {CLOSE_WAIT_S:.0f} s after the run "
                                    "ended: its last records were not written")
                log.warning("run %s: %s", self.run_id, self.store_error)
                return
            time.sleep(max(0.0, self._retry_at - time.monotonic()))
        if self.store is None:
            return
        try:
            for index, lane_status, error in lanes:
                self.store.set_lane_status(self.run_id, index, lane_status, error)
            self.store.set_run_status(self.run_id, status, ended=True)
        except StoreError as exc:
            self.store_error = str(exc)
