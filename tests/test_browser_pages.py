"""Train, Compare, Op inspector, Layer numerics, Overflow debugger and Formats in a real browser at 1440 x 900: what
a newcomer saw clipped, overlapping or mislabelled, checked where Chromium drew it, plus a full-page screenshot of
each in artifacts/.

Runs are made beforehand in the server's store (CLI-like, by their own threads); the server then serves them.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from amp_core.config import FaultSpec, RunConfig, ScalerConfig
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from tests import streamlit_server
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, DRAWN, PAINTED, PLOTS, SETTLED

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
VIEWPORT = {"width": 1440, "height": 900}

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]

# Every tick label plotly drew on a log axis, with the value it stands for (10^x). Plotly's default writes the
# in-between ticks as a bare leading digit ("2", "5"), which reads as a number of its own.
LOG_TICKS = f"""() => {{
    const out = [];
    for (const div of ({PLOTS})()) {{
        const layout = div._fullLayout;
        if (!layout) continue;
        for (const name of Object.keys(layout).filter(k => /^[xy]axis\\d*$/.test(k))) {{
            const axis = layout[name];
            if (axis.type !== 'log' || !axis._vals) continue;
            for (const tick of axis._vals) out.push([tick.x, tick.text]);
        }}
    }}
    return out;
}}"""
# Screen boxes of the SVG texts whose content starts with one of the prefixes, with their plot's box.
TEXT_BOXES = f"""(prefixes) => {{
    const out = [];
    for (const div of ({PLOTS})()) {{  // a box in a chart's frame is measured in the frame, as is its plot's
        const plot = div.getBoundingClientRect();
        for (const text of div.querySelectorAll('text')) {{
            const content = text.textContent;
            if (!prefixes.some(p => content.startsWith(p))) continue;
            const box = text.getBoundingClientRect();
            out.push({{text: content, left: box.left, right: box.right, top: box.top, bottom: box.bottom,
                      plotLeft: plot.left, plotRight: plot.right,
                      areaTop: plot.top + div._fullLayout.yaxis._offset}});  // the top of y's plot area
        }}
    }}
    return out;
}}"""
# Charts whose legend box overlaps their x axis's title (the title's text).
LEGEND_ON_TITLE = f"""() => ({PLOTS})().flatMap(div => {{
    const legend = div.querySelector('g.legend'), title = div.querySelector('text.xtitle');
    if (!legend || !title || !title.textContent) return [];
    const l = legend.getBoundingClientRect(), t = title.getBoundingClientRect();
    const apart = l.top >= t.bottom || l.bottom <= t.top || l.left >= t.right || l.right <= t.left;
    return apart ? [] : [(div.layout.title && div.layout.title.text) || '(untitled chart)'];
}})"""
# Glide's scroller inside each st.dataframe: wider content than box means a column is off screen.
TABLE_OVERFLOW = """() => Array.from(document.querySelectorAll('[data-testid="stDataFrame"] .dvn-scroller'))
    .map(s => [s.scrollWidth, s.clientWidth])"""
CUT_SHORT = """() => Array.from(document.querySelectorAll('[data-testid="stMain"] *'))
    .filter(e => e.textContent.trim() && getComputedStyle(e).textOverflow === 'ellipsis'
            && e.scrollWidth > e.clientWidth + 1)
    .map(e => e.textContent.trim())"""
"""Text the page draws cut short with an ellipsis (a label wider than its column)."""
SI = {"k": 1e3, "M": 1e6, "G": 1e9, "B": 1e9, "m": 1e-3, "μ": 1e-6, "n": 1e-9}


def tick_value(text: str) -> float:
    text = text.replace("−", "-").replace(",", "")
    return float(text[:-1]) * SI[text[-1]] if text[-1] in SI else float(text)


def spike_race(store: Path, modes: tuple[str, ...]) -> None:
    """The debugger's race, finished in `store`: digits_mlp with a loss spike at steps 20-21 that overflows fp16."""
    config = RunConfig(workload="digits_mlp", modes=modes, steps=60, gradstats_every=10,
                       scaler=ScalerConfig(growth_interval=10),
                       faults=(FaultSpec(kind="loss_scale", step=20, duration=2, factor=1e6),))
    Run(config, open_store(store)).start().join(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for this module's tests, on a store made beforehand: two runs for Compare (their 32-true lanes train
    identically), then the debugger's spike race of three lanes, newest."""
    store = tmp_path_factory.mktemp("pages") / "runs.sqlite3"
    for modes in (("32-true", "bf16-mixed"), ("32-true",)):
        config = RunConfig(workload="mlp_regression", modes=modes, steps=40, batch_size=16)
        Run(config, open_store(store)).start().join()
    spike_race(store, ("16-mixed", "bf16-mixed", "32-true"))
    with streamlit_server.serving(store) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    """One Chromium for this module's tests (each opens its pages in tabs of its own)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_page(browser, url: str):
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(url)
    page.get_by_role("heading").first.wait_for(timeout=90_000)
    page.wait_for_function(DRAWN, timeout=90_000)  # plotly draws after Streamlit settles
    assert page.locator("[data-testid='stException']").count() == 0
    return page


def screenshot(page, name: str) -> None:
    """The whole page: Streamlit scrolls inside its main block, so the window grows to its height first."""
    height = page.evaluate("() => document.querySelector('[data-testid=stMain]').scrollHeight")
    page.set_viewport_size({"width": VIEWPORT["width"], "height": max(VIEWPORT["height"], height)})
    page.wait_for_function(DRAWN, timeout=60_000)
    page.evaluate(PAINTED)  # the charts' own redraw for the new size
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    page.set_viewport_size(VIEWPORT)


def text_boxes(page, prefixes: list[str], count: int) -> list[dict]:
    """TEXT_BOXES once plotly has drawn `count` of them (it draws a moment after Streamlit settles)."""
    page.wait_for_function(f"(prefixes) => ({TEXT_BOXES})(prefixes).length >= {count}", arg=prefixes,
                           timeout=30_000)
    return page.evaluate(TEXT_BOXES, prefixes)


def eventually(check, page, timeout_s: float = 60.0) -> None:
    """`check(page)` until it passes: plotly and the data grid draw a moment after Streamlit settles, and redraw
    when a late rerun lands; on a busy machine that moment can be long. The last failure is raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check(page)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            page.wait_for_timeout(500)


