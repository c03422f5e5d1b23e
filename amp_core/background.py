"""Every thread AMP Lab starts, with how to stop it: at exit all are stopped and joined before Python shuts down.

A daemon thread still inside torch when the interpreter finalizes takes the process down with SIGABRT ("terminate
called without an active exception"): the thread is unwound while C++ frames that must not throw are on its stack.
So nothing is left to chance: runs, cost probes and the server's warm-up start through `start`, and `stop_all` (at
exit, at a server's shutdown, after each test) asks each to stop and waits for it. The threads stay daemons so a
thread that cannot stop in time still never holds the process open forever.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

STOP_TIMEOUT_S = 30.0
"""How long `stop_all` waits for the threads in all (a lane step under way finishes first)."""

_LOCK = threading.Lock()
_THREADS: dict[threading.Thread, Callable[[], None] | None] = {}


def start(target: Callable[[], None], name: str, stop: Callable[[], None] | None = None) -> threading.Thread:
    """Start `target` on a new daemon thread named `name`; `stop` (called from another thread) asks it to end soon.
    Without `stop` the thread is only waited for (it ends on its own: an import, a bounded measurement)."""
    thread = threading.Thread(target=_forgetting(target), name=name, daemon=True)
    with _LOCK:
        _THREADS[thread] = stop
    thread.start()
    return thread


def _forgetting(target: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            target()
        finally:
            with _LOCK:
                _THREADS.pop(threading.current_thread(), None)
    return run


def running() -> list[threading.Thread]:
    """The threads started here that have not ended."""
    with _LOCK:
        return [thread for thread in _THREADS if thread.is_alive()]


def stop_all(timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
    """Ask every thread started here to stop, then wait for them (at most `timeout_s` in all). Returns the names of
    those still going (none, unless one is stuck in a step longer than the timeout)."""
    with _LOCK:
        threads = list(_THREADS.items())
    me = threading.current_thread()
    for thread, stop in threads:
        if stop is not None and thread is not me:
            stop()
    deadline = time.monotonic() + timeout_s
    for thread, _ in threads:
        if thread is not me:
            thread.join(max(0.0, deadline - time.monotonic()))
    return [thread.name for thread, _ in threads if thread.is_alive() and thread is not me]


atexit.register(stop_all)
