"""The Train page's recipe builder in a real browser: a preset plus two built lanes launch a 4-recipe race, and the
memory chart breaks down what each recipe holds (screenshot at 1440x900: artifacts/recipes_memory.png, copied to
AMP_LAB_SHOTS when that names a folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.test_browser import (  # noqa: F401  (server: the real server fixture)
    CHROMIUM,
    CHROMIUM_ARGS,
    LOSS_POINTS_AT_LEAST,
    PLOTS,
    SETTLED,
    choose,
    enter_number,
    open_train_page,
    pick,
    server,
    wait_for_loss_points,
)

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "artifacts" / "recipes_memory.png"
STEPS = 4
RACE = ["bf16-mixed", "bf16-mixed+fp8-rowwise", "32-true+adamw-8bit", "bf16-true+sr"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.extra("recipes"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]

# Bars of the memory chart: trace name -> number of bars with a value.
MEMORY_BARS = f"""() => {{
    for (const div of ({PLOTS})()) {{
        const title = div.layout && div.layout.title && div.layout.title.text;
        if (!title || !title.includes('Memory') || !div._fullData) continue;
        return Object.fromEntries(div._fullData.map(t => [t.name, (t.y || []).filter(v => v > 0).length]));
    }}
    return {{}};
}}"""


def add_lane(page, mode: str, option: str) -> None:
    """The builder: choose a mode and one option, press Add lane."""
    choose(page, "Mode", mode)
    options = page.locator("[data-testid='stMultiSelect']").filter(has_text="Options").locator("input")
    pick(page, lambda: (options.click(), options.fill(option)), option)
    page.keyboard.press("Escape")
    page.get_by_role("button", name="Add lane").click()
    page.wait_for_function(SETTLED, timeout=60_000)


@pytest.mark.timeout(1200)  # torchao compiles its optimizer step in the server: a minute or more on a busy CPU
def test_the_recipe_builder_launches_a_race_and_the_memory_breakdown_names_each_recipe(server):  # noqa: F811
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            open_train_page(page, server)
            choose(page, "Workload", "Tiny transformer (predicts the next letter)")
            for label, value in (("Steps", STEPS), ("Batch size", 8)):
                enter_number(page, label, value)
                page.wait_for_function(SETTLED, timeout=60_000)
            page.get_by_text("Recipes: FP8 matmuls").click()
            page.get_by_role("button", name="Use preset").wait_for()
            choose(page, "Preset race", "FP8 rowwise vs bf16")
            page.get_by_role("button", name="Use preset").click()
            page.wait_for_function(SETTLED, timeout=60_000)
            add_lane(page, "32-true", "adamw-8bit")
            add_lane(page, "bf16-true", "sr")
            add_lane(page, "bf16-mixed", "sr")  # refused, with the reason, and nothing added
            page.get_by_text("use it with bf16-true").wait_for()
            for lane in RACE:
                page.get_by_text(lane, exact=True).first.wait_for()
            picker = page.locator("[data-testid='stMultiSelect']").filter(has_text="Precision modes or recipes")
            assert "bf16-mixed+sr" not in picker.inner_text() and "32-true+adamw-8bit" in picker.inner_text()
            assert page.get_by_text("Run status:").count() == 0  # a fresh store: no run shown yet
            page.get_by_role("button", name="Launch").click()
            page.get_by_text("Run status:").wait_for(timeout=120_000)  # launched: a lost click fails here, not later
            wait_for_loss_points(page, RACE, 1, timeout_ms=600_000)
            page.get_by_text("Run status: finished").wait_for(timeout=600_000)
            page.wait_for_function(LOSS_POINTS_AT_LEAST, arg=[RACE, STEPS], timeout=60_000)
            page.wait_for_function(SETTLED, timeout=60_000)
            assert page.locator("[data-testid='stException']").count() == 0
            # The cost probe races once the run has ended (a run shares the cores) and its end redraws the page: the
            # memory chart is read once it is drawn again with every lane.
            page.wait_for_function(f"() => Object.keys(({MEMORY_BARS})()).length >= {len(RACE)}", timeout=120_000)
            page.wait_for_function(SETTLED, timeout=60_000)
            bars = page.evaluate(MEMORY_BARS)
            assert set(bars) == set(RACE) and all(count >= 4 for count in bars.values()), bars
            chart = next(div for div in page.locator(".js-plotly-plot").all()
                         if "Memory" in (div.evaluate("d => d.layout.title.text") or ""))
            chart.scroll_into_view_if_needed()
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
    shots = os.environ.get("AMP_LAB_SHOTS")
    if shots and Path(shots).is_dir():
        shutil.copy(SCREENSHOT, Path(shots) / SCREENSHOT.name)
