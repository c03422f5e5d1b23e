"""What a Run (runner.py) offers to read from any thread while it trains: its records, events and gradient statistics
(from its sink), the batch of the current step, and a copy of a lane between two steps."""

from __future__ import annotations

import threading

import pandas as pd
import torch

from amp_core.race.lanes import Lane
from amp_core.race.snapshots import LaneSnapshot, copy_lane
from amp_core.records import Event
from amp_core.records.schema import GradStats
from amp_core.records.sink import RecordSink


class RunReading:
    """The read API of a Run, which sets what it reads: `sink` (where its records go), `lanes`, `_batches` (this
    step's batch of each seed replicate) and `_step_lock` (held while a lane steps)."""

    sink: RecordSink
    lanes: list[Lane]
    _batches: list[tuple[torch.Tensor, torch.Tensor]]
    _step_lock: threading.RLock

    @property
    def store_error(self) -> str:
        return self.sink.store_error

    def frame(self, since: int = 0) -> pd.DataFrame:
        """Step records [since, now) as a DataFrame."""
        return self.sink.records.frame(since)

    def events(self, since: int = 0) -> list[Event]:
        return self.sink.events[since:]

    def grad_stats(self) -> list[tuple[str, int, int, GradStats]]:
        return list(self.sink.grad_stats)

    def batch_of(self, lane: Lane) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch `lane` trains on at the current step (its seed replicate's); for hooks on the run's thread."""
        return self._batches[lane.replicate]

    def snapshot_lane(self, index: int) -> LaneSnapshot:
        """Copy lane `index` between two steps: its current weights, and the batch of the current step. ValueError if
        the lane holds no model (not started yet, or ended: the thread frees a lane's model when it ends)."""
        lane = self.lanes[index]
        with self._step_lock:
            state = lane.state  # read once: the thread may free the lane the moment the lock is let go
            if state is None or not self._batches:
                why = "has not started yet" if lane.status == "pending" else f"has ended ({lane.status})"
                raise ValueError(f"lane {index} ({lane.mode}) {why}")
            return copy_lane(lane.mode, state, self._batches[lane.replicate], lane.steps_done)
