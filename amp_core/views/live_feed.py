"""A live view that does not rerun per session: one publisher per live run computes, once per tick, what changed on
its board (the lanes table, the charts' new points) and writes it to files every session's browser fetches.

A room of thirty sessions used to cost the server thirty script reruns a second (Streamlit's own ~2 ms each, on the
interpreter lock the run's training thread holds): each reran its live part to be sent the same changes. Here the
server's work per tick is one reading of the run and one set of changes per set of choices (`LiveFeeds.watch`'s
`choices`: sessions that chose alike share one feed), whatever the room; each browser polls the feed's files over
HTTP at the refresh period (pages/live_chart.py's component serves them from its folder) and applies the changes
itself. A session's script runs again only when its board says that something the page draws changed (`signal`:
the run's status, a lane's), not every second.

A feed's folder holds, each written whole and atomically (a temporary file, then os.replace: a reader never sees
half of one):
- `<seq>.json`: each of the last KEEP_UPDATES updates, {seq, base, names, charts: {name: ChartFeed's update}, table,
  signal} (a browser that missed some catches up without a whole figure);
- `latest.json`: {seq, updates: [the last CARRY_UPDATES updates]}: a browser polling once a period while the publisher
  ticks twice finds both in one fetch;
- `whole.json`: everything at one update (every WHOLE_EVERY), each chart as a reset: what a browser that holds nothing
  (or is too far behind) fetches, then the updates since, kept beside it.
A tick whose reading changed nothing (a paused run) writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from amp_core import background
from amp_core.runs import is_live
from amp_core.views.chart_feed import ChartFeed
from amp_core.views.shared import LiveFrame, LiveRoom

WHOLE_EVERY = 4
"""Updates between two whole.json: writing everything is most of a publication's cost (its JSON), and a browser needs
it only when it opens or falls behind."""
KEEP_UPDATES = WHOLE_EVERY + 2
"""Updates kept beside latest.json: a browser up to this many behind (one that just drew whole.json) catches up update
by update."""
CARRY_UPDATES = 2
"""Updates latest.json carries: the ticks in one refresh period (a tick is half of one, see LiveFeeds' tick_s)."""
STOP_WAIT_S = 10.0
"""How long `LiveFeeds.close` waits for a publisher's thread."""


def feed_name(run_id: str, choices: Hashable) -> str:
    """A feed's folder name: a digest of its run and choices (a URL path segment whatever a run id holds)."""
    return hashlib.sha256(repr((run_id, choices)).encode()).hexdigest()[:20]


def _dump(value: Any) -> bytes:
    # allow_nan=False: a NaN or infinity left in would make a file JSON.parse refuses (ChartFeed's specs hold none).
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def write_atomically(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file in its folder, then os.replace (a reader fetching it meanwhile
    reads the old file or the new one, never half)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class Publisher:
    """One feed's files: the board of one run seen with one set of choices, an update per tick that changed it."""

    def __init__(self, folder: Path, keep: int = KEEP_UPDATES, carry: int = CARRY_UPDATES,
                 whole_every: int = WHOLE_EVERY):
        if keep < whole_every:
            raise ValueError(f"keep ({keep}) must be >= whole_every ({whole_every}): a browser that drew whole.json "
                             "catches up from the updates kept")
        self.folder = folder
        self.keep = keep
        self.whole_every = whole_every
        self._carried: deque[bytes] = deque(maxlen=carry)
        self.seq = -1
        """The last update written (-1: none yet)."""
        self.written = 0
        """Updates written (what a test counts)."""
        self._feeds: dict[str, ChartFeed] = {}
        self._specs: dict[str, dict] = {}
        self._table: Any = None
        self._signal: Any = None
        self._version = -1
        self._lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)

    def publish(self, view: dict, version: int = 0) -> bool:
        """Write the update from the last view to `view` ({'charts': {name: figure_spec}, 'table', 'signal'}, all
        JSON-ready, `charts` in the order the board draws them), made from the reading `version` (LiveFrame's); False
        when nothing changed or the reading is older than the last published (nothing is written: a feed never goes
        back)."""
        with self._lock:
            specs = view["charts"]
            if version < self._version:
                return False
            self._version = version
            if specs == self._specs and view["table"] == self._table and view["signal"] == self._signal:
                return False
            for name in [name for name in self._feeds if name not in specs]:  # a chart that went: its feed too
                del self._feeds[name]
            charts = {}
            for name, spec in specs.items():
                if self._specs.get(name) != spec:  # a chart that did not change is left out of the update
                    charts[name] = self._feeds.setdefault(name, ChartFeed()).update(spec)
            self._specs, self._table, self._signal = specs, view["table"], view["signal"]
            self.seq += 1
            names = list(specs)
            update = _dump({"seq": self.seq, "base": self.seq - 1, "names": names, "charts": charts,
                            "table": view["table"], "signal": view["signal"]})
            write_atomically(self.folder / f"{self.seq}.json", update)
            # Before latest.json: a board that read latest.json finds a whole.json at most whole_every - 1 updates
            # behind it, and the updates since are kept.
            if self.seq % self.whole_every == 0:
                whole = _dump({"seq": self.seq, "names": names, "table": view["table"], "signal": view["signal"],
                               "charts": {name: self._feeds[name].whole(spec) for name, spec in specs.items()}})
                write_atomically(self.folder / "whole.json", whole)
            self._carried.append(update)
            latest = b'{"seq":%d,"updates":[%s]}' % (self.seq, b",".join(self._carried))
            write_atomically(self.folder / "latest.json", latest)
            (self.folder / f"{self.seq - self.keep}.json").unlink(missing_ok=True)
            self.written += 1
            return True


class _Watched:
    """A live run being published: its publishers (one per set of choices), their renderers and watching sessions."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.publishers: dict[Hashable, Publisher] = {}
        self.renders: dict[Hashable, Callable[[LiveFrame], dict]] = {}
        self.sessions: dict[str, Hashable] = {}
        """Each watching session's choices (a session watches one feed of a run at a time)."""
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()


class LiveFeeds:
    """Every live run's publishers in this process, each run's ticked by one thread of its own while a session
    watches it and it is live.

    `room` shares each tick's reading of the run (and what is derived from it) with anything else that reads it;
    `tick_s`: how often a publisher reads the run; `alive(session)`: whether a session is still connected (a feed
    nobody watches stops ticking, so an unwatched run pays nothing for its viewers). `computed` counts the boards
    rendered per set of choices' first item: one per tick per feed, however many sessions watch it."""

    def __init__(self, root: Path, room: LiveRoom, tick_s: float, alive: Callable[[str], bool] = lambda _: True,
                 keep: int = KEEP_UPDATES):
        if not (math.isfinite(tick_s) and tick_s > 0):
            raise ValueError(f"tick_s must be > 0 seconds, got {tick_s!r}")
        self.root = root
        self.room = room
        self.tick_s = tick_s
        self.alive = alive
        self.keep = keep
        self.computed: Counter = Counter()
        self._runs: dict[str, _Watched] = {}
        self._lock = threading.Lock()

    def board(self, frame: LiveFrame, choices: Hashable, render: Callable[[LiveFrame], dict]) -> dict:
        """The board of `frame` for `choices`, rendered once for every session and publisher that asks."""
        def made() -> dict:
            self.computed[choices[0] if isinstance(choices, tuple) and choices else choices] += 1
            return render(frame)

        return self.room.get(frame, ("board", choices), made)

    def watch(self, reader, run_id: str, choices: Hashable, render: Callable[[LiveFrame], dict], session: str,
              frame: LiveFrame | None = None) -> tuple[str, int]:
        """Make sure run `run_id`'s board for `choices` is published while `session` watches it; returns (the feed's
        folder, relative to `root`; its seq now). `render(frame)` makes the board from a tick's reading:
        {'charts': {name: figure_spec}, 'table', 'signal'}, JSON-ready. `frame`: the reading the session's page drew
        (published now, on the session's thread, unless a newer one was: the board's first fetch finds files, and
        what the page drew); without one, a new feed reads the run at once."""
        name = feed_name(run_id, choices)
        with self._lock:
            watched = self._runs.setdefault(run_id, _Watched(reader))
            publisher = watched.publishers.get(choices)
            new = publisher is None
            if new:  # first: a folder that cannot be made (OSError) leaves nothing registered to tick
                publisher = watched.publishers[choices] = Publisher(self.root / name, self.keep)
            watched.reader = reader
            watched.sessions[session] = choices
            watched.renders[choices] = render
            if watched.thread is None or not watched.thread.is_alive():
                watched.stop = stop = threading.Event()
                watched.thread = background.start(lambda: self._tick(run_id, watched, stop),
                                                  f"amp-lab-live-feed-{run_id}", stop=stop.set)
        if frame is None and new:
            frame = self.room.frame(reader, run_id, fresh=True)
        if frame is not None and frame.info is not None:
            publisher.publish(self.board(frame, choices, render), frame.version)
        return name, publisher.seq

    def _tick(self, run_id: str, watched: _Watched, stop: threading.Event) -> None:
        """A run's publishers' thread: every tick, one reading of the run and one update per watched feed; ends when
        the run is no longer live (its last update written), nobody watches it, or it is asked to (`stop`)."""
        while not stop.wait(self.tick_s):
            with self._lock:
                for session in [s for s in watched.sessions if not self.alive(s)]:
                    del watched.sessions[session]
                feeds = {choices: (watched.renders[choices], watched.publishers[choices])
                         for choices in set(watched.sessions.values())}
                if not feeds:
                    watched.thread = None
                    return
            try:
                frame = self.room.frame(watched.reader, run_id)
                if frame.info is None:  # the run left the store: the sessions say so on their next run
                    return
                for choices, (render, publisher) in feeds.items():
                    publisher.publish(self.board(frame, choices, render), frame.version)
            except Exception:  # a store away for a moment: the next tick tries again (pages say what is wrong)
                continue
            if not is_live(frame.info):
                return

    def running(self, run_id: str) -> bool:
        """Whether run `run_id`'s publishers are ticking."""
        with self._lock:
            watched = self._runs.get(run_id)
            return watched is not None and watched.thread is not None and watched.thread.is_alive()

    def close(self) -> None:
        """Stop every publisher's thread and wait for it (a test's end; a server's are stopped by amp_core.background
        at its shutdown)."""
        with self._lock:
            held = [(w.stop, w.thread) for w in self._runs.values() if w.thread is not None]
        for stop, thread in held:
            stop.set()
            thread.join(STOP_WAIT_S)
