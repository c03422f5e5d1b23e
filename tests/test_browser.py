"""A real browser on the real server: `streamlit run app.py`, Debian's Chromium driven by Playwright.

Launches a short two-mode run from the Train page, waits until the loss chart has points for both modes, and
saves a screenshot to artifacts/train_page.png.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from amp_core.precision import default_modes

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = ROOT / "artifacts" / "train_page.png"
STEPS = 60

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"streamlit was not healthy within {timeout_s} s")


@pytest.fixture
def server(tmp_path):
    port = free_port()
    env = dict(os.environ, AMP_LAB_STORE=str(tmp_path / "runs.sqlite3"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port), "--server.address",
         "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
