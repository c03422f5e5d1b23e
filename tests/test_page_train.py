"""The Train page under AppTest: renders, launches one lane per mode, draws every lane, refuses bad input."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import pandas as pd
import pytest
from cli_process import start_cli_run, stored_steps
from failing_workload import OutOfMemoryAt
from figure_json import points_by_trace, spec
from streamlit.testing.v1 import AppTest

from amp_core.config import FaultSpec, RunConfig
from amp_core.diagnostics.cost import TIMED_STEPS
from amp_core.precision import default_modes
from amp_core.records.opening import open_store
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
    """Rerun the page once the cost probes are measured: wait for their worker thread to end (it races off the
    page's thread; the fragment's timer, which AppTest does not fire, would have redrawn the page then)."""
    from pages.common import probe_board

    assert probe_board().wait(120), "the cost probes did not finish"
    at.run()
    assert not at.exception
    return at


def probe_table(at: AppTest) -> pd.DataFrame:
    """The cost probe's table (Markdown: no data grid on the first view)."""
    (text,) = [m.value for m in at.markdown if m.value.startswith("| mode |")]
    header, _, *rows = text.splitlines()
    cells = [[cell.strip() for cell in row.strip("|").split(" | ")] for row in [header, *rows]]
    return pd.DataFrame(cells[1:], columns=cells[0])


def lanes_shown(at: AppTest) -> pd.DataFrame:
    """The live view's lanes table (one row per lane, every headline figure): Streamlit's for a run that ended, the
    one the live board was drawn with for a live run (pages/live_chart.py)."""
    boards = [json.loads(element.proto.json_args)["table"] for element in at.get("component_instance")
              if element.proto.component_name.endswith("amp_live_chart")]
    tables = [frame.value for frame in at.dataframe if "progress" in frame.value.columns]
    tables += [pd.DataFrame(board["rows"], columns=[column["name"] for column in board["columns"]])
               for board in boards]
    (table,) = tables
    return table


def test_fresh_store_renders_the_form_and_the_cost_probe(app):
    assert not app.error
    assert app.multiselect(key="train_modes").value == default_modes("cpu")
    assert any("No runs yet" in info.value for info in app.info)
    assert app.button(key="train_launch")  # the form is usable while the probe measures
    assert any("Racing the modes through the runner" in caption.value for caption in app.caption)
    after_the_probes(app)
    probe = probe_table(app)
    assert probe["mode"].tolist() == default_modes("cpu")
    assert probe["time vs 32-true"].iloc[0] == "1.00×"
    assert set(probe["measured by"]) == {"cost probe"}
    (timed,) = set(probe["steps timed"])  # every lane stepped in turn to the race's end, none cut short
    assert "capped" not in timed and int(timed.replace(",", "")) >= TIMED_STEPS, timed
    assert manager().list_runs().empty


@pytest.mark.both_stores
def test_the_cost_probe_waits_while_another_process_trains_on_this_machine(fresh_store):
    # A CLI run on this machine shares its cores: the probe's race would measure both jobs. The panel names the run
    # and races once it has ended.
    cli = start_cli_run(fresh_store, "--workload", "mlp_regression", "--modes", "32-true", "--steps", "10000000")
    try:
        deadline = time.monotonic() + 60
        while stored_steps(fresh_store) == 0:
            assert cli.poll() is None and time.monotonic() < deadline, "the CLI run wrote no records"
            time.sleep(0.1)
        at = AppTest.from_file(PAGE, default_timeout=120).run()
        assert not at.exception
        (run_id,) = manager().list_runs()["run_id"]
        waiting = [caption.value for caption in at.caption if "Measured once no run is going" in caption.value]
        assert waiting and run_id in waiting[0], [caption.value for caption in at.caption]
        assert not any("Racing the modes" in caption.value for caption in at.caption)
    finally:
        cli.send_signal(signal.SIGINT)
        cli.wait(60)
    at.run()  # the CLI run has ended (its status says so): the probe races now
    assert any("Racing the modes through the runner" in caption.value for caption in at.caption)
    after_the_probes(at)
    assert probe_table(at)["mode"].tolist() == default_modes("cpu")


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
    for key in ("train_chart_loss", "train_chart_step_time", "train_chart_memory"):
        points = points_by_trace(figures[key])
        assert all(points.get(mode, 0) > 0 for mode in modes), (key, points)
    assert "train_chart_lr" not in figures  # a constant LR is one line
    assert any("constant at **0.001** in every lane" in text.value for text in app.markdown)
    scale = points_by_trace(figures["train_chart_scale"])
    if "16-mixed" in modes:
        frame = run.frame()
        skipped = int(frame[frame["mode"] == "16-mixed"]["skipped"].sum())
        assert scale == {"16-mixed": 12, **({"16-mixed skipped": skipped} if skipped else {})}
    else:
        assert scale == {}
    table = lanes_shown(app)
    assert table["lane"].tolist() == modes and table["status"].tolist() == ["finished"] * len(modes)
    assert table["progress"].tolist() == [1.0] * len(modes) and table["steps"].tolist() == ["12 / 12"] * len(modes)
    assert all(table[column].str.len().gt(0).all() for column in ("loss now", "ms/step", "speed", "memory"))
    assert app.selectbox(key="train_run_pick").value == run.run_id
    # The run's configuration, drawn once per script run below the live view (not at each of its redraws).
    assert [expander.label for expander in app.expander][-1] == "Run configuration"
    assert json.loads(app.json[-1].value)["modes"] == modes


