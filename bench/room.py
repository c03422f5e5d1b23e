"""A room opens the dashboard at once: a fresh server, N sessions each opening another page at the same moment.

Streamlit runs each session's script on its own thread, so a room arriving together is N threads importing the
engine (torch's compiler stack, torchao, transformers) for the first time at once: what broke pages before
amp_core.imports gated those imports. Each try has two rooms.

In Chromium (what a user sees):
- a fresh `streamlit run app.py` on a free port with an empty store;
- one Chromium, N fresh contexts (sessions), each opening one page (Train, Advise, Op inspector, ...: the first N of
  the eight, cycling past eight) at the same moment; a page is usable once its title shows and its script run has
  ended with nothing stale left on it; then it is looked at for Streamlit's exception element and for the one-line
  error the page's edge draws (pages.common.PAGE_FAILED), both counted;
- then every page reopened at once in a new session (a module left broken in the server would show here);
- then a second fresh server that only the room's slowest page opens, alone: the lone session's first-usable time.
On one small machine the N browsers load Streamlit's frontend on the server's own cores, several times slower than
one browser does, before the server runs any page; and they reach the server one after another, not together. So
this room's ratio (chromium_slowest_vs_lone) measures the browsers as much as the server.

Over Streamlit's protocol (a room of laptops, as the server sees it):
- a fresh server; N protocol sessions (bench.st_client, no browser) open the same N pages at the same instant, each
  timed from that instant to the end of its page's first script run, its title drawn; exceptions and the page edge's
  one line counted as above; then the slowest page alone, on another fresh server, the same way.
In a room each browser runs on its own laptop: its load of the frontend is the same whether one or thirty open the
dashboard, and what the room adds is the server's. This room puts all N on the server at one instant (harsher than
laptops, which arrive within a second or two of each other) with the clients' cost near nothing:
room_slowest_vs_lone is the ratio the goal is about.

    python3 -m bench.room [--sessions 8] [--tries 5] [--timeout 120]   (from the repository root)
Per try: pages_with_exception (both rooms and the reopened one), pages_unframed (drawn alone, without app.py's
sidebar), the Chromium room's slowest_s, lone_s, chromium_slowest_vs_lone and served_vs_lone (the same two sessions
timed from the moment their page opened its connection to the server), and the protocol room's room_slowest_s,
room_lone_s, room_slowest_vs_lone. Last line: pages_with_exception=<sum over tries>.
Targets: pages_with_exception=0 and pages_unframed=0 in every try; room_slowest_vs_lone <= 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bench.st_client import Viewer
from bench.viewers import CHROMIUM, CHROMIUM_ARGS, VIEWPORT
from pages.common import PAGE_FAILED
from tests import streamlit_server

PAGES = (("", "Train"), ("advise", "Advise"), ("op_inspector", "Op inspector"),
         ("layer_numerics", "Layer numerics"), ("overflow_debugger", "Overflow debugger"), ("compare", "Compare runs"),
         ("workshop", "Workshop"), ("formats", "Number formats"))
"""Each page's URL path and the title it draws first (app.py's st.Page list)."""
USABLE = """([title, marker]) => {
    const app = document.querySelector('[data-testid="stApp"]');
    const heading = [...document.querySelectorAll('[data-testid="stMain"] h1')]
        .some(h => h.innerText.trim().startsWith(title));
    const failed = document.querySelector('[data-testid="stException"]')
        || [...document.querySelectorAll('[data-testid="stAlert"]')].some(e => e.innerText.includes(marker));
    return (heading || failed) && app && app.dataset.testScriptState === 'notRunning'
        && document.querySelectorAll('[data-stale="true"]').length === 0;
}"""
"""The page's title (or a traceback, or the page edge's one line) is drawn, its script run has ended and nothing of
an older run is left."""
FAILURES = """marker => ({
    unframed: !(document.querySelector('[data-testid="stSidebar"]')?.innerText || '').includes('Device'),
    tracebacks: [...document.querySelectorAll('[data-testid="stException"]')].map(e => e.innerText.slice(0, 300)),
    lines: [...document.querySelectorAll('[data-testid="stAlert"]')].map(e => e.innerText)
        .filter(text => text.includes(marker)).map(text => text.slice(0, 300)),
})"""
"""What went wrong on a page: Streamlit's traceback elements, our page edge's one-line errors, and whether the page
was drawn without app.py's frame (no sidebar: the page ran alone, narrow)."""


