"""A real browser on the real server: `streamlit run app.py`, Debian's Chromium driven by Playwright.

Launches a short two-mode run from the Train page, waits until the loss chart has points for both modes, and
saves a screenshot to artifacts/train_page.png.
"""

from __future__ import annotations

import re
import shutil
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
    with streamlit_server.serving(tmp_path / "runs.sqlite3") as url:
        yield url


CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # this machine's network is closed: no phoning home

PLOTS = """() => [document, ...Array.from(document.querySelectorAll('iframe'), frame => frame.contentDocument)]
    .filter(doc => doc).flatMap(doc => Array.from(doc.querySelectorAll('.js-plotly-plot')))"""
"""Every plotly chart of the page: Streamlit's plotly elements in the document, and a live run's charts, each in a
same-origin frame of its own (pages/live_chart.py; a frame of another origin has no contentDocument here). Every
reader of the page's charts starts from this, so none misses the live ones."""
PAINTED = """() => Promise.all([window, ...Array.from(document.querySelectorAll('iframe'))
        .filter(frame => frame.contentDocument).map(frame => frame.contentWindow)]
    .map(w => new Promise(done => w.requestAnimationFrame(() => w.requestAnimationFrame(done)))))"""
"""Resolves once the page and each of its same-origin frames has painted twice more: a chart resized or scrolled into
view is drawn in a screenshot then, not the blank of a frame the browser left unpainted while it was out of sight."""
# Plotly keeps the drawn traces, typed arrays decoded, in the chart div's _fullData: points per trace of the loss chart.
LOSS_POINTS = f"""() => {{
    for (const div of ({PLOTS})()) {{
        const title = div.layout && div.layout.title && div.layout.title.text;
        if (!title || !title.includes('Loss') || !div._fullData) continue;
        return Object.fromEntries(div._fullData.map(t => [t.name, t._length || 0]));
    }}
    return {{}};
}}"""
# True once every mode's loss trace has at least `atLeast` points (Playwright re-checks it on each animation frame).
LOSS_POINTS_AT_LEAST = f"""([modes, atLeast]) => {{
    const points = ({LOSS_POINTS})();
    return modes.every(mode => (points[mode] || 0) >= atLeast);
}}"""
# Or a lane's failure drawn instead (pages/train.lane_problems): a wait for points that will never come ends at once.
LANE_FAILED = r"^(Lane .+ failed|The run failed):"
LOSS_POINTS_OR_A_FAILURE = f"""([modes, atLeast]) => ({LOSS_POINTS_AT_LEAST})([modes, atLeast])
    || Array.from(document.querySelectorAll("[data-testid='stAlert']"))
        .some(alert => /{LANE_FAILED}/m.test(alert.innerText))"""
# Streamlit marks elements of the previous script run as stale until the new run replaces or drops them.
SETTLED = ("() => document.querySelectorAll('[data-stale=\"true\"]').length === 0 "
           "&& document.fonts.status === 'loaded'")
"""Streamlit has redrawn everything, and its own web fonts have loaded: a width measured then is the same on every
machine (before, it is the system fallback font's, which differs between machines)."""
LIVE_FRAMES = "() => Array.from(document.querySelectorAll('iframe[src*=\"amp_live_chart\"]'))"
"""The frames of the live charts (pages/live_chart.py's component, amp_live_chart)."""
DRAWN = ("() => (" + SETTLED + ")() && (" + PLOTS + ")()"
         ".filter(chart => chart.getClientRects().length).every(chart => chart.querySelector('.main-svg'))"
         " && (" + LIVE_FRAMES + ")().every(frame => frame.contentWindow.liveChart"
         " && frame.contentWindow.liveChart.resets > 0 && frame.getBoundingClientRect().height > 0)")
"""SETTLED, and every chart shown has drawn (plotly draws a moment after Streamlit settles; a chart in a closed expander
draws nothing), a live chart's frame too: it has drawn its whole figure and been given its height (a frame that loads
after its first update asks for the whole figure and draws a tick or two later; undrawn, it has no plotly chart for
PLOTS to find): a screenshot waits for this, not for a fixed time. (A data grid draws when Glide decides to: a test
reads a grid through a locator inside it, which waits for it.)"""

