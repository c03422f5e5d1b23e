"""The Workshop page in a real browser: `streamlit run app.py`, Debian's Chromium driven by Playwright, 1440 x 900.

Turns the presenter view on, picks a scenario, launches it, waits until every check has turned ✓ (waiting for the
elements, not for a time), and saves the presenter view to artifacts/workshop_presenter.png.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from amp_core.workshop import SCENARIOS
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, PLOTS, SETTLED, pick, server  # noqa: F401  (the real server fixture)

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "artifacts" / "workshop_presenter.png"
VIEWPORT = {"width": 1440, "height": 900}
SCENARIO = SCENARIOS["spike-recovery"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]

# The checks as drawn: each is a paragraph starting with its mark.
CHECK_MARKS = """() => Array.from(document.querySelectorAll('[data-testid="stMarkdownContainer"] p'))
    .map(p => p.textContent.trim()).filter(t => /^[✓✗…] /.test(t)).map(t => t[0])"""
ALL_HELD = f"(count) => {{ const marks = ({CHECK_MARKS})(); return marks.length === count && " \
           "marks.every(m => m === '✓'); }"
# The text size of every chart as plotly drew it.
CHART_FONT = f"""() => ({PLOTS})().map(div => div._fullLayout && div._fullLayout.font.size)"""


def test_a_scenario_end_to_end_in_the_presenter_view(server):  # noqa: F811  (the fixture)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{server}/workshop")
            page.get_by_role("heading", name="Workshop").wait_for(timeout=90_000)
            page.get_by_text("Presenter view").click()
            launch = page.locator(".st-key-workshop_launch_presenter button")  # the presenter view's one button
            launch.wait_for(timeout=60_000)
            page.wait_for_function(SETTLED, timeout=60_000)
            # Fewer controls: the room sees the page (the app's sidebar is hidden once the view's style has landed).
            page.locator("[data-testid='stSidebar']").wait_for(state="hidden", timeout=30_000)
            pick(page, lambda: page.locator("[data-testid='stSelectbox']").click(), SCENARIO.title)
            launch.click()
            page.get_by_role("heading", name=SCENARIO.title).wait_for(timeout=60_000)
            page.wait_for_function(ALL_HELD, arg=len(SCENARIO.checks), timeout=120_000)
            page.get_by_text(f"{len(SCENARIO.checks)} of {len(SCENARIO.checks)} checks held").wait_for(timeout=60_000)
            page.wait_for_function(SETTLED, timeout=60_000)
            assert page.locator("[data-testid='stException']").count() == 0
            fonts = page.evaluate(CHART_FONT)
            assert fonts and all(size == 20 for size in fonts)  # the charts' text is sized for a room
            # Nothing runs off the right edge of the window.
            assert page.evaluate("() => document.querySelector('[data-testid=stMain]').scrollWidth") <= 1440
            height = page.evaluate("() => document.querySelector('[data-testid=stMain]').scrollHeight")
            page.set_viewport_size({"width": VIEWPORT["width"], "height": max(VIEWPORT["height"], height)})
            page.wait_for_function(SETTLED, timeout=60_000)
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
