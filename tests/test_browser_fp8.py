"""An FP8 lane's layer numerics and the Train page's largest-batch search in a real browser at 1440x900 (screenshots
in artifacts/: fp8_layer_numerics.png, fp8_layer_numerics_grads.png and maxbatch.png, copied to AMP_LAB_SHOTS when
that names a folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from amp_core.config import RunConfig
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from tests import streamlit_server
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, DRAWN, NO_PROBE_AWAITED, SETTLED, choose, scroll_to

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
VIEWPORT = {"width": 1440, "height": 900}
FP8_LANE = "bf16-mixed+fp8-rowwise"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.extra("recipes"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]


@pytest.fixture
def server(tmp_path):
    """The real server on a store that holds a race of bf16-mixed and an FP8 lane sampling its layers."""
    store = tmp_path / "runs.sqlite3"
    config = RunConfig(workload="tiny_transformer", modes=("bf16-mixed", FP8_LANE), steps=4, amax_every=2,
                       batch_size=8, gradstats_every=0)
    run = Run(config, open_store(store)).start()
    run.join(300)
    assert run.status == "finished"
    with streamlit_server.serving(store) as url:
        yield url


def shoot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    shots = os.environ.get("AMP_LAB_SHOTS")
    if shots and Path(shots).is_dir():
        shutil.copy(path, Path(shots) / path.name)


@pytest.mark.timeout(600)
def test_an_fp8_lanes_layer_numerics_and_the_largest_batch_per_lane(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(f"{server}/layer_numerics")
            page.get_by_label("Lane", exact=True).wait_for(timeout=120_000)
            page.wait_for_function(SETTLED, timeout=90_000)
            choose(page, "Lane", f"lane 1 · {FP8_LANE}")
            caption = page.get_by_text("An FP8 lane (torchao rowwise)")
            caption.wait_for(timeout=60_000)
            page.wait_for_function(NO_PROBE_AWAITED, timeout=120_000)  # the probes, made off the page's thread, are in:
            page.wait_for_function(SETTLED, timeout=90_000)  # no rerun that draws them comes between the clicks below
            radio = page.get_by_role("radiogroup", name="Cast to")
            assert radio.get_by_label("fp8 e4m3fn scaled", exact=True).is_checked()
            assert radio.get_by_label("fp8 e5m2", exact=True).count() == 1
            assert page.locator("[data-testid='stException']").count() == 0
            scroll_to(page, page.get_by_text("What a cast does to each module's outputs"))
            page.wait_for_function(DRAWN, timeout=60_000)  # the charts draw a moment after Streamlit settles
            shoot(page, "fp8_layer_numerics")
            # The gradients: a plain cast to e4m3fn flushes the small ones to 0; torchao's scaled cast keeps them.
            page.get_by_role("radiogroup", name="Tensor").last.get_by_text("output gradients").click()
            page.get_by_text("What a cast does to each module's output gradients").wait_for(timeout=60_000)
            page.get_by_role("radiogroup", name="Cast to").get_by_text("fp8 e4m3fn", exact=True).click()
            page.wait_for_function(SETTLED, timeout=60_000)
            scroll_to(page, page.get_by_text("What a cast does to each module's output gradients"))
            page.wait_for_function(DRAWN, timeout=60_000)
            assert page.locator("[data-testid='stException']").count() == 0
            shoot(page, "fp8_layer_numerics_grads")
            page.close()

            page = browser.new_page(viewport=VIEWPORT)
            page.goto(server)
            page.get_by_role("button", name="Launch").wait_for(timeout=90_000)
            choose(page, "Workload", "Tiny transformer (predicts the next letter)")
            page.get_by_text("Recipes: FP8 matmuls").click()
            choose(page, "Preset race", "FP8 rowwise vs bf16")
            page.get_by_role("button", name="Use preset").click()
            page.wait_for_function(SETTLED, timeout=60_000)
            budget = page.get_by_label("Memory budget (MiB, 0 = what is free now)", exact=True)
            budget.fill("256")
            budget.press("Enter")
            page.wait_for_function(SETTLED, timeout=60_000)
            page.get_by_role("button", name="Find the largest batch").click()
            page.get_by_text("Modelled").first.wait_for(timeout=300_000)
            page.wait_for_function(SETTLED, timeout=60_000)
            assert page.locator("[data-testid='stException']").count() == 0
            table = page.locator("[data-testid='stDataFrame']").filter(has_text="max batch")
            table.scroll_into_view_if_needed()
            table.locator(".dvn-scroller").wait_for(timeout=60_000)  # the grid draws a moment after Streamlit settles
            shoot(page, "maxbatch")
        finally:
            browser.close()
