"""Work per refresh, not per viewer: what a live view of a run needs, computed once per run per tick and shared by
every session that shows the run.

A room of thirty people following one run used to cost the server thirty reads of the run's records, thirty
summaries and thirty sets of figures per redraw; here the first session to ask in a tick computes and the others read
what it computed (they wait for it rather than compute it again). A tick is `share_s` long, shorter than the pages'
redraw period: a session's timer is not aligned with anyone else's, and what it draws is at most `share_s` older than
what it would have read alone. Nothing here knows Streamlit: a key is (run id, tick, what), `what` carrying a session's
own choices (axis, smoothing, lanes) where they shape the result, so sessions that chose alike share that too.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

from amp_core.records.query import MAX_POINTS
from amp_core.views.live import RecordFollower

REFRESH_ENV = "AMP_LAB_LIVE_REFRESH_S"
"""Environment setting: the live views' redraw period in seconds (default DEFAULT_REFRESH_S)."""
DEFAULT_REFRESH_S = 1.0
"""Charts move every second: a run's record reaches a chart within about a period and a tick."""
MIN_REFRESH_S = 0.2
"""Below this, a browser would spend its time redrawing: refused with a message."""
KEEP_TICKS = 2
"""Ticks kept per run: the current one and the one before (a session whose tick just ended still finds its entry)."""


def live_refresh_s(environ: dict[str, str] | None = None) -> tuple[float, str]:
    """(the live views' redraw period, '' or the one-line reason the setting was not used): REFRESH_ENV if set to a
    number of seconds >= MIN_REFRESH_S, else DEFAULT_REFRESH_S."""
    text = (os.environ if environ is None else environ).get(REFRESH_ENV, "").strip()
    if not text:
        return DEFAULT_REFRESH_S, ""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < MIN_REFRESH_S:
        return DEFAULT_REFRESH_S, (f"{REFRESH_ENV}={text!r} is not a number of seconds >= {MIN_REFRESH_S:g}: the "
                                   f"live views redraw every {DEFAULT_REFRESH_S:g} s.")
    return value, ""


class _Entry:
    """One shared result: computed by the first asker, under its own lock so the others wait for it."""

    __slots__ = ("done", "lock", "value")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.value: Any = None


class TickCache:
    """Results keyed by (run id, tick, what), thread-safe; each is computed once per tick however many sessions ask.

    `computed` counts the computations per `what` (its first item when `what` is a tuple): what a room's server did,
    against what its sessions asked (`asked`)."""

    def __init__(self, share_s: float, clock: Callable[[], float] = time.monotonic):
        if not share_s > 0:
            raise ValueError(f"share_s must be > 0 seconds, got {share_s!r}")
        self.share_s = share_s
        self.clock = clock
        self.computed: Counter = Counter()
        self.asked: Counter = Counter()
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()

    def tick(self) -> int:
        return int(self.clock() // self.share_s)

    def get(self, run_id: str, what: Hashable, compute: Callable[[], Any], fresh: bool = False) -> Any:
        """The result of `compute()` for this run, tick and `what`: computed here if no session did in this tick, or
        if `fresh` (a session whose user just acted wants what is true now; the others then share it). A computation
        that raised is not kept (the next asker tries again) and raises to its caller."""
        tick = self.tick()
        key = (run_id, tick, what)
        name = what[0] if isinstance(what, tuple) and what else what
        with self._lock:
            self.asked[name] += 1
            entry = self._entries.get(key)
            if entry is None or fresh:
                entry = self._entries[key] = _Entry()
                for old in [k for k in self._entries if k[1] <= tick - KEEP_TICKS]:  # every run's: a view that
                    del self._entries[old]  # ended leaves nothing behind
        with entry.lock:
            if not entry.done:
                entry.value = compute()
                entry.done = True
                with self._lock:
                    self.computed[name] += 1
            return entry.value

    def forget(self, run_id: str) -> None:
        """Drop what is kept for a run (its view ended)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == run_id]:
                del self._entries[key]


class SharedFollowers:
    """One RecordFollower per run for every session (a follower keeps what it read between updates; one per session
    read the same records once per session). Each update runs under the follower's own lock: a StoredTrack serves one
    reader at a time. At most `max_runs` followed runs are kept (the least recently asked goes first)."""

    def __init__(self, max_runs: int = 16, max_points: int = MAX_POINTS):
        self.max_runs = max_runs
        self.max_points = max_points
        self._followers: dict[str, tuple[Any, threading.Lock]] = {}
        self._lock = threading.Lock()

    def update(self, run_id: str, reader) -> tuple[list, Any]:
        """(the run's lanes read now through its shared follower, that follower's step-time bands)."""
        with self._lock:
            held = self._followers.pop(run_id, None)
            if held is None:
                held = (RecordFollower(run_id, self.max_points), threading.Lock())
            self._followers[run_id] = held  # the most recently asked last
            while len(self._followers) > self.max_runs:
                del self._followers[next(iter(self._followers))]
        follower, lock = held
        with lock:
            return follower.update(reader), follower.bands


class LiveFrame:
    """One tick's reading of a live run, the same for every session: its lanes (series), the follower's step-time
    bands and the run's RunInfo read after the records (its steps and statuses at least as new as they are).
    `version` tells frames apart: what is derived from a frame is keyed by it (LiveRoom.get)."""

    __slots__ = ("bands", "info", "run_id", "series", "version")
    _versions = itertools.count()

    def __init__(self, run_id: str, series: list, bands: Any, info: Any):
        self.run_id, self.series, self.bands, self.info = run_id, series, bands, info
        self.version = next(self._versions)


class LiveRoom:
    """Every session's live views of every run, served from one TickCache and one follower per run."""

    def __init__(self, share_s: float, clock: Callable[[], float] = time.monotonic):
        self.cache = TickCache(share_s, clock)
        self.followers = SharedFollowers()

    def frame(self, reader, run_id: str, fresh: bool = False) -> LiveFrame:
        """The run's LiveFrame of this tick, read through `reader` (a RunReader) by the first session to ask (or
        now, if `fresh`: a page drawn whole after its user acted shows what is true now)."""
        def read() -> LiveFrame:
            series, bands = self.followers.update(run_id, reader)
            return LiveFrame(run_id, series, bands, reader.run_info(run_id))

        return self.cache.get(run_id, "frame", read, fresh)

    def get(self, frame: LiveFrame, what: tuple, compute: Callable[[], Any]) -> Any:
        """A result derived from `frame` (a table, figures for one set of choices: `what`, its first item naming
        it), shared by every session drawing that frame."""
        return self.cache.get(frame.run_id, (*what, frame.version), compute)


_room: LiveRoom | None = None
_room_lock = threading.Lock()


def live_room() -> LiveRoom:
    """The process's one LiveRoom (a server's sessions are threads of one process): ticks of half the redraw period,
    so a session draws what is at most half a period older than what it would have read alone."""
    global _room
    with _room_lock:
        if _room is None:
            _room = LiveRoom(live_refresh_s()[0] / 2)
        return _room
