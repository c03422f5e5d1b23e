"""The Workshop page under AppTest: a card per scenario, one click launches it, the live charts and the checks appear
and turn final when the runs end; the presenter view; a launch the manager refuses is a message."""

from __future__ import annotations

from pathlib import Path

import pytest
from child_env import quieted_here, run_on_device_policy
from figure_json import spec
from streamlit.testing.v1 import AppTest

from amp_core.views.workshop import check_markdown
from amp_core.workshop import SCENARIOS, CheckResult, Verdict, headline

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "workshop.py")
MARKS = (":green[✓]", ":red[✗]", ":orange[?]", ":gray[…]")
"""How a check's Markdown starts: held, failed, cannot tell, waiting."""


@pytest.fixture
def app() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    return at


def markdown_texts(at: AppTest) -> list[str]:
    return [m.value for m in at.markdown]


def test_a_card_per_scenario_and_nothing_launched_yet(app):
    assert [b.key for b in app.button] == [f"workshop_launch_{name}" for name in SCENARIOS]
    texts = markdown_texts(app)
    for scenario in SCENARIOS.values():
        assert f"**{scenario.title}**" in texts
        assert scenario.watch in [c.value for c in app.caption]
    assert any("Pick a scenario" in info.value for info in app.info)
    assert not app.get("plotly_chart")


def test_launch_draws_the_run_and_its_checks_turn_final(app):
    app.button(key="workshop_launch_spike-recovery").click().run()
    assert not app.exception and not app.error
    launch = app.session_state["workshop_launch"]
    scenario = SCENARIOS["spike-recovery"]
    assert [h.value for h in app.header] == [scenario.title]
    assert scenario.caveat in [info.value for info in app.info]  # next to the chart, from the first draw
    assert launch.wait(120)
    app.run()  # the fragment's timer does not fire under AppTest: a rerun draws what the run recorded
    assert not app.exception
    assert [s.value for s in app.subheader] == ["3 of 3 checks held"]
    checks = [text for text in markdown_texts(app) if text.startswith(MARKS)]
    assert [text.split(" **")[1].split("**")[0] for text in checks] == [c.title for c in scenario.checks]
    assert all(text.startswith(":green[✓]") for text in checks)
    assert "back at 2^20" in checks[2]
    charts = {chart.key: spec(chart.proto.spec) for chart in app.get("plotly_chart")}
    run_id = launch.run_ids[0]
    assert set(charts) == {f"workshop_chart_{run_id}_loss", f"workshop_chart_{run_id}_scale"}
    scale = charts[f"workshop_chart_{run_id}_scale"]
    assert any(trace["name"] == "16-mixed skipped" for trace in scale["data"])
    # The run is an ordinary run: in the manager (and its store), listed on every page's picker.
    from pages.common import get_manager

    assert run_id in get_manager().list_runs()["run_id"].tolist()


def test_a_scenario_table_is_drawn_as_text(app):
    app.button(key="workshop_launch_lost-updates").click().run()
    launch = app.session_state["workshop_launch"]
    assert launch.wait(120)
    app.run()
    assert [s.value for s in app.subheader] == ["3 of 3 checks held"]
    (table,) = [frame.value for frame in app.dataframe if "parameter" in frame.value.columns]
    assert list(table.columns) == ["parameter", "32-true", "bf16-true", "16-true"]
    assert table["bf16-true"].str.endswith("%").all()


def test_presenter_view_large_one_column_fewer_controls(app):
    app.toggle(key="workshop_presenter").set_value(True).run()
    assert not app.exception
    assert app.session_state["presenter"] is True  # other pages may honour it
    assert [b.key for b in app.button] == ["workshop_launch_presenter"]  # one picker and one button, no cards
    app.selectbox(key="workshop_pick").set_value("bf16-no-skip")
    app.button(key="workshop_launch_presenter").click().run()
    launch = app.session_state["workshop_launch"]
    assert launch.scenario.name == "bf16-no-skip"
    assert launch.wait(120)
    app.run()
    assert [s.value for s in app.subheader] == ["3 of 3 checks held"]
    assert len(app.columns) == 2  # the picker and its button; charts and checks in one column
    for chart in app.get("plotly_chart"):
        layout = spec(chart.proto.spec)["layout"]
        assert layout["height"] == 540 and layout["font"]["size"] == 20
    assert any("<style>" in html.proto.body for html in app.get("html"))
    app.toggle(key="workshop_presenter").set_value(False).run()
    assert app.session_state["presenter"] is False
    assert not app.get("html")
    assert len(app.button) == len(SCENARIOS)


