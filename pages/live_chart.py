"""A live run's board in the browser: a Streamlit component that draws the lanes table and the live charts, and moves
them from the files the run's publisher writes once per tick (amp_core.views.live_feed), fetched over HTTP at the
refresh period — not from a script rerun per session per second.

The component's page (live_chart_frontend/index.html) loads plotly.js from the installed plotly package, copied beside
it into a folder of this machine's temp directory once per plotly version: nothing is fetched from a network, and a
component's files must lie under its own folder (Streamlit serves every file under it, so the feeds are written there
too, under feed/<this process>/: two servers on one machine never share one).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import importlib.util
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Hashable
from pathlib import Path

import psutil
import streamlit.components.v1 as components

from amp_core.views.live_feed import LiveFeeds
from amp_core.views.shared import LiveFrame, live_refresh_s, live_room

FRONTEND = Path(__file__).with_name("live_chart_frontend") / "index.html"
PLOTLY_JS = Path(importlib.util.find_spec("plotly").origin).parent / "package_data" / "plotly.min.js"


def _served_folder() -> Path:
    """The component's folder: its index.html and plotly's bundle, made once per version of either."""
    page = FRONTEND.read_bytes()
    tag = hashlib.sha256(page).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"amp-lab-live-chart-{importlib.metadata.version('plotly')}-{tag}"
    if not (folder / "index.html").exists():
        building = Path(tempfile.mkdtemp(prefix="amp-lab-live-chart-"))
        shutil.copyfile(PLOTLY_JS, building / "plotly.min.js")
        (building / "index.html").write_bytes(page)  # last: a folder with an index.html is complete
        try:
            os.replace(building, folder)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    return folder


SERVED = _served_folder()
FEEDS_PATH = f"feed/{os.getpid()}-{secrets.token_hex(4)}"  # this process's feeds, under the component's folder and URL
_component = components.declare_component("amp_live_chart", path=str(SERVED))
_feeds: LiveFeeds | None = None
_feeds_lock = threading.Lock()


def _session_alive(session: str) -> bool:
    """Whether a session is still connected (a feed nobody watches stops ticking). Without a runtime (AppTest), yes."""
    from streamlit import runtime

    return not runtime.exists() or runtime.get_instance().is_active_session(session)


def _prune_ended_servers() -> None:
    """Remove the feeds of servers that ended without removing their own (killed): a folder per process id."""
    for folder in (SERVED / "feed").glob("*-*"):
        pid = folder.name.split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def live_feeds() -> LiveFeeds:
    """The process's publishers, ticking at the live room's tick (half the refresh period: a record reaches a browser
    polling every period within about a period and a half). Its feeds are removed when the process ends."""
    global _feeds
    with _feeds_lock:
        if _feeds is None:
            _prune_ended_servers()
            room = live_room()
            root = SERVED / FEEDS_PATH
            _feeds = LiveFeeds(root, room, room.cache.share_s, alive=_session_alive)
            atexit.register(shutil.rmtree, root, ignore_errors=True)
        return _feeds


def _session_id() -> str:
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else ""


def live_board(reader, frame: LiveFrame, choices: Hashable, render: Callable[[LiveFrame], dict], key: str) -> dict:
    """Draw run `frame.run_id`'s live board for this session's `choices` (the page's options that shape it; sessions
    that chose alike share one feed), published by the run's publisher from `render(frame)`'s boards (see
    LiveFeeds.watch) while this session watches. Returns the board drawn now ({'charts', 'table', 'signal'}).

    The component reruns the script (its value changes) only when the board's `signal` is not the one it was drawn
    with: the run's status or a lane's changed, and the page around the board must follow."""
    feeds = live_feeds()
    view = feeds.board(frame, choices, render)
    name, _ = feeds.watch(reader, frame.run_id, choices, render, _session_id(), frame=frame)
    # The table rides along (a few rows): the board shows it before its first fetch, and it is what AppTest reads.
    _component(feed=f"{FEEDS_PATH}/{name}", period_ms=round(live_refresh_s()[0] * 1000), signal=view["signal"],
               names=list(view["charts"]), table=view["table"], key=key, default=None)
    return view
