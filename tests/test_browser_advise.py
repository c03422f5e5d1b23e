"""The Advise page in a real browser: choose a workload and a short budget, press Advise, see its progress (and its
Stop button) while it measures off the page's thread, then the recommendation, the table and the evidence runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from amp_core.records.opening import open_store
from tests import streamlit_server
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, SETTLED, pick
from tests.test_browser_pages import VIEWPORT, screenshot

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]


def test_the_advise_page_shows_progress_then_the_recommendation_and_its_evidence(tmp_path):
    store = tmp_path / "runs.sqlite3"
    with streamlit_server.serving(store) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(f"{url}/advise")
        page.get_by_role("heading", name="Advise").wait_for(timeout=90_000)
        page.wait_for_function(SETTLED, timeout=90_000)
        pick(page, lambda: page.get_by_test_id("stSelectbox").filter(has_text="Workload").click(),
             "Handwritten digits (a small classifier network)")
        budget = page.get_by_label("Budget (minutes)", exact=True).and_(page.get_by_test_id("stNumberInputField"))
        budget.fill("0.35")
        budget.press("Enter")
        page.wait_for_function(SETTLED, timeout=30_000)
        page.get_by_role("button", name="Advise").click()

        # While it measures: a progress bar saying what it does, and a Stop button.
        expect(page.get_by_test_id("stProgress")).to_be_visible(timeout=60_000)
        stop = page.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop")  # not the header's
        expect(stop).to_be_visible()
        expect(page.get_by_text("cost probe of the modes").first).to_be_visible()

        recommendation = page.get_by_test_id("stAlert").filter(has_text="recommend: ")
        expect(recommendation).to_be_visible(timeout=180_000)
        page.wait_for_function(SETTLED, timeout=30_000)
        assert page.get_by_test_id("stException").count() == 0
        assert recommendation.inner_text().startswith("recommend: ")
        table = page.get_by_test_id("stTable").first
        expect(table).to_be_visible()
        reason = table.get_by_text("the yardstick", exact=False)  # 32-true's reason, whole: the cells wrap
        expect(reason).to_be_visible()
        box, cell = table.bounding_box(), reason.bounding_box()
        assert cell["x"] + cell["width"] <= box["x"] + box["width"] + 1  # nothing runs past the table's edge
        expect(page.get_by_text("What could not be told here")).to_be_visible()
        evidence = page.get_by_text("race run ", exact=False).first
        expect(evidence).to_be_visible()
        race_run = evidence.inner_text().split("race run ", 1)[1].split(" ", 1)[0]
        assert race_run in set(open_store(store).runs()["run_id"])  # the evidence is an ordinary run in the store
        expect(stop).to_have_count(0)
        screenshot(page, "advise")
        browser.close()
