"""The answer board (amp_core.diagnostics.answers): what pages ask of it is computed on its one worker thread, one
answer at a time in the order asked, remembered per key; a failure is handed out and computed again when asked anew;
a stop abandons what waits. Real threads; each compute is held by an event the test releases, never by a sleep."""

from __future__ import annotations

import threading

import pytest

from amp_core import background
from amp_core.diagnostics.answers import AnswerBoard

WAIT_S = 30.0


class Held:
    """A compute that signals it started, then waits until the test releases it; counts its calls."""

    def __init__(self, value, error: Exception | None = None):
        self.value, self.error = value, error
        self.started, self.release = threading.Event(), threading.Event()
        self.calls, self.threads = 0, []

    def __call__(self):
        self.calls += 1
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.release.wait(WAIT_S)
        if self.error is not None:
            raise self.error
        return self.value


def test_answers_are_made_on_one_worker_one_at_a_time_in_the_order_asked_and_remembered():
    board = AnswerBoard()
    first, second = Held("one"), Held("two")
    answer_one, answer_two = board.ask("one", first), board.ask("two", second)
    assert first.started.wait(WAIT_S)
    assert not answer_one.done.is_set() and not second.started.is_set()  # the second waits for the first
    assert (board.ahead(answer_one), board.ahead(answer_two)) == (0, 1)
    first.release.set()
    assert second.started.wait(WAIT_S) and answer_one.done.is_set() and answer_one.value == "one"
    second.release.set()
    assert answer_two.done.wait(WAIT_S) and answer_two.value == "two" and answer_two.error is None
    assert first.threads == second.threads == ["amp-answers"]  # never the asking thread
    again = Held("not computed")
    assert board.ask("one", again) is answer_one and again.calls == 0 and first.calls == 1


@pytest.mark.parametrize("error", [RuntimeError("out of memory (planted)"), ValueError("no such size")])
def test_a_failure_is_handed_out_then_computed_again_when_asked_anew(error):
    board = AnswerBoard()
    failing = Held(None, error)
    failing.release.set()
    answer = board.ask("key", failing)
    assert answer.done.wait(WAIT_S) and answer.error is error and answer.value is None
    mended = Held("made")
    mended.release.set()
    retried = board.ask("key", mended)
    assert retried is not answer and retried.done.wait(WAIT_S) and retried.value == "made"
    assert board.ask("key", Held("not computed")) is retried  # a success is remembered


def test_stop_abandons_what_waits_and_a_later_ask_computes_it():
    board = AnswerBoard()
    running, waiting = Held("running"), Held("waiting")
    under_way, queued = board.ask("running", running), board.ask("waiting", waiting)
    assert running.started.wait(WAIT_S)
    board.stop()
    assert queued.done.is_set() and waiting.calls == 0
    with pytest.raises(RuntimeError, match="stopped it before it ran; reload the page to ask again"):
        raise queued.error
    running.release.set()  # the answer under way ends as it would
    assert under_way.done.wait(WAIT_S) and under_way.value == "running"
    assert not background.stop_all(WAIT_S)  # the worker ends once nothing waits
    waiting.release.set()
    again = board.ask("waiting", waiting)
    assert again is not queued and again.done.wait(WAIT_S) and again.value == "waiting" and waiting.calls == 1


def test_the_oldest_finished_answers_are_forgotten_past_the_limit():
    board = AnswerBoard(max_answers=2)
    for key in ("a", "b", "c"):
        made = Held(key)
        made.release.set()
        assert board.ask(key, made).done.wait(WAIT_S)
    board.ask("b", Held("not computed"))  # asked again: the most recent
    recomputed = Held("a again")
    recomputed.release.set()
    assert board.ask("a", recomputed).done.wait(WAIT_S) and recomputed.calls == 1  # "a" had been forgotten
    kept = Held("not computed")
    assert board.ask("b", kept).value == "b" and kept.calls == 0