def test_reset_the_form_puts_every_setting_back_and_comes_before_the_form(app):
    # Before the form's widgets (the first button a browser draws: its code then loads with the first wave).
    assert next(button.key for button in app.button) == "train_reset"
    app.number_input(key="train_steps").set_value(500).run()
    app.number_input(key="train_lr").set_value(0.0).run()  # an error on the page until the reset
    app.multiselect(key="train_modes").set_value(["16-mixed"]).run()
    app.toggle(key="train_onecycle").set_value(True).run()
    app.session_state["train_more_open"] = True  # the "More" section open: its widgets are reset too
    app.run()
    app.text_input(key="train_name").set_value("mine").run()
    assert app.error
    app.button(key="train_reset").click().run()
    assert not app.exception and not app.error
    assert app.number_input(key="train_steps").value == RunConfig().steps
    assert app.number_input(key="train_lr").value == RunConfig().lr
    assert app.multiselect(key="train_modes").value == default_modes("cpu")
    assert app.toggle(key="train_onecycle").value is False
    assert app.text_input(key="train_name").value == ""
    assert not app.button(key="train_launch").disabled


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
    launch(app, ["32-true", "bf16-mixed"], steps=100_000)
    run = manager().runs()[0]
    app.button(key="train_pause").click().run()
    assert run.status == "paused"
    # One source of truth: the status line and every lane say paused; the picker does not claim a status at all.
    assert any("Run status: **paused**" in text.value for text in app.markdown)
    assert lanes_shown(app)["status"].tolist() == ["paused", "paused"]
    picker = app.selectbox(key="train_run_pick")
    assert not any(word in picker.format_func(picker.value) for word in ("running", "paused", "🟢"))
    app.button(key="train_resume").click().run()
    assert run.status == "running"
    assert lanes_shown(app)["status"].tolist() == ["running", "running"]
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
    store = open_store(fresh_store)
    config = RunConfig(workload="digits_mlp", modes=("32-true", "16-mixed"), device="cpu")
    store.create_run("old-run", config.to_dict(), "cpu", "x")
    with sqlite3.connect(fresh_store) as conn:  # as if the process that ran it had died
        conn.execute("UPDATE runs SET pid = ?", (2**22 + 12345,))
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    picker = at.selectbox(key="train_run_pick")
    assert picker.value == "old-run"
    assert any("Run status: **interrupted**" in text.value for text in at.markdown)
    assert sum("interrupted" in warning.value for warning in at.warning) == 2


def test_a_large_size_waits_for_the_user_before_probing_and_shows_an_estimate(app):
    app.selectbox(key="train_size").set_value("large").run()
    assert not app.exception and app.button(key="train_probe_go")
    (table,) = app.dataframe  # the estimate, not a probe's table
    estimates = table.value
    assert list(estimates.columns) == ["mode", "estimated time / step", "basis"]
    assert estimates["mode"].iloc[0] == "32-true"
    assert estimates["estimated time / step"].str.endswith("(estimate)").all()
    assert any("Estimates, not measurements" in caption.value for caption in app.caption)


