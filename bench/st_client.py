"""A viewer that is not a browser: one Streamlit session opened over Streamlit's own websocket protocol, its page's
deltas received and counted, nothing rendered. Thirty of them on one event loop stand in for a room of viewers, so a
bench measures the server, not thirty Chromiums sharing its cores.

It does what the browser's frontend does to keep a page live, no more: it opens `/_stcore/stream` with the
"streamlit" subprotocol, asks for the page's first run (a `rerun_script` BackMsg naming the page as a URL path does),
and honours the server's `auto_rerun` messages the way the frontend's timers do (every `interval` seconds a
`rerun_script` for that fragment, `is_auto_rerun` set, until a `stop_auto_rerun` or a new script run). It sends no
widget states: a viewer who touches nothing sees every widget at its default.

    python3 -m bench.st_client http://127.0.0.1:8501 [--page compare] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable

from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ClientState_pb2 import ClientState
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from websockets.asyncio.client import connect


def stream_url(base_url: str) -> str:
    """http://host:port[/base] -> ws://host:port[/base]/_stcore/stream."""
    return base_url.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1) + "/_stcore/stream"


def element_text(msg: ForwardMsg) -> str:
    """The text a delta draws (markdown, a heading, a caption, an alert), '' for any other element."""
    element = msg.delta.new_element
    kind = element.WhichOneof("type")
    if kind in ("markdown", "heading", "alert", "text"):
        return getattr(element, kind).body
    return ""


class Viewer:
    """One session on one page. Counts what the server sent: messages per kind, elements per kind, bytes, script runs
    finished (whole or a fragment's). `on_message(viewer, msg)` sees every ForwardMsg as it arrives."""

    def __init__(self, base_url: str, page: str = "", on_message: Callable[[Viewer, ForwardMsg], None] | None = None):
        self.url = stream_url(base_url)
        self.page = page
        self.on_message = on_message
        self.page_script_hash = ""
        self.kinds: Counter = Counter()
        self.elements: Counter = Counter()
        self.bytes = 0
        self.runs_finished = 0
        self.fragment_runs = 0
        """Fragment runs started (a live part redrawn on its timer)."""
        self.texts: list[str] = []
        """The texts of the last full run's text elements (the page as a reader would see its words)."""
        self.error = ""
        self._timers: dict[str, asyncio.Task] = {}

    def _rerun(self, fragment_id: str = "") -> bytes:
        state = ClientState(page_name=self.page, page_script_hash=self.page_script_hash, fragment_id=fragment_id,
                            is_auto_rerun=bool(fragment_id))
        return BackMsg(rerun_script=state).SerializeToString()

    async def _auto_rerun(self, ws, fragment_id: str, interval: float) -> None:
        while True:  # the frontend's setInterval: a tick every interval, whether or not the last run has finished
            await asyncio.sleep(interval)
            await ws.send(self._rerun(fragment_id))

    def _stop_timers(self, fragment_ids=None) -> None:
        for fragment_id in list(self._timers) if fragment_ids is None else fragment_ids:
            task = self._timers.pop(fragment_id, None)
            if task is not None:
                task.cancel()

    async def run(self, stop: asyncio.Event) -> None:
        """Open the session, follow the page until `stop` is set, close. A failure is kept in `error`."""
        try:
            async with connect(self.url, subprotocols=["streamlit"], max_size=None, compression=None) as ws:
                await ws.send(self._rerun())
                reading = asyncio.ensure_future(self._read(ws))
                stopping = asyncio.ensure_future(stop.wait())
                await asyncio.wait([reading, stopping], return_when=asyncio.FIRST_COMPLETED)
                for task in (reading, stopping):
                    task.cancel()
        except Exception as error:  # a viewer that failed says why; the bench goes on with the others
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self._stop_timers()

    async def _read(self, ws) -> None:
        async for data in ws:
            msg = ForwardMsg()
            msg.ParseFromString(data)
            self.bytes += len(data)
            kind = msg.WhichOneof("type")
            self.kinds[kind] += 1
            if kind == "new_session" and not msg.metadata.run.fragment_ids:
                self._stop_timers()  # a full script run: the frontend drops its timers; the run sets them again
                self.page_script_hash = msg.new_session.page_script_hash
                self.texts = []
            elif kind == "new_session":
                self.fragment_runs += 1
            elif kind == "navigation":
                self.page_script_hash = msg.navigation.page_script_hash or self.page_script_hash
            elif kind == "auto_rerun":
                fragment_id = msg.auto_rerun.fragment_id
                self._stop_timers([fragment_id])
                self._timers[fragment_id] = asyncio.ensure_future(
                    self._auto_rerun(ws, fragment_id, msg.auto_rerun.interval))
            elif kind == "stop_auto_rerun":
                self._stop_timers(msg.stop_auto_rerun.fragment_ids)
            elif kind == "script_finished":
                self.runs_finished += 1
            elif kind == "delta" and msg.delta.WhichOneof("type") == "new_element":
                self.elements[msg.delta.new_element.WhichOneof("type")] += 1
                text = element_text(msg)
                if text:
                    self.texts.append(text)
            if self.on_message is not None:
                self.on_message(self, msg)


class Room:
    """Viewers on one event loop in a thread of their own: `start()` opens them, `stop()` closes them and returns."""

    def __init__(self, viewers: list[Viewer]):
        self.viewers = viewers
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="bench-viewers", daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            await asyncio.gather(*(viewer.run(self._stop) for viewer in self.viewers))

        self._loop.run_until_complete(main())
        self._loop.close()

    def start(self) -> Room:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        while self._stop is None and self._thread.is_alive():  # not started yet: it will be at once
            time.sleep(0.01)
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def wait(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Poll `condition` (reading the viewers' counts) until it holds or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.05)
        return condition()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--page", default="", help="the page's URL path ('' the home page, e.g. compare)")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    viewer = Viewer(args.url, args.page)
    room = Room([viewer]).start()
    time.sleep(args.seconds)
    room.stop()
    if viewer.error:
        raise SystemExit(viewer.error)
    print(f"runs_finished={viewer.runs_finished}")
    print(f"fragment_runs={viewer.fragment_runs}")
    print("elements=" + ",".join(f"{kind}:{count}" for kind, count in viewer.elements.most_common()))
    print(f"bytes_received={viewer.bytes}")


if __name__ == "__main__":
    main()