def test_a_launch_the_manager_refuses_is_a_message(app):
    from pages.common import get_manager

    get_manager().max_running = 0  # as if two runs were going already
    app.button(key="workshop_launch_speed").click().run()
    assert not app.exception
    assert any("already going" in error.value and "Nothing was launched" in error.value for error in app.error)
    assert "workshop_launch" not in app.session_state


def test_checks_are_drawn_as_they_stand_while_the_run_goes_then_final(app, stepped_launches, monkeypatch):
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({50}))  # the run parks itself after step 49
    app.button(key="workshop_launch_spike-recovery").click().run()
    launch = app.session_state["workshop_launch"]
    run = get_run(launch.run_ids[0])
    run.wait_until(lambda r: r.parked())
    app.run()
    assert not app.exception
    assert [s.value for s in app.subheader] == ["so far 2 of 3 checks hold"]  # the spike (steps 40-43) is behind it
    checks = [text for text in markdown_texts(app) if text.startswith(MARKS)]
    assert len(checks) == 3 and checks[2].startswith(":gray[…]") and "waiting for the scale to climb back" in checks[2]
    run.resume()
    assert launch.wait(120)
    app.run()
    assert [s.value for s in app.subheader] == ["3 of 3 checks held"]


def get_run(run_id: str):
    from pages.common import get_manager

    return get_manager().get(run_id)


@pytest.mark.timeout(600)  # its own pytest process, then the race
def test_the_speed_scenario_says_what_this_device_implies_and_draws_each_verdict(request):
    """The speed race on the device as it is: the one line of what is expected here, then each check with its mark
    (held, or "cannot tell here" with the reason when the run's noise cannot decide; never failed on this device).
    Its verdicts judge step times, so it runs on the device's own OpenMP wait policy: in a pytest process of its own
    where this one runs on the suite's (tests/child_env.py)."""
    if quieted_here():
        run_on_device_policy(request.node.nodeid, timeout_s=540)
        return
    app = request.getfixturevalue("app")
    app.button(key="workshop_launch_speed").click().run()
    launch = app.session_state["workshop_launch"]
    scenario = SCENARIOS["speed"]
    assert scenario.expected_here("cpu") in markdown_texts(app)
    assert launch.wait(240)
    app.run()
    assert not app.exception and not app.error
    results = launch.results()
    assert [s.value for s in app.subheader] == [headline(results)]
    checks = [text for text in markdown_texts(app) if text.startswith(MARKS)]
    assert checks == [check_markdown(result) for result in results]
    assert not any(result.verdict is Verdict.FAILED for result in results)
    for text, result in zip(checks, results, strict=True):
        assert f"*expected:* {result.expectation}" in text
        if result.verdict is Verdict.CANNOT_TELL:
            assert text.startswith(":orange[?]") and "*cannot tell here:* " in text


def test_a_check_that_cannot_be_told_is_drawn_apart_with_its_reason():
    result = CheckResult("bf16-mixed at the large size", Verdict.CANNOT_TELL, "1.01× (95% interval 0.97–1.05)",
                         "faster than 32-true", "its interval includes 1×")
    assert check_markdown(result) == (":orange[?] **bf16-mixed at the large size** — 1.01× (95% interval "
                                      "0.97–1.05)  \n*expected:* faster than 32-true  \n*cannot tell here:* its "
                                      "interval includes 1×")
    failed = CheckResult("t", Verdict.FAILED, "f", "e", "because")
    assert check_markdown(failed).startswith(":red[✗] **t** — f") and "*why not:* because" in check_markdown(failed)