@dataclass(frozen=True, slots=True)
class Visit:
    path: str
    usable_s: float
    connected_s: float
    """When the page opened its WebSocket to the server (its code loaded and run): the server's part starts here."""
    tracebacks: list[str]
    lines: list[str]
    unframed: bool

    @property
    def served_s(self) -> float:
        return self.usable_s - self.connected_s

    @property
    def failed(self) -> bool:
        return bool(self.tracebacks or self.lines)


async def visit(browser, url: str, path: str, title: str, start: asyncio.Event, *, timeout_s: float) -> Visit:
    """One session: a fresh context opens `url/path` when `start` is set; seconds until usable, and what failed."""
    context = await browser.new_context(viewport=VIEWPORT)
    try:
        page = await context.new_page()
        connected: list[float] = []
        page.on("websocket", lambda _: connected.append(time.perf_counter()))
        await start.wait()
        started = time.perf_counter()
        await page.goto(f"{url}/{path}")
        await page.wait_for_function(USABLE, arg=[title, PAGE_FAILED], timeout=timeout_s * 1e3, polling=50)
        usable_s = time.perf_counter() - started
        found = await page.evaluate(FAILURES, PAGE_FAILED)
        connected_s = (connected[0] - started) if connected else 0.0
        return Visit(path, usable_s, connected_s, found["tracebacks"], found["lines"], found["unframed"])
    finally:
        await context.close()


async def together(visits: list[Callable[[asyncio.Event], Awaitable[Visit]]], ready_s: float) -> list[Visit]:
    """Every visit started, then let go at the same moment (`ready_s` after: time for each to get ready)."""
    start = asyncio.Event()
    tasks = [asyncio.create_task(one(start)) for one in visits]
    await asyncio.sleep(ready_s)
    start.set()
    return list(await asyncio.gather(*tasks))


async def room(browser, url: str, pages: list[tuple[str, str]], timeout_s: float) -> list[Visit]:
    """Every page opened at the same moment, each in its own session (its context made first: the goto calls then
    leave together)."""
    return await together([functools.partial(visit, browser, url, path, title, timeout_s=timeout_s)
                           for path, title in pages], ready_s=0.5)


async def protocol_visit(url: str, path: str, title: str, start: asyncio.Event, *, timeout_s: float) -> Visit:
    """One protocol session: opened when `start` is set; seconds until its page's first script run has ended with the
    title (or a traceback, or the page edge's one line) drawn, and what failed."""
    done = asyncio.Event()

    def on_message(viewer: Viewer, msg) -> None:
        if msg.WhichOneof("type") == "script_finished" and (
                any(text.startswith(title) for text in viewer.texts) or failures(viewer)):
            done.set()

    viewer = Viewer(url, path, on_message=on_message)
    await start.wait()
    started = time.perf_counter()
    session = asyncio.ensure_future(viewer.run(done))
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        done.set()
        await session
    if viewer.error:
        raise RuntimeError(f"/{path}: {viewer.error}")
    return Visit(path, time.perf_counter() - started, 0.0, failures(viewer), [], False)


def failures(viewer: Viewer) -> list[str]:
    """A protocol session's tracebacks (exception elements) and page-edge lines, as their count and words."""
    lines = [text[:300] for text in viewer.texts if PAGE_FAILED in text]
    return ["exception element"] * viewer.elements["exception"] + lines


async def protocol_room(url: str, pages: list[tuple[str, str]], timeout_s: float) -> list[Visit]:
    """Every page opened at the same instant over Streamlit's protocol, each in its own session."""
    return await together([functools.partial(protocol_visit, url, path, title, timeout_s=timeout_s)
                           for path, title in pages], ready_s=0.0)


@contextlib.asynccontextmanager
async def fresh_server(timeout_s: float):
    """A fresh `streamlit run app.py` with an empty store, healthy: its URL."""
    port = streamlit_server.free_port()
    with tempfile.TemporaryDirectory() as folder:
        proc = streamlit_server.start(port, Path(folder) / "runs.sqlite3", output=subprocess.DEVNULL)
        try:
            streamlit_server.wait_healthy(port, proc, timeout_s, poll_s=0.02)
            yield f"http://127.0.0.1:{port}"
        finally:
            streamlit_server.stop(proc)


