"""The request buttons in a real browser: tests/monitor_script.py runs in its own process (paused by the test between
its flushes) while Chromium, on a real server on the same store, asks it from the Op inspector to "Trace the next
step" and from Layer numerics for "Layer numerics at the next step". Each answer must appear on its page (the op table
lists the aten ops the script's step really ran; the per-module table names its modules); then the script is killed
with SIGKILL while a new request waits, and the page says the process ended. Screenshots: artifacts/requests_*.png.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from test_browser import CHROMIUM, CHROMIUM_ARGS, NO_PROBE_AWAITED, SETTLED
from test_browser_pages import VIEWPORT, screenshot
from test_monitor import said, start_script
from test_requests import go_on

from tests import streamlit_server

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Debian chromium")]

ANSWERED_TRACE = re.compile(r"Answered: every op of step \d+")
# The cells of every data grid on the page, as text: Glide draws them on a canvas and keeps an accessible copy of the
# rows in view in a DOM table beside it.
GRID_CELLS = """() => Array.from(document.querySelectorAll('[data-testid="stDataFrame"] td'))
    .map(cell => cell.textContent.trim()).filter(text => text)"""


def cells_once(page, names: list[str]) -> list[str]:
    """The grid cells, read in the same call that finds every one of `names` among them: the live page redraws every
    few seconds (on a busy machine a redraw can land between a wait and a second read, showing another table)."""
    found = page.wait_for_function(f"(names) => {{ const cells = ({GRID_CELLS})(); "
                                   "return names.every(name => cells.includes(name)) ? cells : null; }",
                                   arg=names, timeout=60_000)
    return found.json_value()


def test_requests_from_the_pages_are_answered_and_a_killed_process_is_named(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    store = tmp_path / "runs.sqlite3"
    proc = start_script(store, "--steps", "60", "--pause-at", "5,15,25,35,45")
    port = streamlit_server.free_port()
    server = None
    try:
        paused = said(proc)  # at step 5, flushed: the run is in the store, live
        server = streamlit_server.start(port, store)
        streamlit_server.wait_healthy(port, server)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                inspector = browser.new_page(viewport=VIEWPORT)
                inspector.goto(f"http://127.0.0.1:{port}/op_inspector")
                inspector.get_by_text("An attached run", exact=True).click(timeout=90_000)
                trace = inspector.get_by_role("button", name="Trace the next step")
                trace.click(timeout=60_000)
                inspector.get_by_text("waiting for the process to read it at its next flush").wait_for(timeout=60_000)
                go_on(proc)  # a flush by step 15 took the request, and traced the step after it
                said(proc)
                go_on(proc)  # flushed by step 25 at the latest: the answer is in the store
                said(proc)
                inspector.get_by_text(ANSWERED_TRACE).wait_for(timeout=60_000)
                inspector.get_by_text("Every op", exact=True).wait_for(timeout=60_000)
                inspector.wait_for_function(SETTLED, timeout=60_000)
                cells = set(cells_once(inspector, ["addmm"]))
                # The aten ops of the script's fp16 step: autocast's casts, its Linear layers' matmuls, its ReLU.
                assert {"_to_copy", "addmm", "relu"} <= cells, sorted(cells)
                assert inspector.locator("[data-testid='stException']").count() == 0
                inspector.mouse.move(0, 0)  # no tooltip over the page
                screenshot(inspector, "requests_trace")

                numerics = browser.new_page(viewport=VIEWPORT)
                numerics.goto(f"http://127.0.0.1:{port}/layer_numerics")
                layers = numerics.get_by_role("button", name="Layer numerics at the next step")
                layers.wait_for(timeout=90_000)
                # The page's own probe is drawn by a rerun when its answer is in (pages.answered): a click landing as
                # that rerun replaces the page can be lost (seen once under suite load). Click once it has drawn.
                numerics.wait_for_function(NO_PROBE_AWAITED, timeout=180_000)
                numerics.wait_for_function(SETTLED, timeout=60_000)
                layers.click(timeout=90_000)
                numerics.get_by_text("waiting for the process to read it at its next flush").wait_for(timeout=60_000)
                go_on(proc)  # taken by step 35
                said(proc)
                go_on(proc)  # answered by step 45
                said(proc)
                answered = numerics.get_by_text(re.compile(r"Answered: layer numerics of step \d+"))
                answered.wait_for(timeout=60_000)
                numerics.wait_for_function(SETTLED, timeout=60_000)
                answered.scroll_into_view_if_needed()  # the grid draws the cells it shows
                # The answer's table names the script's modules, by name (the page's other tables name other models'):
                # a timeout here if it never shows them.
                cells_once(numerics, ["0", "1", "2", "(root)"])
                assert numerics.locator("[data-testid='stException']").count() == 0
                numerics.mouse.move(0, 0)
                screenshot(numerics, "requests_layers")

                trace.click()  # asked again; the process dies before it reads it
                inspector.get_by_text("waiting for the process to read it at its next flush").wait_for(timeout=60_000)
                os.kill(proc.pid, signal.SIGKILL)
                assert proc.wait(60) == -signal.SIGKILL
                inspector.get_by_text("Not answered: the process ended (interrupted) before it answered").wait_for(
                    timeout=60_000)
                inspector.get_by_text(ANSWERED_TRACE).wait_for(state="detached")
                expect(inspector.get_by_role("button", name="Trace the next step")).to_be_disabled(timeout=30_000)
                run = inspector.locator("[data-testid='stSelectbox']", has_text="Run").locator("input")
                expect(run).to_have_value(re.compile(r"^monitor test script · .* · interrupted$"), timeout=30_000)
                screenshot(inspector, "requests_gone")
            finally:
                browser.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None:
            streamlit_server.stop(server)
    assert paused["paused_at"] == 5
