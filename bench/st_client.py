"""A viewer that is not a browser: one Streamlit session opened over Streamlit's own websocket protocol, its page's
deltas received and counted, nothing rendered. Thirty of them on one event loop stand in for a room of viewers, so a
bench measures the server, not thirty Chromiums sharing its cores.

It does what the browser's frontend does to keep a page live, no more: it opens `/_stcore/stream` with the
"streamlit" subprotocol, asks for the page's first run (a `rerun_script` BackMsg naming the page as a URL path does),
and honours the server's `auto_rerun` messages the way the frontend's timers do (every `interval` seconds a
`rerun_script` for that fragment, `is_auto_rerun` set, until a `stop_auto_rerun` or a new script run). It sends no
widget states: a viewer who touches nothing sees every widget at its default.

A live board (pages/live_chart.py) is followed as its component's page follows it: the same files of the run's feed,
fetched over HTTP at the same period (latest.json; the updates it missed, or whole.json when too far behind), on a
kept-alive connection asking for gzip as a browser does, so the server's cost of serving them is counted; and when
the board's signal is not the one the page drew, the component's value is sent (a rerun of its fragment), once.

    python3 -m bench.st_client http://127.0.0.1:8501 [--page compare] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable

from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.ClientState_pb2 import ClientState
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from streamlit.proto.WidgetStates_pb2 import WidgetState, WidgetStates
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


CATCH_UP = 6
"""Updates a board fetches one by one to catch up (index.html's); further behind, whole.json."""


class HttpClient:
    """GETs on one kept-alive HTTP/1.1 connection (reopened when the server closed it), bodies gunzipped: what a
    browser's fetch costs the server, without a browser."""

    def __init__(self, base_url: str):
        parts = urllib.parse.urlsplit(base_url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.wire = 0
        """The last body's length as it came over the wire (gzipped or not)."""
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body) of GET `path` (under the base URL's path); bytes as they came over the wire are counted by
        the caller from the body's length before gunzipping (`wire`)."""
        for attempt in (0, 1):
            if self._streams is None:
                self._streams = await asyncio.open_connection(self.host, self.port)
            reader, writer = self._streams
            try:
                writer.write(f"GET {self.prefix}/{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                             "Accept-Encoding: gzip\r\nConnection: keep-alive\r\n\r\n".encode())
                await writer.drain()
                return await self._response(reader)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _response(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int((await reader.readline()).split(b";")[0], 16):
                body += await reader.readexactly(size)
                await reader.readline()
            await reader.readline()
        else:
            body = await reader.readexactly(int(headers.get("content-length", 0)))
        if headers.get("connection", "").lower() == "close":
            self.close()
        self.wire = len(body)
        return status, gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


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
        self.base_url = base_url
        self.feed_fetches = 0
        """Files of a live board's feed fetched (latest.json, missed updates, whole.json)."""
        self.feed_updates = 0
        """Updates of the feed the board moved by (whole boards included)."""
        self.feed_wholes = 0
        self.board_seq = -1
        """The feed's update the board shows (-1: none yet)."""
        self._board: dict | None = None
        self._board_task: asyncio.Task | None = None
        self._asked_signal: str | None = None

    def _rerun(self, fragment_id: str = "") -> bytes:
        state = ClientState(page_name=self.page, page_script_hash=self.page_script_hash, fragment_id=fragment_id,
                            is_auto_rerun=bool(fragment_id))
        return BackMsg(rerun_script=state).SerializeToString()

    async def _auto_rerun(self, ws, fragment_id: str, interval: float) -> None:
        while True:  # the frontend's setInterval: a tick every interval, whether or not the last run has finished
            await asyncio.sleep(interval)
            await ws.send(self._rerun(fragment_id))

    def _follow_board(self, ws, msg: ForwardMsg) -> None:
        """A live board drawn (its component's arguments name its feed): follow its feed as its page does."""
        instance = msg.delta.new_element.component_instance
        args = json.loads(instance.json_args)
        if "feed" not in args:
            return
        path = f"component/{instance.component_name}/{args['feed']}"
        same = self._board is not None and self._board["path"] == path
        self._board = {"path": path, "args": args, "id": instance.id, "fragment": msg.delta.fragment_id}
        self._asked_signal = None  # the script drew the board with its signal: a later change is asked for anew
        if same and self._board_task is not None and not self._board_task.done():
            return
        if self._board_task is not None:
            self._board_task.cancel()
        self.board_seq = -1
        self._board_task = asyncio.ensure_future(self._poll_board(ws, HttpClient(self.base_url), path,
                                                                  args["period_ms"] / 1000))

    async def _fetch(self, http: HttpClient, path: str, file: str) -> dict | None:
        self.feed_fetches += 1
        status, body = await http.get(f"{path}/{file}?t={time.time_ns()}")
        self.bytes += http.wire
        return json.loads(body) if status == 200 else None

    async def _poll_board(self, ws, http: HttpClient, path: str, period_s: float) -> None:
        try:
            while True:  # the page's setInterval; a poll still fetching delays the next (index.html skips it)
                started = time.monotonic()
                await self._poll_once(ws, http, path)
                await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))
        except (OSError, ValueError, asyncio.IncompleteReadError) as error:  # said, not swallowed: the bench reads it
            self.error = f"feed {path}: {type(error).__name__}: {error}"
        finally:
            http.close()

    async def _catch_up(self, ws, http: HttpClient, path: str, latest: dict) -> bool:
        """From board_seq to latest, as the board does: the updates missed, then those latest.json carries."""
        if self.board_seq < 0 or latest["seq"] - self.board_seq > CATCH_UP:
            return False
        carried = [update for update in latest["updates"] if update["seq"] > self.board_seq]
        for seq in range(self.board_seq + 1, carried[0]["seq"]):
            update = await self._fetch(http, path, f"{seq}.json")
            if update is None:
                return False
            await self._applied(ws, update)
        for update in carried:
            await self._applied(ws, update)
        return True

    async def _poll_once(self, ws, http: HttpClient, path: str) -> None:
        latest = await self._fetch(http, path, "latest.json")
        if latest is None or latest["seq"] <= self.board_seq or await self._catch_up(ws, http, path, latest):
            return
        whole = await self._fetch(http, path, "whole.json")
        if whole is not None:
            self.feed_wholes += 1
            await self._applied(ws, whole)
            if whole["seq"] < latest["seq"]:
                await self._catch_up(ws, http, path, latest)

    async def _applied(self, ws, update: dict) -> None:
        self.feed_updates += 1
        self.board_seq = update["seq"]
        text = json.dumps(update["signal"])
        board = self._board
        if board is None or text == json.dumps(board["args"]["signal"]) or text == self._asked_signal:
            return
        self._asked_signal = text  # the page must follow the run's new state: the component's value reruns it
        state = WidgetState(id=board["id"], json_value=json.dumps({"signal": update["signal"], "at": time.time_ns()}))
        client = ClientState(page_name=self.page, page_script_hash=self.page_script_hash,
                             fragment_id=board["fragment"], widget_states=WidgetStates(widgets=[state]))
        await ws.send(BackMsg(rerun_script=client).SerializeToString())

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
            if self._board_task is not None:
                self._board_task.cancel()

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
                element = msg.delta.new_element.WhichOneof("type")
                self.elements[element] += 1
                if element == "component_instance":
                    self._follow_board(ws, msg)
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
    print(f"feed_fetches={viewer.feed_fetches}")
    print(f"feed_updates={viewer.feed_updates}")
    print("elements=" + ",".join(f"{kind}:{count}" for kind, count in viewer.elements.most_common()))
    print(f"bytes_received={viewer.bytes}")


if __name__ == "__main__":
    main()
