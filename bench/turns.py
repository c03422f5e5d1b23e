"""Taking turns: a run of the runner and a bare loop stepping in short alternate chunks in one process, so that a
shared machine's speed, which moves by tens of percent from one second to the next, falls on both alike.

The run steps until its lane has made a chunk, is paused (Run.pause, then Run.wait_paused: every step it made
recorded), the bare loop (on a thread of its own, with the run's intra-op threads) makes a chunk, the run resumes, and
so on; the order within each pair alternates. Used by bench.overhead and bench.race's compiled overhead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from amp_core.runner import Run
from amp_core.switches import pin_intra_op_threads

POLL_S = 0.001
"""How often the bench's own thread looks whether a chunk is made: the same while either side steps."""
PATIENCE_S = 600.0


class TurnTaker:
    """A bare loop (`make()`'s object, whose `steps(n)` makes n steps and returns what it measured) built and stepped
    on a thread of its own with `threads` intra-op threads, a chunk when asked."""

    def __init__(self, make: Callable[[], object], threads: int):
        self._asked, self.done = threading.Event(), threading.Event()
        self._count, self.result, self.error = 0, None, None
        self._thread = threading.Thread(target=self._serve, args=(make, threads), daemon=True)
        self._thread.start()

    def _serve(self, make: Callable[[], object], threads: int) -> None:
        pin_intra_op_threads(threads)
        loop = None
        try:
            loop = make()
        except Exception as exc:  # reported by the first chunk asked
            self.error = exc
        while True:
            self._asked.wait()
            self._asked.clear()
            if self._count < 0:
                return
            if loop is not None:
                try:
                    self.result = loop.steps(self._count)
                except Exception as exc:
                    self.error = exc
            self.done.set()

    def chunk(self, count: int):
        """`count` steps of the bare loop; what its `steps` returned."""
        self.done.clear()
        self._count = count
        self._asked.set()
        until(self.done.is_set)
        if self.error is not None:
            raise SystemExit(f"FAIL: the bare loop failed: {type(self.error).__name__}: {self.error}")
        return self.result

    def close(self) -> None:
        self._count = -1
        self._asked.set()
        self._thread.join()


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: a chunk did not finish within {PATIENCE_S:.0f} s")
        time.sleep(POLL_S)


def run_chunk(run: Run, upto: int) -> int:
    """Resume `run` until its first lane has made `upto` steps, pause it and wait until it stands; the steps made."""
    lane = run.lanes[0]
    run.resume()
    until(lambda: lane.steps_done >= upto or not run.alive)
    run.pause()
    until(lambda: run.wait_paused(0.05) or not run.alive)
    if lane.steps_done < upto:
        errors = [event.message for event in run.events() if event.kind == "error"] or [lane.error]
        raise SystemExit(f"FAIL: the run ended {run.status} after {lane.steps_done} steps: {errors}")
    return lane.steps_done


@dataclass
class Turns:
    """What taking turns gave: the run's chunks as (first step, end step), and the bare loop's chunks' results, in
    pairs (the i-th of each side were made one right after the other)."""

    run_chunks: list[tuple[int, int]] = field(default_factory=list)
    bare_chunks: list = field(default_factory=list)


def steps_for(pairs: int, chunk: int, warmup: int) -> int:
    """Steps to ask of the run: a chunk of the run overshoots by the steps it makes while the pause lands."""
    return warmup + 3 * pairs * chunk


def take_turns(run: Run, bare: TurnTaker, pairs: int, chunk: int, warmup: int) -> Turns:
    """Both sides' warm-up (`warmup` steps each), then `pairs` pairs of chunks of `chunk` steps. `run` (asked for
    `steps_for` steps) has been started and paused; it is stopped at the end (and the bare loop closed), whatever
    happened."""
    turns = Turns()
    try:
        bare.chunk(warmup)
        made = run_chunk(run, warmup)
        for pair in range(pairs):
            for side in (("run", "bare") if pair % 2 == 0 else ("bare", "run")):
                if side == "run":
                    start, made = made, run_chunk(run, made + chunk)
                    turns.run_chunks.append((start, made))
                else:
                    turns.bare_chunks.append(bare.chunk(chunk))
    finally:
        run.stop()
        bare.close()
    return turns


def paused_start(run: Run) -> Run:
    """Start `run` paused: its thread sets up (data, models, a compiled lane's compile) and stands before its first
    step."""
    run.start()
    run.pause()
    if not run.wait_paused(PATIENCE_S):
        raise SystemExit(f"FAIL: the run did not start: {run.status}")
    return run


def run_threads(run: Run) -> int:
    """The intra-op threads the run chose (its `started` event)."""
    return next(event for event in run.events() if event.kind == "started").data["intra_op_threads"]
