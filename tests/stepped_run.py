"""A real Run a test can wait on: it counts its lane steps under a Condition, so tests wait for progress, not sleep."""

from __future__ import annotations

import threading
from collections.abc import Callable

from amp_core.race.runner import Run


class SteppedRun(Run):
    """A real Run (real training, real records and store) that tells a test how far it has got.

    Every recorded lane step is counted under `progress` (a Condition) and wakes the waiters, and so does the end of
    the thread. The run pauses itself right after the lane steps counted in `pause_after`: a test then sees it stopped
    at a known point, between two lane steps, with nothing under way.
    """

    pause_after: frozenset[int] = frozenset()
    """Counts of lane steps after which the run pauses itself (a class default, so RunManager's runs get it too)."""

    def __init__(self, *args, pause_after: set[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.progress = threading.Condition()
        self.lane_steps = 0
        """Lane steps recorded so far (every lane's, in the order the thread ran them)."""
        self.ended = False
        """The thread has finished its work (its last records flushed, its final status set)."""
        if pause_after is not None:
            self.pause_after = frozenset(pause_after)
        self.hooks.after_lane_step.append(self._counted)
        self.hooks.run_end.append(self._ended)

    @staticmethod
    def _counted(run: SteppedRun, lane, step) -> None:
        with run.progress:
            run.lane_steps += 1
            if run.lane_steps in run.pause_after:
                run.pause()  # on the run's own thread, between two lane steps
            run.progress.notify_all()

    @staticmethod
    def _ended(run: SteppedRun) -> None:
        with run.progress:
            run.ended = True
            run.progress.notify_all()

    def wait_until(self, condition: Callable[[SteppedRun], bool], timeout_s: float = 60.0) -> None:
        """Block until `condition(run)` holds, checked after every lane step and at the end; fail after `timeout_s`."""
        with self.progress:
            reached = self.progress.wait_for(lambda: condition(self), timeout_s)
        assert reached, f"timed out after {self.lane_steps} lane steps (run {self.status})"

    def parked(self) -> bool:
        """Paused itself (`pause_after`) or ended: no lane step is under way. (A user's pause lets one finish.)"""
        return self.status == "paused" or self.ended

    def steps_within(self, seconds: float) -> int:
        """How many lane steps the run records in the next `seconds` (waking at each; 0 while it is paused)."""
        with self.progress:
            before = self.lane_steps
            self.progress.wait_for(lambda: self.lane_steps > before, seconds)
            return self.lane_steps - before