def test_the_size_picker_lists_the_workloads_own_sizes_with_the_gpu_size(app):
    assert "xl" not in app.selectbox(key="train_size").options  # digits_mlp has no GPU size
    app.selectbox(key="train_workload").set_value("tiny_transformer").run()
    assert app.selectbox(key="train_size").options == ["small", "medium", "large", "xl"]


def test_a_finished_run_that_disagrees_with_the_probe_replaces_it(app, monkeypatch):
    from pages.common import probe_board

    app.selectbox(key="train_workload").set_value("mlp_regression").run()
    after_the_probes(app)
    config = RunConfig(workload="mlp_regression", modes=tuple(default_modes("cpu")), steps=60, device="cpu")
    board = probe_board()
    stale = {mode: (1000.0, 500) for mode in config.modes}  # as if the machine had been far slower when probed
    assert board.learn_from_run(config, stale, "slow-day")
    app.run()
    assert set(probe_table(app)["measured by"]) == {"run slow-day"}
    app.number_input(key="train_steps").set_value(60)
    app.button(key="train_launch").click().run()
    run = manager().runs()[0]
    run.join(120)
    app.run()  # the live view sees it finished and compares its medians with the remembered figures
    app.run()
    shown = probe_table(app)
    assert set(shown["measured by"]) == {f"run {run.run_id}"}
    assert float(shown["ms / step"].iloc[0]) < 1000


def test_the_lr_chart_appears_when_the_lr_moves(app):
    app.toggle(key="train_onecycle").set_value(True)
    launch(app, ["32-true"], steps=20)
    manager().runs()[0].join(120)
    app.run()
    assert "train_chart_lr" in charts(app)
    assert not any("constant at" in text.value for text in app.markdown)


def test_a_planted_outlier_is_marked_as_a_spike_on_the_loss_chart(fresh_store):
    from figure_json import values

    from amp_core.race.runner import Run

    config = RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=45, device="cpu",
                       faults=(FaultSpec.parse("batch_outlier:30@40"),))
    run = Run(config, open_store(fresh_store)).start()
    run.join(120)
    assert run.status == "finished"
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception
    assert at.selectbox(key="train_run_pick").value == run.run_id
    traces = {trace["name"]: trace for trace in charts(at)["train_chart_loss"]["data"]}
    for mode in ("32-true", "16-mixed"):  # the same outlier batch spikes every lane's loss
        assert values(traces[f"{mode} spike"]["x"]).tolist() == [40]
        # One red circle for every lane, said by the caption, not a legend row per lane; hidden with its lane's line.
        assert traces[f"{mode} spike"]["showlegend"] is False and traces[f"{mode} spike"]["legendgroup"] == mode
    assert "16-mixed skipped" in traces  # the 16-mixed lane also skipped it: both marks, at the same step
    assert any(caption.value.startswith("○ a loss spike: above median + 6·MAD") for caption in at.caption)


def test_a_live_board_that_cannot_write_its_feed_says_so_and_draws_the_run_still(app, stepped_launches, monkeypatch,
                                                                                  tmp_path):
    import pages.live_chart as live_chart
    from amp_core.views.live_feed import LiveFeeds
    from amp_core.views.shared import LiveRoom

    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the feeds' folder should be")
    feeds = LiveFeeds(blocked / "feeds", LiveRoom(share_s=0.5), tick_s=3600.0)
    monkeypatch.setattr(live_chart, "_feeds", feeds)
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({4}))
    run = manager().launch(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=100_000,
                                     batch_size=16))
    try:
        run.wait_until(stepped_launches.parked)
        app.session_state["train_run_pick"] = run.run_id
        app.run()
        assert not app.exception
        assert any(w.value.startswith("The live board could not write its feed") for w in app.warning)
        assert lanes_shown(app)["steps"].tolist() == ["2 / 100,000"] * 2 and "train_chart_loss" in charts(app)
    finally:
        feeds.close()
        run.stop()
        run.join()
