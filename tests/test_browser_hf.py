"""A real browser on the real server picks a transformers architecture (GPT-2) on the Train page, launches it and
watches its loss chart grow: Debian's Chromium driven by Playwright, as tests/test_browser.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from amp_core.precision import default_modes
from tests import streamlit_server
from tests.test_browser import (
    CHROMIUM,
    CHROMIUM_ARGS,
    LOSS_POINTS,
    LOSS_POINTS_AT_LEAST,
    SETTLED,
    choose,
    enter_number,
    open_train_page,
    settle_and_shoot,
)

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "artifacts" / "train_page_gpt2.png"
# Far more steps than any CPU finishes between two redraws, so the chart is seen growing on a fast machine too;
# the test stops the run once it has seen that.
STEPS = 2000
GPT2_TITLE = "GPT-2 (transformers, causal LM)"
DRAWN_POINTS = f"""modes => {{
    const points = ({LOSS_POINTS})();
    return modes.every(mode => (points[mode] || 0) >= 1) ? points : null;
}}"""
"""Each lane's loss points once every lane has one (null, so Playwright checks again, before that)."""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(600),  # transformers' import and a GPT-2 race on a busy 2-core machine: past the 300 s guard
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]


@pytest.fixture
def server(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")
    with streamlit_server.serving(tmp_path / "runs.sqlite3") as url:
        yield url


def test_pick_gpt2_launch_and_watch_its_charts_grow(server):
    from playwright.sync_api import sync_playwright

    modes = default_modes("cpu")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 2400})
            launch = open_train_page(page, server)
            choose(page, "Workload", GPT2_TITLE)  # Streamlit's selectbox: open it, then pick the option
            page.get_by_text("Parameters: small 34.2K").wait_for(timeout=120_000)  # counted from its config
            enter_number(page, "Steps", STEPS)
            enter_number(page, "Batch size", 8)
            page.wait_for_function(SETTLED, timeout=60_000)
            launch.click()
            # The points per lane, read in the same check that finds every lane drawn (a redraw between a wait and a
            # second read can find the chart being replaced).
            first = page.wait_for_function(DRAWN_POINTS, arg=modes, timeout=180_000).json_value()
            assert max(first.values()) < STEPS, f"the run ended before its chart was first read: {first}"
            # The chart grows while the run goes: more points than first drawn.
            page.wait_for_function(LOSS_POINTS_AT_LEAST, arg=[modes, min(first.values()) + 1], timeout=180_000)
            # The page's own Stop (Streamlit's header shows a "Stop" of its own while a script runs).
            page.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop", exact=True).click()
            page.get_by_text("Run status: stopped").wait_for(timeout=120_000)
            settle_and_shoot(page, SCREENSHOT)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
