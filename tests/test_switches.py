"""Process-global switches are set per lane step and never leak: TF32 flags under one lock, intra-op threads per
thread (two real runs at once with different choices), the user's own settings survive. Interleavings are driven
with events."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from amp_core.config import RunConfig
from amp_core.precision import switches
from amp_core.race.runner import Run
from amp_core.workloads import WORKLOADS
from amp_core.workloads.mlp_regression import MLPRegression

WAIT_S = 60.0


def test_tf32_context_is_its_own_from_two_threads_and_the_users_setting_survives():
    before = switches._read_tf32()
    a_inside, b_trying, b_inside, a_left = (threading.Event() for _ in range(4))
    seen: dict[str, list[bool]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def lane_a() -> None:
        with switches.lane_step_switches(True):
            seen["a"].append(switches.tf32_enabled())
            a_inside.set()
            assert b_trying.wait(WAIT_S)
            # B is at the lock now: it must not get in (nor touch the flags) while A's step runs.
            assert not b_inside.wait(0.2)
            seen["a"].append(switches.tf32_enabled())
        a_left.set()

    def lane_b() -> None:
        assert a_inside.wait(WAIT_S)
        b_trying.set()
        with switches.lane_step_switches(False):
            b_inside.set()
            assert a_left.is_set()
            seen["b"].append(switches.tf32_enabled())

    def guarded(target):
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # surfaced in the test thread below
                errors.append(exc)
        return run

    threads = [threading.Thread(target=guarded(t)) for t in (lane_a, lane_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not errors, errors
    assert seen == {"a": [True, True], "b": [False]}
    assert switches._read_tf32() == before
    # The legacy view still reads (torch >= 2.9 raises on it after a mix of APIs, unless the strings are restored).
    assert isinstance(torch.backends.cuda.matmul.allow_tf32, bool)
    assert isinstance(torch.backends.cudnn.allow_tf32, bool)


def test_tf32_context_restores_a_setting_the_user_made():
    if switches._FP32_PRECISION_KNOBS:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        try:
            with switches.lane_step_switches(False):
                assert not switches.tf32_enabled()
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        finally:
            torch.backends.cuda.matmul.fp32_precision = "none"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            with switches.lane_step_switches(False):
                assert not switches.tf32_enabled()
            assert torch.backends.cuda.matmul.allow_tf32
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False


class ThreadsWatched(MLPRegression):
    """mlp_regression whose forward records the intra-op threads it runs with, and can stop at its n-th call."""

    def __init__(self, name: str, on_forward):
        self.name = name
        self._on_forward = on_forward

    def build_model(self, size, data):
        model = super().build_model(size, data)
        on_forward = self._on_forward

        class Watched(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = model

            def forward(self, x):
                on_forward(torch.get_num_threads())  # a closure: lane copies (deepcopy) share it
                return self.inner(x)

        return Watched()


def test_two_runs_at_once_each_see_their_own_threads_and_new_threads_see_the_process_setting(monkeypatch):
    user_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the user's own setting, which new threads must get
    try:
        a_inside, b_checked = threading.Event(), threading.Event()
        seen: dict[str, list[int]] = {"a": [], "b": [], "fresh": []}

        def on_a(threads: int) -> None:
            seen["a"].append(threads)
            if len(seen["a"]) == 4:  # mid-run: hold A inside its forward while B runs and a new thread starts
                a_inside.set()
                assert b_checked.wait(WAIT_S)

        def on_b(threads: int) -> None:
            seen["b"].append(threads)
            if len(seen["b"]) == 4:
                assert a_inside.wait(WAIT_S)
                fresh = threading.Thread(target=lambda: seen["fresh"].append(torch.get_num_threads()))
                fresh.start()
                fresh.join()
                b_checked.set()

        monkeypatch.setitem(WORKLOADS, "threads_a", ThreadsWatched("threads_a", on_a))
        monkeypatch.setitem(WORKLOADS, "threads_b", ThreadsWatched("threads_b", on_b))
        run_a = Run(RunConfig(workload="threads_a", modes=("32-true", "bf16-mixed"), steps=8, device="cpu",
                              intra_op_threads=1)).start()
        run_b = Run(RunConfig(workload="threads_b", modes=("32-true",), steps=8, device="cpu",
                              intra_op_threads=3)).start()
        run_a.join(WAIT_S)
        run_b.join(WAIT_S)
        assert (run_a.status, run_b.status) == ("finished", "finished")
        assert b_checked.is_set()
        # Every forward (training steps and the sampled memory probe's) ran with its own run's threads.
        assert len(seen["a"]) > 16 and set(seen["a"]) == {1}
        assert len(seen["b"]) > 8 and set(seen["b"]) == {3}
        assert seen["fresh"] == [2]
        assert [e.data["intra_op_threads"] for run in (run_a, run_b) for e in run.events()[:1]] == [1, 3]
        # The user's own thread and threads started after the runs keep the user's setting.
        assert torch.get_num_threads() == 2
        assert switches.process_intra_op_threads() == 2
    finally:
        torch.set_num_threads(user_threads)


@pytest.mark.parametrize("threads", [1, 3])
def test_pinning_changes_only_the_calling_thread(threads):
    process = switches.process_intra_op_threads()
    out = {}

    def pinned() -> None:
        out["returned"] = switches.pin_intra_op_threads(threads)
        out["own"] = torch.get_num_threads()
        out["fresh"] = switches.process_intra_op_threads()

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert out == {"returned": process, "own": threads, "fresh": process}
    assert switches.process_intra_op_threads() == process


def scripted(times: list[tuple[float, float]]):
    """A step timer for team_is_faster reading (team, one thread) seconds per comparison from `times`: the calls it
    got, as (threads, seconds)."""
    calls: list[tuple[int, float]] = []
    comparison = iter(times)
    current: list[tuple[float, float]] = []

    def time_step(threads: int) -> float:
        if len(calls) % (2 * switches.MEASURE_ROUNDS) == 0:
            current[:] = [next(comparison)]
        team_s, one_s = current[0]
        seconds = one_s if threads == 1 else team_s
        calls.append((threads, seconds))
        return seconds

    return time_step, calls


@pytest.mark.parametrize(("times", "kept"), [
    # One thread slowed on every turn of the first comparison (a moment of load), not of the second: one thread.
    ([(1.0, 2.0), (1.0, 1.1)], False),
    # Clearly slower every time: the team.
    ([(1.0, 2.0), (1.0, 2.0)], True),
    # Not clearly slower the first time: one thread, and no second comparison is made.
    ([(1.0, 1.4)], False),
])
def test_a_team_of_threads_is_kept_only_when_it_wins_every_comparison(times, kept):
    assert switches.COMPARISONS == 2 and switches.TEAM_MARGIN == 0.5  # the cases above are written for these
    time_step, calls = scripted(times)
    faster, team_s, one_s = switches.team_is_faster(time_step, 2)
    assert faster is kept
    assert len(calls) == 2 * switches.MEASURE_ROUNDS * len(times)  # each comparison made whole, none past the last
    assert [threads for threads, _ in calls[:2]] == [2, 1]  # the team and one thread in turn
    assert (team_s, one_s) == times[-1]  # the last comparison's bests, not the first's
