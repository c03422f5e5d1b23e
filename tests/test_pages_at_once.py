"""Pages whose first draw once waited on a probe or on torch's compiler stack are usable at once: their controls are
drawn while the server's answer board (pages.answered) is busy, with a one-line note, and what they asked for joins
the page once it is made (Layer numerics' own test, in test_page_layer_numerics, also compares its report).

The board is held busy by a probe the test asks of it (released by an event), so "before the answer" is certain on
any machine; real pages under AppTest, real traces and real recipe checks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.precision import BASELINE_MODE, recipe_candidates
from pages.answered import answer_board
from tests.answered_pages import answered, awaiting_notes

ROOT = Path(__file__).resolve().parents[1]


def advise_before(app: AppTest) -> None:
    assert app.selectbox(key="advise_workload").value == "tiny_transformer"
    picker = app.multiselect(key="advise_candidates")
    assert picker.disabled and picker.options == [] and picker.value == []
    assert next(button.label for button in app.button) == "Advise"  # usable at once (below it: Find a plan)
    assert any("press Advise" in info.value for info in app.info)


def advise_after(app: AppTest) -> None:
    picker = app.multiselect(key="advise_candidates")
    runnable = [recipe for recipe, ok, _ in recipe_candidates("cpu") if ok and recipe != BASELINE_MODE]
    assert not picker.disabled and picker.options == runnable and "bf16-mixed" in runnable


def inspector_before(app: AppTest) -> None:
    assert app.selectbox(key="opi_workload").value == "digits_mlp" and app.selectbox(key="opi_mode").value
    assert not [df for df in app.dataframe if "inputs" in df.value.columns]  # no op table yet
    assert [df for df in app.dataframe if "expression" in df.value.columns]  # the seed demo below is drawn


def inspector_after(app: AppTest) -> None:
    [table] = [df.value for df in app.dataframe if "inputs" in df.value.columns]
    assert (table["module"] == "fc1").any()


PAGES = {
    "advise": ("Checking which recipes this device runs", advise_before, advise_after),
    "op_inspector": ("Tracing one forward + backward in bf16-mixed, size small, batch 16", inspector_before,
                     inspector_after),
}


@pytest.mark.parametrize("page", list(PAGES))
def test_the_page_draws_its_controls_before_its_answer_and_the_answer_joins_it(page):
    doing, before, after = PAGES[page]
    answer_board.clear()  # a fresh board: no earlier test's answer is remembered
    release = threading.Event()
    ahead = answer_board().ask("the test's probe", release.wait)
    try:
        app = AppTest.from_file(str(ROOT / "pages" / f"{page}.py"), default_timeout=120).run()
        assert not app.exception and not app.error
        [note] = awaiting_notes(app)
        assert doing in note and "1 other probe first" in note
        before(app)
    finally:
        release.set()
    assert ahead.done.wait(60)
    answered(app)
    assert not app.exception and not app.error
    after(app)
    again = AppTest.from_file(str(ROOT / "pages" / f"{page}.py"), default_timeout=120).run()  # a new session
    assert not awaiting_notes(again)
    after(again)
