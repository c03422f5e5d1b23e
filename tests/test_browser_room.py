"""A room opens the dashboard at once (bench.room's room, in a real browser on a real server): a fresh server, every
page opened by its own session at the same moment, then every page reopened in a new session; no page shows a
traceback or the page edge's one-line error, and none is drawn alone without app.py's frame, in each of three tries (a
fresh server each)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.room import PAGES, room
from pages.common import PAGE_FAILED
from tests import streamlit_server
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]
TRIES = 3
TIMEOUT_S = 180.0


async def rooms(store_folder: Path) -> list[str]:
    """TRIES fresh servers, each opened by a room and reopened; every failure any page showed, with its page."""
    from playwright.async_api import async_playwright

    failures = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for attempt in range(TRIES):
                with streamlit_server.serving(store_folder / f"try{attempt}" / "runs.sqlite3") as url:
                    for label in ("room", "reopened"):
                        for visit in await room(browser, url, list(PAGES), TIMEOUT_S):
                            failures += [f"try {attempt} {label} /{visit.path}: {text}"
                                         for text in visit.tracebacks + visit.lines]
                            if visit.unframed:
                                failures.append(f"try {attempt} {label} /{visit.path}: drawn alone, no sidebar")
                    log = streamlit_server.log_path(store_folder / f"try{attempt}" / "runs.sqlite3").read_text()
                    failures += [f"try {attempt} server log: {line}" for line in log.splitlines()
                                 if PAGE_FAILED in line]
        finally:
            await browser.close()
    return failures


def test_a_room_opening_every_page_at_once_sees_no_broken_page(tmp_path):
    for attempt in range(TRIES):
        (tmp_path / f"try{attempt}").mkdir()
    assert asyncio.run(rooms(tmp_path)) == []
