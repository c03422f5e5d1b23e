"""The Overflow debugger's Replay section under AppTest and in Chromium: a stored run with a planted outlier batch,
its skipped step and spike listed, the Replay button's table and verdict (and a 1440 x 900 screenshot of them)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.config import FaultSpec, RunConfig
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from tests import streamlit_server
from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, SETTLED

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "overflow_debugger.py")
SHOTS = Path(os.environ.get("AMP_LAB_SHOTS", ROOT / "artifacts"))
"""Where the browser test leaves its screenshot (artifacts/ unless AMP_LAB_SHOTS names a folder)."""


def outlier_run(store: Path) -> str:
    config = RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed", "bf16-mixed"), steps=45,
                       faults=(FaultSpec.parse("batch_outlier:30@40"),))
    run = Run(config, open_store(store)).start()
    run.join(120)
    assert run.status == "finished"
    return run.run_id


def test_the_replay_button_shows_the_table_and_the_verdict(fresh_store):
    run_id = outlier_run(fresh_store)
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception, at.exception
    assert at.selectbox(key="dbg_run").value == run_id
    lane = at.selectbox(key=f"dbg_lane_{run_id}").value
    assert lane == 1  # the 16-mixed lane, the one that skipped
    review = next(df.value for df in at.dataframe if "what" in df.value.columns)
    assert {("skipped", 40), ("spike", 40)} <= set(zip(review["what"], review["step"], strict=True))
    step = at.number_input(key=f"dbg_replay_step_{run_id}_{lane}")
    assert step.value == 40  # opens on the first step worth replaying
    at.button(key="dbg_replay").click().run()
    assert not at.exception, at.exception
    assert any(md.value.endswith("verdict: data") for md in at.markdown), [md.value for md in at.markdown]
    table = next(df.value for df in at.dataframe if "first inf/NaN" in df.value.columns)
    assert list(table["mode"]) == ["32-true ref", "▶ 16-mixed", "bf16-mixed", "float64 ref"]
    assert any("equals the recorded one bit for bit" in caption.value for caption in at.caption)
    step.set_value(44).run()
    at.button(key="dbg_replay").click().run()
    assert any(md.value.endswith("verdict: unclear") for md in at.markdown)


@contextlib.contextmanager
def served_page(store: Path, path: str):
    """A 1440 x 900 Chromium page on `path` of an app server of its own over `store`; both stop after."""
    from playwright.sync_api import sync_playwright

    with streamlit_server.serving(store) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            said = []  # what the browser's console said: a page that never connects says why there
            page.on("console", lambda message: said.append(f"{message.type}: {message.text}"))
            page.goto(f"{url}/{path}")
            try:
                yield page
            except BaseException:
                SHOTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SHOTS / f"failed_{path}.png"))
                print(f"--- the page as it stood ---\n{page.inner_text('body')[:3000]}\n--- its console ---\n"
                      + "\n".join(said[-50:]))
                raise
        finally:
            browser.close()


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install chromium)")
def test_the_replay_button_works_in_chromium(tmp_path):
    store = tmp_path / "runs.sqlite3"
    outlier_run(store)
    with served_page(store, "overflow_debugger") as page:
        button = page.get_by_role("button", name="Replay", exact=True)
        button.wait_for(timeout=90_000)
        page.wait_for_function(SETTLED, timeout=90_000)
        assert page.get_by_role("spinbutton", name="Step to replay").input_value() == "40"
        button.click()
        verdict = page.get_by_role("heading", name="verdict: data")
        verdict.wait_for(timeout=120_000)
        page.wait_for_function(SETTLED, timeout=60_000)
        assert page.locator("[data-testid='stException']").count() == 0
        page.get_by_text("fp32 breaks too on this batch", exact=False).first.wait_for()
        verdict.evaluate("heading => heading.scrollIntoView({block: 'start'})")
        table = page.locator("[data-testid='stDataFrame']", has_text="update vs fp32")
        fit = table.locator(".dvn-scroller").evaluate("s => [s.scrollWidth, s.clientWidth]")
        assert fit[0] <= fit[1] + 1, fit  # every column of the replay's table shows
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "replay_verdict.png"))

