"""A real browser watching a user's own script live: tests/monitor_script.py (a Monitor around an fp16 loop) runs
in its own process, paused by the test halfway, while Chromium shows the Train page of a real server on the same
store. The page must show the run as watched live (no pause/stop of its own), its loss chart must grow when the
script goes on, and end as finished; the Overflow debugger follows it live too, and stops its timer at the end.
Screenshots of both live views: artifacts/monitor_live.png, artifacts/monitor_live_debugger.png.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_browser import CHROMIUM, CHROMIUM_ARGS, LOSS_POINTS, SETTLED

from amp_core.records.opening import open_store
from tests import streamlit_server

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "artifacts" / "monitor_live.png"
DEBUGGER_SCREENSHOT = ROOT / "artifacts" / "monitor_live_debugger.png"
STEPS, PAUSE_AT = 60, 19

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no Debian chromium")]
# The total number of loss points drawn (every trace of the loss chart; markers of skipped steps included).
LOSS_TOTAL_AT_LEAST = f"""(atLeast) => Object.values(({LOSS_POINTS})()).reduce((a, b) => a + b, 0) >= atLeast"""


def test_a_monitored_script_is_watched_live_in_the_browser(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    store = tmp_path / "runs.sqlite3"
    port = streamlit_server.free_port()
    server = streamlit_server.start(port, store)
    script = subprocess.Popen([sys.executable, str(ROOT / "tests" / "monitor_script.py"), "--store", str(store),
                               "--steps", str(STEPS), "--pause-at", str(PAUSE_AT), "--overflow-at", "12"],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        paused = json.loads(script.stdout.readline())  # the script flushed its first 20 steps and waits
        assert paused["paused_at"] == PAUSE_AT
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                streamlit_server.wait_healthy(port, server)
                page.goto(f"http://127.0.0.1:{port}")
                page.get_by_text("Watched live: a Monitor in").wait_for(timeout=90_000)
                page.wait_for_function(LOSS_TOTAL_AT_LEAST, arg=PAUSE_AT + 1, timeout=60_000)
                assert page.get_by_role("button", name="Pause").count() == 0  # the script's own loop decides
                before = sum(page.evaluate(LOSS_POINTS).values())
                page.wait_for_function(SETTLED, timeout=60_000)
                page.get_by_text("Run status:").scroll_into_view_if_needed()  # the live view, below the form
                SCREENSHOT.parent.mkdir(exist_ok=True)
                page.screenshot(path=str(SCREENSHOT), full_page=True)

                # The Overflow debugger follows the same script live (another process, through the store).
                debugger = browser.new_page(viewport={"width": 1440, "height": 900})
                debugger.goto(f"http://127.0.0.1:{port}/overflow_debugger")
                live = debugger.get_by_text("live: redrawn every second")
                live.wait_for(timeout=90_000)
                assert f"lane 0 {PAUSE_AT + 1} steps" in live.inner_text()
                debugger.wait_for_function(SETTLED, timeout=60_000)
                live.scroll_into_view_if_needed()  # the live view, below the fault-injection form
                debugger.screenshot(path=str(DEBUGGER_SCREENSHOT), full_page=True)

                script.stdin.write("\n")  # go on: the page follows the rest through the store
                script.stdin.flush()
                page.get_by_text("Run status: finished").wait_for(timeout=120_000)
                live.wait_for(state="detached", timeout=60_000)  # the debugger saw the end: drawn once, no timer
                # The pickers say so too (the browser shows a chosen option's new label, not the one it first drew).
                lane = debugger.locator("[data-testid='stSelectbox']", has_text="Lane").locator("input")
                expect(lane).to_have_value("lane 0 · 16-mixed · finished", timeout=30_000)
                run = debugger.locator("[data-testid='stSelectbox']", has_text="Run").locator("input")
                expect(run).to_have_value(re.compile(r"^monitor test script · .* · finished$"), timeout=30_000)
                assert debugger.locator("[data-testid='stException']").count() == 0
                page.wait_for_function(LOSS_TOTAL_AT_LEAST, arg=STEPS, timeout=60_000)
                assert sum(page.evaluate(LOSS_POINTS).values()) > before  # the chart moved
                assert page.locator("[data-testid='stException']").count() == 0
            finally:
                browser.close()
        assert script.wait(timeout=60) == 0
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
        streamlit_server.stop(server)
    (run,) = open_store(store).runs()["run_id"]
    assert run == paused["run_id"] and SCREENSHOT.stat().st_size > 10_000
