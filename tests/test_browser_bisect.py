"""The bisect buttons in a real browser: on the Overflow debugger, "Find the layers to keep" bisects a stored run's
failing 16-mixed lane off the page's thread and shows the price line, the trials and the fix with a copy button; the
fixed lane races from the page; Layer numerics shows the recorded report under its own button (screenshot at
1440x900: artifacts/h30_bisect.png, copied to AMP_LAB_SHOTS when that names a folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from bisect_workloads import PlantedStack

from amp_core.config import RunConfig, ScalerConfig
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from amp_core.workloads import WORKLOADS
from tests import streamlit_server
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, SETTLED

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "artifacts" / "h30_bisect.png"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]


@pytest.fixture
def planted_server(tmp_path, monkeypatch):
    store = tmp_path / "runs.sqlite3"
    monkeypatch.setitem(WORKLOADS, "planted_stack", PlantedStack())
    config = RunConfig(workload="planted_stack", size="small", modes=("32-true", "16-mixed"), steps=6, lr=3e-3,
                       scaler=ScalerConfig(init_scale=256.0))
    Run(config, open_store(store)).start().join()
    # The server loads the plugin by name, as a user's would: the tests folder on its path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    monkeypatch.setenv("AMP_LAB_WORKLOADS", "bisect_workloads")
    with streamlit_server.serving(store) as url:
        yield url


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(url)
    page.get_by_role("heading").first.wait_for(timeout=240_000)  # a loaded 2-core machine serves slowly
    page.wait_for_function(SETTLED, timeout=240_000)
    return page


@pytest.mark.timeout(600)
def test_the_bisect_buttons_find_the_planted_layer_price_it_and_race_the_fix(planted_server):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = open_page(browser, f"{planted_server}/overflow_debugger")
            button = page.get_by_role("button", name="Find the layers to keep")
            button.wait_for(timeout=180_000)  # below the debugger's charts: a busy machine draws them slowly
            button.evaluate("element => element.scrollIntoView({block: 'center'})")
            button.click(timeout=90_000)
            price = page.get_by_text("keeping 1 of 33 modules in fp32 fixes it and", exact=False)
            expect(price).to_be_visible(timeout=300_000)
            expect(page.get_by_text("KEEP = ['blocks.3.middle']", exact=False)).to_be_visible()
            expect(page.locator("[data-testid='stDataFrame']").filter(has_text="")).not_to_have_count(0)
            page.mouse.move(5, 5)  # no tooltip over the report
            page.get_by_role("heading", name="Bisect of lane 1 (16-mixed)").evaluate(
                "element => element.scrollIntoView({block: 'start'})")
            page.wait_for_function(SETTLED, timeout=60_000)
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
            if os.environ.get("AMP_LAB_SHOTS"):
                shutil.copy(SCREENSHOT, Path(os.environ["AMP_LAB_SHOTS"]) / SCREENSHOT.name)
            assert "Traceback" not in page.content()
            page.get_by_role("button", name="Race the fixed lane").click(timeout=90_000)
            expect(page.get_by_text("16-mixed+keep:blocks.3.middle", exact=False).filter(
                has_text="Launched")).to_be_visible(timeout=120_000)

            numerics = open_page(browser, f"{planted_server}/layer_numerics")
            expect(numerics.get_by_role("button", name="Find the layers to keep")).to_be_visible(timeout=60_000)
        finally:
            browser.close()