def assert_log_ticks_carry_their_power(page) -> None:
    ticks = page.evaluate(LOG_TICKS)
    assert ticks
    for exponent, text in ticks:
        assert tick_value(text) == pytest.approx(10**exponent, rel=1e-6), (text, exponent)


def assert_legends_clear_of_axis_titles(page) -> None:
    """No legend is drawn over its chart's x axis title (a legend of several rows under the chart grew up into it)."""
    page.wait_for_function(DRAWN, timeout=60_000)
    assert page.evaluate(LEGEND_ON_TITLE) == []


def assert_tables_fit(page) -> None:
    tables = page.evaluate(TABLE_OVERFLOW)
    assert tables, "no table found"
    for scroll_width, client_width in tables:
        assert scroll_width <= client_width + 1, "a table column is off screen"


def test_the_overflow_debugger_of_three_lanes_opened_by_its_url_fits(server, browser):
    """The page's URL is the server's first visit (a bookmark, a reload after a restart; this module's first test):
    it is still drawn inside the app (sidebar, wide layout), and no table of the three lanes runs past its column,
    before and after a replay (recorded in the run: the next test's debugger shows it too)."""
    page = open_page(browser, f"{server}/overflow_debugger")
    page.locator("[data-testid='stSidebar']").get_by_text("Overflow debugger").wait_for(timeout=60_000)
    assert "AMP Lab" in page.title(), page.title()  # the app's page config, not the file's name alone
    page.get_by_text("Gradient magnitudes against fp16 and bf16").wait_for(timeout=60_000)
    # The lanes' overview, found by its header: each data grid adds its (hidden, accessible) table when it has drawn,
    # not in page order, so the page's first table may be a later grid's (the review's or the fractions', 5 rows).
    overview = page.locator("[data-testid='stDataFrame'] table", has=page.locator("th", has_text="scale now"))
    assert overview.get_attribute("aria-rowcount") == "4"  # the header and the three lanes
    eventually(assert_tables_fit, page)
    page.get_by_role("button", name="Replay", exact=True).click()
    page.get_by_text("Replay of step 20").wait_for(timeout=120_000)
    page.wait_for_function(SETTLED, timeout=60_000)
    eventually(assert_tables_fit, page)
    screenshot(page, "overflow_debugger_3_lanes")
    assert page.locator("[data-testid='stException']").count() == 0
    page.close()


