"""The README's screenshots, made anew from the app as it is: the Train page racing three modes live, and the
Overflow debugger of a loss spike that overflows fp16 (1440 x 900, Debian's Chromium through Playwright).

    python3 scripts/screenshots.py [--out docs/img]

The spike race is made in a temporary store first; a fresh server serves it, and the three-mode race is launched
from the Train page as a user does (still training when the page is shot, stopped after).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: this checkout's amp_core, tests and bench

from amp_core.config import FaultSpec, RunConfig, ScalerConfig  # noqa: E402
from amp_core.precision import default_modes  # noqa: E402
from amp_core.race.runner import Run  # noqa: E402
from amp_core.records.opening import open_store  # noqa: E402
from bench.viewers import CHROMIUM, CHROMIUM_ARGS, VIEWPORT  # noqa: E402
from tests import streamlit_server  # noqa: E402
from tests.test_browser import (  # noqa: E402
    DRAWN,
    LIVE_FRAMES,
    LOSS_POINTS_AT_LEAST,
    PAINTED,
    enter_number,
    pick,
)

RACE_MODES = ("32-true", "bf16-mixed", "16-mixed")
RACE_STEPS = 3000  # long enough to be still training while the page is shot


def spike_race(store: Path) -> None:
    """digits_mlp in 16-mixed, bf16-mixed and 32-true with the loss x 1e6 at steps 20-21: fp16 overflows there."""
    config = RunConfig(workload="digits_mlp", modes=("16-mixed", "bf16-mixed", "32-true"), steps=80,
                       gradstats_every=10, scaler=ScalerConfig(growth_interval=10),
                       faults=(FaultSpec(kind="loss_scale", step=20, duration=2, factor=1e6),))
    Run(config, open_store(store)).start().join(300)


def shoot(page, path: Path, live_charts: int = 0) -> None:
    """A screenshot once every chart has drawn (`live_charts`: how many live charts' frames the page must hold); the
    mouse rests in the main block's empty right margin, so no chart shows its hover toolbar over its legend and the
    sidebar hides its collapse button."""
    page.mouse.move(VIEWPORT["width"] - 4, VIEWPORT["height"] // 2)
    page.wait_for_function(DRAWN, timeout=120_000)
    frames = page.evaluate(f"() => ({LIVE_FRAMES})().length")
    if frames != live_charts:
        raise SystemExit(f"{path.name}: {frames} live charts' frames, not {live_charts}")
    page.evaluate(PAINTED)  # the live charts' frames scrolled into view have painted
    if page.locator("[data-testid='stException']").count():
        raise SystemExit(f"{path.name}: the page shows a traceback")
    page.screenshot(path=str(path))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for the PNG files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "runs.sqlite3"
        spike_race(store)
        with streamlit_server.serving(store) as url, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport=VIEWPORT)
                page.goto(f"{url}/overflow_debugger")
                page.get_by_text("Gradient magnitudes against fp16 and bf16").wait_for(timeout=120_000)
                # The fault-injection form folded away: the run's overview and scale timeline fill the window.
                page.get_by_text("Fault injection: launch a demo run").click()
                page.get_by_role("button", name="Launch demo run").wait_for(state="hidden")
                page.locator(".js-plotly-plot").first.evaluate("e => e.scrollIntoView({block: 'center'})")
                shoot(page, args.out / "overflow_debugger.png")
                page.goto(url)
                launch = page.get_by_role("button", name="Launch")
                launch.wait_for(timeout=120_000)
                enter_number(page, "Steps", RACE_STEPS)
                modes = page.get_by_label("Precision modes or recipes (one lane each)", exact=True)
                for mode in RACE_MODES:
                    if mode not in default_modes("cpu"):  # the form starts with 32-true and the best mixed mode
                        pick(page, modes.click, mode)
                page.keyboard.press("Escape")  # the list folded away
                try:
                    launch.click()
                    page.wait_for_function(LOSS_POINTS_AT_LEAST, arg=[list(RACE_MODES), 150], timeout=240_000)
                except Exception:
                    page.screenshot(path=str(args.out / "train_failed.png"))
                    raise
                # The live part at the top of the window: the run's status, its lanes and the charts below them.
                # (its scroll margin keeps the line below the app's header, which covers the top of the window)
                page.get_by_text("Run status:").first.evaluate(
                    "e => { e.style.scrollMarginTop = '70px'; e.scrollIntoView({block: 'start'}); }")
                shoot(page, args.out / "train.png", live_charts=4)  # loss, step time, scale, memory
                page.get_by_role("button", name="Stop").click()
            finally:
                browser.close()


if __name__ == "__main__":
    main()
