"""Races between a run's thread and the pages, each played in the order that broke it (held there by events, not
timed by sleeps), and every thread the app starts stopped and joined at exit."""

from __future__ import annotations

import threading

import pytest
from interleave import HookedEvent, HookedLock, WatchedLock, wait
from stepped_run import SteppedRun

from amp_core import background
from amp_core.config import RunConfig
from amp_core.race import runner
from amp_core.race.runner import Run, RunLimitError, RunManager


def config(steps: int = 40, modes: tuple[str, ...] = ("32-true",)) -> RunConfig:
    return RunConfig(workload="mlp_regression", modes=modes, steps=steps, device="cpu")


def test_a_snapshot_taken_as_the_run_ends_is_whole(no_leaked_threads):
    """The op inspector copies a lane while the thread ends and frees it: what it copied must stay whole."""
    run = SteppedRun(config(), pause_after={3}).start()
    run.wait_until(SteppedRun.parked)
    lock = HookedLock(run._step_lock)
    run._step_lock = lock
    lock.arm(run.stop)  # the thread ends, and frees the lane's model, the moment the snapshot lets the lock go
    snapshot = run.snapshot_lane(0)
    assert not run.alive and run.lanes[0].state is None
    assert (snapshot.mode, snapshot.step, snapshot.precision.mode, snapshot.workload.name) == (
        "32-true", 3, "32-true", "mlp_regression")
    assert all(p.grad is None for p in snapshot.model.parameters())
    with pytest.raises(ValueError, match=r"lane 0 \(32-true\) has ended \(stopped\)"):
        run.snapshot_lane(0)


class HeldAtLastStep(SteppedRun):
    """A run that waits at the start of its last step until `go` is set, and sets `over` when its thread ends."""

    def __init__(self, *args, over: threading.Event, **kwargs):
        super().__init__(*args, **kwargs)
        self.go, self.over = threading.Event(), over
        self.hooks.before_lane_step.append(self._hold_last_step)
        self.hooks.run_end.append(lambda run: run.over.set())

    @staticmethod
    def _hold_last_step(run: HeldAtLastStep, lane, step) -> None:
        if step == run.config.steps - 1:
            wait(run.go, "the pause to begin")


def test_a_pause_as_the_run_finishes_leaves_it_finished(no_leaked_threads):
    """pause() saw "running"; before it wrote "paused" the run finished. A finished run left "paused" is polled by the
    page forever: the run must end "finished" whatever the order."""
    over = threading.Event()  # the thread has ended, or it waits for the lock a pause holds
    run = HeldAtLastStep(config(steps=3), over=over)
    run._control = WatchedLock(waited=over)
    run._resume = HookedEvent()
    run.start()
    run.wait_until(lambda r: r.lane_steps == 2)  # the thread now waits at the start of its last step

    def finish_the_run() -> None:  # inside pause(): the status was read as "running", the pause not yet written
        run.go.set()
        wait(over, "the run to end (or to wait for the pause)")

    run._resume.arm(finish_the_run)
    run.pause()
    run.join(60)
    assert not run.alive
    assert run.status == "finished"
    assert [lane.status for lane in run.lanes] == ["finished"]
    run.resume()  # nothing to resume: a finished run stays finished
    assert run.status == "finished"


def test_two_launches_at_once_cannot_pass_the_limit(monkeypatch, no_leaked_threads):
    """The first launch has created its run but not started its thread when the second counts the runs going."""
    starting, release, decided = threading.Event(), threading.Event(), threading.Event()

    class SlowToStart(SteppedRun):
        def start(self):
            if not starting.is_set():
                starting.set()
                wait(release, "the second launch to be decided")
            return super().start()

    monkeypatch.setattr(runner, "Run", SlowToStart)
    manager = RunManager(None, max_running=1)
    manager._lock = WatchedLock(manager._lock, waited=decided)  # a launch that waits for the lock is decided later
    outcomes: dict[str, Run | Exception] = {}

    def launch(name: str) -> None:
        try:
            outcomes[name] = manager.launch(config(steps=5))
        except RunLimitError as error:
            outcomes[name] = error
        finally:
            if name == "second":
                decided.set()

    first = threading.Thread(target=launch, args=("first",))
    first.start()
    wait(starting, "the first launch to create its run")
    second = threading.Thread(target=launch, args=("second",))
    second.start()
    wait(decided, "the second launch")
    release.set()
    first.join(60)
    second.join(60)
    manager.stop_all()
    assert isinstance(outcomes["first"], Run)
    assert isinstance(outcomes["second"], RunLimitError), outcomes
    assert "1 runs are already going (at most 1)" in str(outcomes["second"])
    assert [run.run_id for run in manager.runs()] == [outcomes["first"].run_id]


def test_a_launch_the_store_refuses_holds_no_place(monkeypatch):
    manager = RunManager(None, max_running=1)

    def refuse(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(runner.RecordSink, "open", refuse)
    with pytest.raises(OSError, match="disk full"):
        manager.launch(config(steps=5))
    assert manager.runs() == []
    monkeypatch.undo()
    manager.launch(config(steps=5)).join(60)


def test_stop_all_stops_and_joins_every_thread_the_app_started():
    from amp_core.diagnostics.cost import ProbeBoard

    run = SteppedRun(config(steps=1_000_000)).start()
    run.wait_until(lambda r: r.lane_steps >= 1)
    board = ProbeBoard(steps=10_000_000, time_cap_s=600)
    assert board.get(config(steps=10)) is None  # racing now
    assert {thread.name for thread in background.running()} >= {f"amp-run-{run.run_id}", "amp-probe"}
    assert background.stop_all(timeout_s=60) == []
    assert background.running() == [] and not run.alive
    assert run.status == "stopped"