NO_PROBE_AWAITED = "() => document.querySelector(\"[aria-label='hourglass_top icon']\") === null"
"""No note of pages.answered's is on the page (its :material/hourglass_top: icon, drawn as a span with that label):
every probe the page asked for is drawn."""


def scroll_to(page, locator, tries: int = 5) -> None:
    """Scroll `locator` into view. A page may redraw it meanwhile (a probe made off the page's thread is drawn by a
    rerun when it is in), detaching the element being scrolled to: then wait for the redraw, scroll to the new one."""
    from playwright.sync_api import Error as PlaywrightError

    for attempt in range(tries):
        try:
            locator.scroll_into_view_if_needed(timeout=30_000)
            return
        except PlaywrightError as error:
            if "not attached" not in str(error) or attempt == tries - 1:
                raise
            page.wait_for_function(SETTLED, timeout=60_000)


def open_train_page(page, url: str):
    """Go to the Train page at `url` and wait for its form to be drawn; returns its Launch button."""
    page.goto(url)
    launch = page.get_by_role("button", name="Launch")
    launch.wait_for(timeout=90_000)
    return launch


def wait_for_loss_points(page, modes: list[str], at_least: int, timeout_ms: int) -> None:
    """Wait until every mode's loss trace has `at_least` points; fails at once, with the page's words, when a lane's
    failure is drawn instead."""
    page.wait_for_function(LOSS_POINTS_OR_A_FAILURE, arg=[modes, at_least], timeout=timeout_ms)
    failures = [text for text in page.get_by_test_id("stAlert").all_inner_texts()
                if re.search(LANE_FAILED, text, re.MULTILINE)]
    assert not failures, f"a lane failed instead of drawing its loss: {failures}"


def enter_number(page, label: str, value) -> None:
    """Type `value` into the number input labelled `label` and commit it with Enter, as a user does."""
    box = page.get_by_label(label, exact=True)
    box.fill(str(value))
    box.press("Enter")


def pick(page, open_list, option: str, attempts: int = 6) -> None:
    """Open a list with `open_list()` and click `option` in it. A rerun that redraws the open list (a loaded machine's
    late one, after the last choice) closes it or clears what was typed, so the list is opened again until the click
    lands; waits for Streamlit to settle before each try and after."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(attempts):
        page.wait_for_function(SETTLED, timeout=60_000)
        open_list()
        try:
            page.get_by_role("option", name=option, exact=True).click(timeout=10_000)
            break
        except PlaywrightTimeout:
            if attempt == attempts - 1:
                raise
            page.keyboard.press("Escape")
    page.wait_for_function(SETTLED, timeout=60_000)


def choose(page, label: str, option: str) -> None:
    """Pick `option` in the select box labelled `label` (see `pick`)."""
    pick(page, lambda: page.get_by_label(label, exact=True).click(), option)


def settle_and_shoot(page, path: Path) -> None:
    """Wait until Streamlit has redrawn everything, check that no traceback is drawn, save a full-page screenshot."""
    page.wait_for_function(SETTLED, timeout=60_000)
    assert page.locator("[data-testid='stException']").count() == 0
    path.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(path), full_page=True)


def test_launch_two_modes_and_watch_the_loss_chart(server):
    from playwright.sync_api import expect, sync_playwright

    modes = default_modes("cpu")
    assert len(modes) == 2
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 2600})
            launch = open_train_page(page, server)
            enter_number(page, "Steps", STEPS)
            page.wait_for_function(SETTLED, timeout=60_000)
            for mode in modes:  # the default selection: 32-true and this machine's best mixed mode
                page.get_by_text(mode, exact=True).first.wait_for()
            launch.click()
            wait_for_loss_points(page, modes, 1, timeout_ms=120_000)  # both modes drawn
            page.get_by_text("Run status: finished").wait_for(timeout=120_000)
            page.wait_for_function(LOSS_POINTS_AT_LEAST, arg=[modes, STEPS], timeout=60_000)
            assert page.evaluate(LOSS_POINTS) == dict.fromkeys(modes, STEPS)  # the Steps typed took effect
            expect(page.get_by_role("button", name="Pause")).to_have_count(0)
            settle_and_shoot(page, SCREENSHOT)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