async def on_fresh_server(browser, pages: list[tuple[str, str]], timeout_s: float, reopen: bool):
    """A fresh server (empty store), the room on it, and the room again in new sessions when `reopen`."""
    async with fresh_server(timeout_s) as url:
        first = await room(browser, url, pages, timeout_s)
        again = await room(browser, url, pages, timeout_s) if reopen else []
        return first, again


async def protocol_rooms(pages: list[tuple[str, str]], timeout_s: float) -> tuple[list[Visit], Visit]:
    """The protocol room on a fresh server, then its slowest page alone on another."""
    async with fresh_server(timeout_s) as url:
        visits = await protocol_room(url, pages, timeout_s)
    slowest = max(visits, key=lambda one: one.usable_s)
    async with fresh_server(timeout_s) as url:
        (lone,) = await protocol_room(url, [pages[visits.index(slowest)]], timeout_s)
    return visits, lone


def report(label: str, visits: list[Visit]) -> None:
    for one in visits:
        for text in one.tracebacks + one.lines + (["drawn alone, without the app's sidebar"] if one.unframed else []):
            print(f"# {label} /{one.path}: {' '.join(text.split())[:240]}")


async def main_async(sessions: int, tries: int, timeout_s: float) -> None:
    from playwright.async_api import async_playwright

    pages = [PAGES[index % len(PAGES)] for index in range(sessions)]
    failed_total, unframed_total, ratios, served_ratios, room_ratios = 0, 0, [], [], []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            await (await browser.new_page()).goto("about:blank")  # the browser's own start is not the server's
            for attempt in range(1, tries + 1):
                first, again = await on_fresh_server(browser, pages, timeout_s, reopen=True)
                slowest = max(first, key=lambda one: one.usable_s)
                (lone,), _ = await on_fresh_server(browser, [pages[first.index(slowest)]], timeout_s, reopen=False)
                protocol, protocol_lone = await protocol_rooms(pages, timeout_s)
                protocol_slowest = max(protocol, key=lambda one: one.usable_s)
                by_protocol = [*protocol, protocol_lone]
                report(f"try {attempt} room", first)
                report(f"try {attempt} reopened", again)
                report(f"try {attempt} protocol room", by_protocol)
                failed = sum(one.failed for one in first + again + by_protocol)
                failed_total += failed
                unframed = sum(one.unframed for one in first + again)
                unframed_total += unframed
                ratios.append(slowest.usable_s / lone.usable_s)
                served_ratios.append(slowest.served_s / lone.served_s)
                room_ratios.append(protocol_slowest.usable_s / protocol_lone.usable_s)
                print(f"try={attempt} pages_with_exception={failed} room_failed={sum(o.failed for o in first)} "
                      f"reopened_failed={sum(o.failed for o in again)} "
                      f"protocol_failed={sum(o.failed for o in by_protocol)} pages_unframed={unframed} "
                      f"slowest_page=/{slowest.path} "
                      f"slowest_s={slowest.usable_s:.2f} lone_s={lone.usable_s:.2f} "
                      f"chromium_slowest_vs_lone={ratios[-1]:.2f} slowest_served_s={slowest.served_s:.2f} "
                      f"lone_served_s={lone.served_s:.2f} served_vs_lone={served_ratios[-1]:.2f} "
                      f"room_slowest_page=/{protocol_slowest.path} room_slowest_s={protocol_slowest.usable_s:.2f} "
                      f"room_lone_s={protocol_lone.usable_s:.2f} room_slowest_vs_lone={room_ratios[-1]:.2f}",
                      flush=True)
        finally:
            await browser.close()
    print(f"sessions={sessions}")
    print(f"pages_unframed={unframed_total}")
    print(f"served_vs_lone_median={statistics.median(served_ratios):.2f}")
    print(f"chromium_slowest_vs_lone_median={statistics.median(ratios):.2f}")
    print(f"room_slowest_vs_lone_median={statistics.median(room_ratios):.2f}")
    print(f"pages_with_exception={failed_total}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    asyncio.run(main_async(args.sessions, args.tries, args.timeout))


if __name__ == "__main__":
    main()
