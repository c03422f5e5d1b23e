"""Answers a page asks for and never waits on: a probe (layer numerics, an op trace, which recipes run here) computed
on one worker thread, one at a time, and remembered per key for the server's life.

Why: a page that computes its probe on its own script thread is not usable until the probe ends, and when a room opens
the dashboard at once eight such scripts share two cores (and a fresh server's import gate). Off the script thread
the page draws its controls at once and a live part polls the answer (`done`); one worker for every page means a room's
probes run one after another instead of all slowing each other down, and a reopened page finds its answer made.

A failure is handed out, then forgotten: asked again, the key is computed again (a transient out-of-memory must not
stick), as Streamlit's own st.cache_data does with an exception.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from amp_core import background

MAX_ANSWERS = 32
"""Finished answers remembered (the oldest asked is forgotten first): as many as the Op inspector's trace cache held
when each page cached its own (st.cache_data), for every page's probes together."""


class Answer:
    """One key's answer: `done` once computed; then `value`, or `error` (the exception its compute raised)."""

    def __init__(self, key: Hashable, compute: Callable[[], Any]):
        self.key, self._compute = key, compute
        self.asked_at = time.monotonic()
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def waited_s(self) -> float:
        """Seconds since it was first asked for."""
        return time.monotonic() - self.asked_at

    def _run(self) -> None:
        returned = False
        try:
            self.value, returned = self._compute(), True
        except Exception as error:  # the page says what failed; the worker goes on with the next key
            self.error = error
        finally:
            if not returned and self.error is None:  # a BaseException (the interpreter exiting) ends the thread
                self.error = RuntimeError("the probe's thread ended before its answer")
            self._compute = None  # what it closed over (a workload, a run) is not kept with the answer
            self.done.set()

    def _abandon(self) -> None:
        self.error = RuntimeError("the server stopped it before it ran; reload the page to ask again")
        self._compute = None
        self.done.set()


class AnswerBoard:
    """Keys asked for, their answers computed in order on one worker thread (amp_core.background: stopped at exit)."""

    def __init__(self, max_answers: int = MAX_ANSWERS, thread_name: str = "amp-answers"):
        self.max_answers, self.thread_name = max_answers, thread_name
        self._answers: OrderedDict[Hashable, Answer] = OrderedDict()
        self._queue: list[Answer] = []
        """Asked, not started yet (the one under way is `_running`)."""
        self._running: Answer | None = None
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def ask(self, key: Hashable, compute: Callable[[], Any]) -> Answer:
        """The answer for `key`: remembered, under way, or queued now (`compute` runs on the worker, never here).
        A failed answer is returned once more only to those who hold it: asked again here, it is computed again."""
        with self._lock:
            answer = self._answers.get(key)
            if answer is not None and answer.done.is_set() and answer.error is not None:
                answer = None
            if answer is None:
                answer = self._answers[key] = Answer(key, compute)
                self._queue.append(answer)
                self._forget_oldest()
                if self._worker is None:
                    self._worker = background.start(self._work, self.thread_name, stop=self.stop)
            self._answers.move_to_end(key)
            return answer

    def ahead(self, answer: Answer) -> int:
        """How many answers the worker computes before this one starts (0: under way or done)."""
        with self._lock:
            return self._queue.index(answer) + (self._running is not None) if answer in self._queue else 0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every answer asked so far is made (for scripts and tests); False if `timeout_s` ran out."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout_s)
        return not (worker is not None and worker.is_alive())

    def stop(self) -> None:
        """Abandon the queued answers (each done, with an error saying so, and forgotten); the one under way ends as
        it would (a probe is one forward and backward)."""
        with self._lock:
            queued, self._queue = self._queue, []
            for answer in queued:
                self._answers.pop(answer.key, None)
                answer._abandon()

    def _forget_oldest(self) -> None:
        finished = [key for key, answer in self._answers.items() if answer.done.is_set()]
        for key in finished[:max(0, len(self._answers) - self.max_answers)]:
            del self._answers[key]

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = self._running = None
                    return
                answer = self._running = self._queue.pop(0)
            answer._run()
