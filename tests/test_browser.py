"""A real browser on the real server: `streamlit run app.py`, Debian's Chromium driven by Playwright.

Launches a short two-mode run from the Train page, waits until the loss chart has points for both modes, and
saves a screenshot to artifacts/train_page.png.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from amp_core.precision import default_modes
from tests import streamlit_server

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = ROOT / "artifacts" / "train_page.png"
STEPS = 60

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]


@pytest.fixture
def server(tmp_path):
    port = streamlit_server.free_port()
    proc = streamlit_server.start(port, tmp_path / "runs.sqlite3")
    try:
        streamlit_server.wait_healthy(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        streamlit_server.stop(proc)


CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # this machine's network is closed: no phoning home

# Plotly keeps the drawn traces, typed arrays decoded, in the chart div's _fullData.
LOSS_POINTS = """() => {
    for (const div of document.querySelectorAll('.js-plotly-plot')) {
        const title = div.layout && div.layout.title && div.layout.title.text;
        if (!title || !title.includes('Loss') || !div._fullData) continue;
        return Object.fromEntries(div._fullData.map(t => [t.name, t._length || 0]));
    }
    return {};
}"""
# Streamlit marks elements of the previous script run as stale until the new run replaces or drops them.
SETTLED = "() => document.querySelectorAll('[data-stale=\"true\"]').length === 0"


def loss_points(page, modes: list[str], at_least: int) -> bool:
    points = page.evaluate(LOSS_POINTS)
    return all(points.get(mode, 0) >= at_least for mode in modes)


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def test_launch_two_modes_and_watch_the_loss_chart(server):
    from playwright.sync_api import expect, sync_playwright

    modes = default_modes("cpu")
    assert len(modes) == 2
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 2600})
            page.goto(server)
            launch = page.get_by_role("button", name="Launch")
            launch.wait_for(timeout=90_000)
            steps = page.get_by_label("Steps", exact=True)
            steps.fill(str(STEPS))
            steps.press("Enter")
            page.wait_for_timeout(500)
            for mode in modes:  # the default selection: 32-true and this machine's best mixed mode
                page.get_by_text(mode, exact=True).first.wait_for()
            launch.click()
            wait_until(lambda: loss_points(page, modes, 1), 120, "the loss chart to show both modes")
            page.get_by_text("Run status: finished").wait_for(timeout=120_000)
            wait_until(lambda: loss_points(page, modes, STEPS), 60, f"{STEPS} loss points per mode")
            expect(page.get_by_role("button", name="Pause")).to_have_count(0)
            page.wait_for_function(SETTLED, timeout=60_000)
            assert page.locator("[data-testid='stException']").count() == 0
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