def test_my_pages_read_whole_at_1440(server, browser):
    page = open_page(browser, server)  # Train: the newest run's lanes table and charts
    page.get_by_text("Run status: finished").wait_for(timeout=90_000)
    page.get_by_text("What each mode costs here").wait_for()
    for title in ("GradScaler settings", "More: Adam eps"):  # the form's folded settings too
        page.get_by_text(title).first.click()
    page.get_by_label("Adam/AdamW eps", exact=True).wait_for()
    for field in page.locator("[data-testid='stNumberInputField']").all():  # every setting shows whole
        assert field.evaluate("e => e.scrollWidth <= e.clientWidth"), field.input_value()
    assert page.evaluate(CUT_SHORT) == []  # and every label (a toggle's is cut with an ellipsis)
    eventually(assert_tables_fit, page)
    eventually(assert_legends_clear_of_axis_titles, page)
    screenshot(page, "train")
    page.close()

    page = open_page(browser, f"{server}/compare")
    runs = page.locator("[data-testid='stMultiSelect']").first
    for _ in range(2):  # add the two older runs to the newest one
        runs.locator("input").click()
        page.locator("[role='option']").first.click(timeout=10_000)
        page.keyboard.press("Escape")
        page.wait_for_function(SETTLED, timeout=90_000)
    runs.locator("[data-tag-index='2']").wait_for(timeout=60_000)  # three runs picked
    page.get_by_text("Loss minus the baseline's").first.wait_for(timeout=60_000)
    page.wait_for_function(DRAWN, timeout=60_000)
    page.get_by_text("recorded the same loss, bit for bit").first.wait_for()
    eventually(assert_log_ticks_carry_their_power, page)
    eventually(assert_tables_fit, page)
    screenshot(page, "compare")
    page.close()

    page = open_page(browser, f"{server}/op_inspector")
    page.get_by_text("Every op", exact=True).wait_for(timeout=90_000)  # the trace, made off the page's thread
    page.wait_for_function(DRAWN, timeout=60_000)
    eventually(assert_tables_fit, page)
    screenshot(page, "op_inspector")
    page.close()

    page = open_page(browser, f"{server}/overflow_debugger")
    step = page.locator("[data-testid='stSelectbox']", has_text="Step").locator("input")
    assert step.input_value() == "step 20 · skipped"  # opens on the first skipped step
    page.get_by_role("button", name="Launch demo run").wait_for()  # the fault panel is open
    eventually(assert_log_ticks_carry_their_power, page)
    labels = text_boxes(page, ["fp16 smallest", "fp16 max"], 3)
    assert len(labels) == 3
    for label in labels:  # horizontal, above the bars, inside the chart
        assert label["bottom"] <= label["areaTop"] + 1 and label["right"] - label["left"] > 40, label
        assert label["plotLeft"] <= label["left"] and label["right"] <= label["plotRight"], label
    for a, b in itertools.pairwise(labels):
        assert a["right"] <= b["left"] or b["right"] <= a["left"], (a, b)
    eventually(assert_tables_fit, page)
    screenshot(page, "overflow_debugger")
    page.close()

    page = open_page(browser, f"{server}/layer_numerics")
    page.locator(".js-plotly-plot").first.wait_for(timeout=90_000)
    page.get_by_text("Find a plan: the cheapest format per layer").wait_for(timeout=90_000)  # after the block probe
    page.wait_for_function(DRAWN, timeout=60_000)
    screenshot(page, "layer_numerics")
    eventually(assert_tables_fit, page)
    page.close()

    page = open_page(browser, f"{server}/formats")
    maxima = text_boxes(page, ["max "], 6)
    assert len(maxima) == 6
    for label in maxima:  # the whole label, exponent included, inside the chart
        assert label["right"] <= label["plotRight"], label
    texts = [label["text"].replace("\u200b", "") for label in maxima]  # plotly wraps <sup> in zero-widths
    assert "max 3.403×1038" in texts and "max 65504" in texts, texts
    eventually(assert_tables_fit, page)
    screenshot(page, "formats")
    page.close()

