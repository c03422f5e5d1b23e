"""The Train page under AppTest: renders, launches one lane per mode, draws every lane, refuses bad input."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest
from failing_workload import OutOfMemoryAt
from figure_json import points_by_trace, spec
from streamlit.testing.v1 import AppTest

from amp_core.config import FaultSpec, RunConfig
from amp_core.precision import default_modes
from amp_core.records.store import RunStore
from amp_core.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "train.py")


def manager():
    from pages.common import get_manager

    return get_manager()


@pytest.fixture
def app() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    return at


def charts(at: AppTest) -> dict[str, dict]:
    """The page's plotly figures by chart key."""
    return {chart.key: spec(chart.proto.spec)
            for chart in at.get("plotly_chart")}


def launch(at: AppTest, modes: list[str], steps: int = 12) -> AppTest:
    at.multiselect(key="train_modes").set_value(modes)
    at.number_input(key="train_steps").set_value(steps)
    at.selectbox(key="train_workload").set_value("mlp_regression")
    return at.button(key="train_launch").click().run()


def after_the_probes(at: AppTest) -> AppTest:
    """Rerun the page once the cost probes are measured: wait for their worker thread to end (it measures off the
    page's thread; the fragment's timer, which AppTest does not fire, would have redrawn the page then)."""
    for thread in threading.enumerate():
        if thread.name == "amp-probe":
            thread.join(120)
            assert not thread.is_alive(), "the cost probes did not finish"
    at.run()
    assert not at.exception
    return at


def test_fresh_store_renders_the_form_and_the_cost_probe(app):
    assert not app.error
    assert app.multiselect(key="train_modes").value == default_modes("cpu")
    assert any("No runs yet" in info.value for info in app.info)
    assert app.button(key="train_launch")  # the form is usable while the probe measures
    after_the_probes(app)
    (probe,) = [df.value for df in app.dataframe]
    assert probe["mode"].tolist() == default_modes("cpu")
    assert probe["time vs 32-true"].iloc[0] == "1.00×"
    assert manager().list_runs().empty


@pytest.mark.parametrize("modes", [["32-true", "bf16-mixed"], ["bf16-mixed", "16-mixed", "bf16-true"]])
def test_launch_creates_one_lane_per_mode_and_charts_every_lane(app, modes):
    launch(app, modes)
    assert not app.exception and not app.error
    runs = manager().runs()
    assert len(runs) == 1
    run = runs[0]
    assert [lane.mode for lane in run.lanes] == modes
    assert any("Launched" in toast.value for toast in app.toast)
    run.join(120)
    app.run()
    assert not app.exception and not app.error
    figures = charts(app)
    for key in ("train_chart_loss", "train_chart_step_time", "train_chart_lr", "train_chart_memory"):
        points = points_by_trace(figures[key])
        assert all(points.get(mode, 0) > 0 for mode in modes), (key, points)
    scale = points_by_trace(figures["train_chart_scale"])
    if "16-mixed" in modes:
        frame = run.frame()
        skipped = int(frame[frame["mode"] == "16-mixed"]["skipped"].sum())
        assert scale == {"16-mixed": 12, **({"16-mixed skipped": skipped} if skipped else {})}
    else:
        assert scale == {}
    assert [p.value for p in app.get("progress")] == [100] * len(modes)
    assert app.selectbox(key="train_run_pick").value == run.run_id


def test_lr_zero_is_an_error_naming_the_field_and_creates_no_run(app):
    app.number_input(key="train_lr").set_value(0.0).run()
    assert not app.exception
    assert any("lr" in error.value and "must be > 0" in error.value for error in app.error)
    assert app.button(key="train_launch").disabled  # AppTest, like a browser, cannot press it
    assert manager().list_runs().empty
    assert not manager().runs()


def test_no_mode_chosen_is_an_error(app):
    app.multiselect(key="train_modes").set_value([]).run()
    assert any("modes" in error.value for error in app.error)
    assert manager().list_runs().empty


def test_pause_resume_stop_act_on_the_run(app, no_leaked_threads):
    launch(app, ["32-true"], steps=100_000)
    run = manager().runs()[0]
    app.button(key="train_pause").click().run()
    assert run.status == "paused"
    app.button(key="train_resume").click().run()
    assert run.status == "running"
    app.button(key="train_stop").click().run()
    assert run.status == "stopped" and not run.alive
    app.run()
    assert not app.exception
    assert not [b for b in app.button if b.key in ("train_pause", "train_stop")]


def test_a_failed_lane_shows_its_message_and_the_others_go_on(app, monkeypatch):
    workload = OutOfMemoryAt(step=3)  # the bf16-mixed lane's model asks for more memory than there is at step 3
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    run = manager().launch(RunConfig(workload=workload.name, modes=("32-true", "bf16-mixed"), steps=10, device="cpu"))
    run.join(60)
    app.run()
    assert not app.exception
    (error,) = [e.value for e in app.error]
    assert "bf16-mixed" in error and "can't allocate memory" in error and "other lanes went on" in error
    assert "Traceback" not in error
    assert [lane.status for lane in run.lanes] == ["finished", "failed"]
    assert points_by_trace(charts(app)["train_chart_loss"]) == {"32-true": 10, "bf16-mixed": 3}


def test_a_failed_run_says_why_once(app):
    bad = FaultSpec(kind="grad_inf", param="no_such_param", step=3)
    run = manager().launch(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=10,
                                     device="cpu", faults=(bad,)))
    run.join(60)
    app.run()
    assert not app.exception
    (error,) = [e.value for e in app.error]
    assert error.startswith("The run failed:") and "no parameter 'no_such_param'" in error


def test_run_picker_lists_runs_from_before_a_restart(fresh_store):
    store = RunStore(fresh_store)
    config = RunConfig(workload="digits_mlp", modes=("32-true", "16-mixed"), device="cpu")
    store.create_run("old-run", config.to_dict(), "cpu", "x")
    with sqlite3.connect(fresh_store) as conn:  # as if the process that ran it had died
        conn.execute("UPDATE runs SET pid = ?", (2**22 + 12345,))
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    picker = at.selectbox(key="train_run_pick")
    assert picker.value == "old-run"
    assert "interrupted" in picker.format_func(picker.value)
    assert sum("interrupted" in warning.value for warning in at.warning) == 2


def test_a_large_size_waits_for_the_user_before_probing(app):
    app.selectbox(key="train_size").set_value("large").run()
    assert not app.exception and not app.dataframe
    assert app.button(key="train_probe_go")
