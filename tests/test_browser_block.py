"""A block-scaled lane's numerics over sampled steps in a real browser at 1440x900 (a screenshot in artifacts/:
nvfp4_over_steps.png, copied to AMP_LAB_SHOTS when that names a folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from amp_core.config import RunConfig
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from tests import streamlit_server
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, DRAWN, NO_PROBE_AWAITED, SETTLED, choose, scroll_to
from tests.test_browser_fp8 import VIEWPORT, shoot

LANE = "bf16-mixed+nvfp4"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]


@pytest.fixture
def server(tmp_path):
    """The real server on a store that holds a race of bf16-mixed and an NVFP4 lane sampling its layers."""
    store = tmp_path / "runs.sqlite3"
    config = RunConfig(workload="tiny_transformer", modes=("bf16-mixed", LANE), steps=8, amax_every=2, batch_size=8,
                       gradstats_every=0)
    run = Run(config, open_store(store)).start()
    run.join(300)
    assert run.status == "finished"
    with streamlit_server.serving(store) as url:
        yield url


@pytest.mark.timeout(600)
def test_an_nvfp4_lanes_operand_snr_over_steps(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{server}/layer_numerics")
            page.get_by_label("Lane", exact=True).wait_for(timeout=120_000)
            page.wait_for_function(SETTLED, timeout=90_000)
            choose(page, "Lane", f"lane 1 · {LANE}")
            # The page's probes are made off its thread and drawn by a rerun when they are in (the block probe last,
            # then Find a plan below it): the elements read below are the ones that rerun drew.
            page.get_by_text("Find a plan: the cheapest format per layer").wait_for(timeout=120_000)
            page.wait_for_function(NO_PROBE_AWAITED, timeout=120_000)
            page.wait_for_function(SETTLED, timeout=90_000)
            heading = page.get_by_text("Block-scaled GEMM operands over steps")
            heading.wait_for(timeout=60_000)
            assert page.get_by_text("nvfp4: first layer below 10 dB").count() >= 1  # the one-step probe says one too
            assert page.locator("[data-testid='stException']").count() == 0
            scroll_to(page, heading)
            page.mouse.wheel(0, 250)
            page.wait_for_function(DRAWN, timeout=60_000)  # the charts draw a moment after Streamlit settles
            chart = page.locator(".js-plotly-plot").filter(has_text="Quantisation SNR over steps")
            assert chart.count() == 1 and chart.locator(".hm").count() >= 1  # the heatmap trace is drawn
            shoot(page, "nvfp4_over_steps")
        finally:
            browser.close()
