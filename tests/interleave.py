"""Tools that let a test hold two threads at chosen points, so a race happens in the order the test wants, every time.

Nothing here sleeps: a test waits on an Event that the other thread sets when it gets somewhere (or finds it must
wait for a lock the test holds it at).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

WAIT_S = 60.0
"""How long a test waits for a point that must come (a test that times out has found a hang)."""


class WatchedLock:
    """A Lock or RLock (wrapped) that sets `waited` when a thread finds it taken and has to wait for it."""

    def __init__(self, inner=None, waited: threading.Event | None = None):
        self._inner = inner if inner is not None else threading.Lock()
        self.waited = waited if waited is not None else threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._inner.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.waited.set()
        return self._inner.acquire(True, timeout)

    def release(self) -> None:
        self._inner.release()

    def __enter__(self) -> WatchedLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class HookedLock(WatchedLock):
    """A lock that, once armed, calls `after_release` right after the arming thread lets it go (once)."""

    def __init__(self, inner=None):
        super().__init__(inner)
        self._armed_for: threading.Thread | None = None
        self._after_release: Callable[[], None] | None = None

    def arm(self, after_release: Callable[[], None]) -> None:
        self._armed_for, self._after_release = threading.current_thread(), after_release

    def release(self) -> None:
        super().release()
        if self._armed_for is threading.current_thread():
            hook, self._armed_for = self._after_release, None
            hook()


class HookedEvent(threading.Event):
    """An Event whose `clear()`, once armed, first calls a hook (once) in the arming thread."""

    def __init__(self, was_set: bool = True):
        super().__init__()
        if was_set:
            self.set()
        self._armed_for: threading.Thread | None = None
        self._before_clear: Callable[[], None] | None = None

    def arm(self, before_clear: Callable[[], None]) -> None:
        self._armed_for, self._before_clear = threading.current_thread(), before_clear

    def clear(self) -> None:
        if self._armed_for is threading.current_thread():
            hook, self._armed_for = self._before_clear, None
            hook()
        super().clear()


def wait(event: threading.Event, what: str, timeout_s: float = WAIT_S) -> None:
    assert event.wait(timeout_s), f"timed out waiting for {what}"
