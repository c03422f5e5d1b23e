"""RecordSink: where a run's records go — held in memory for readers in this process, written to the store in batches.

The runner writes through one, and so does a Monitor in a user's own loop: the same records, the same store, the
same flush policy. Readers on other threads read the in-memory records (appends only; a reader takes a count first).
"""

from __future__ import annotations

import time
from typing import Any

from amp_core.probes.gradstats import GradStats
from amp_core.records.schema import Event, RecordBuffer, StepRecord
from amp_core.records.store import RunStore, StoreError

FLUSH_EVERY_S = 0.5
"""The store gets what was gathered at least this often (a kill -9 loses less than a second)."""


class RecordSink:
    """A run's step records, events and gradient statistics; `flush` writes what is new in one transaction."""

    def __init__(self, run_id: str, store: RunStore | None = None, flush_every_s: float = FLUSH_EVERY_S):
        self.run_id = run_id
        self.store = store
        self.flush_every_s = flush_every_s
        self.records = RecordBuffer()
        self.events: list[Event] = []
        self.grad_stats: list[tuple[str, int, int, GradStats]] = []
        """(run_id, lane, step, statistics of one parameter)."""
        self.store_error = ""
        """Why records are no longer saved (the store failed); training goes on in memory."""
        self._flushed = (0, 0, 0)
        self._last_flush = time.monotonic()

    def open(self, config: dict[str, Any], device: str, torch_version: str) -> None:
        """Register the run in the store (StoreError if the store cannot take it: nothing is started then)."""
        if self.store is not None:
            self.store.create_run(self.run_id, config, device, torch_version)

    def step(self, record: StepRecord) -> None:
        self.records.append(record)

    def event(self, kind: str, message: str, lane: int | None = None, step: int | None = None, **data) -> Event:
        event = Event(self.run_id, kind, message, lane, step, data=data)
        self.events.append(event)
        return event

    def add_grad_stats(self, lane: int, step: int, stats: list[GradStats]) -> None:
        self.grad_stats.extend((self.run_id, lane, step, s) for s in stats)

    def flush_if_due(self) -> None:
        """Flush when `flush_every_s` has passed since the last flush (one clock read otherwise)."""
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Write what was gathered since the last flush in one transaction (never one per step)."""
        self._last_flush = time.monotonic()
        if self.store is None or self.store_error:
            return
        steps_at, events_at, stats_at = len(self.records), len(self.events), len(self.grad_stats)
        done_steps, done_events, done_stats = self._flushed
        try:
            self.store.write_batch(self.records.rows(done_steps, steps_at), self.events[done_events:events_at],
                                   self.grad_stats[done_stats:stats_at])
            self._flushed = (steps_at, events_at, stats_at)
        except StoreError as exc:  # training goes on in memory; the page shows why nothing more is saved
            self.store_error = str(exc)

    def close(self, status: str, lanes: list[tuple[int, str, str]]) -> None:
        """Final flush, then the run's and each lane's (index, status, error) final status."""
        self.flush()
        if self.store is None or self.store_error:
            return
        try:
            for index, lane_status, error in lanes:
                self.store.set_lane_status(self.run_id, index, lane_status, error)
            self.store.set_run_status(self.run_id, status, ended=True)
        except StoreError as exc:
            self.store_error = str(exc)
