"""The Compare page under AppTest, on a real store and real CPU runs: zero, one and three lanes, live runs."""

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.config import FaultSpec, RunConfig
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from amp_core.views import tables
from amp_core.views.plots import mode_color

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "compare.py")
DOWNLOADS = ["Records · CSV", "Records · Parquet", "Summary · CSV", "Loss vs step · HTML", "Loss vs time · HTML",
             "Step time per lane · median and p10-p90 band · HTML", "Memory held (latest step) · HTML"]


def tiny(modes, steps=10, **changes) -> RunConfig:
    return RunConfig(workload="mlp_regression", modes=modes, steps=steps, batch_size=16, **changes)


def stored_run(store_path: Path, modes) -> str:
    """A finished run written to the test's store by a thread of its own (not the page's manager)."""
    run = Run(tiny(modes), open_store(store_path)).start()
    run.join()
    assert run.status == "finished"
    return run.run_id


def page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    return at


def summary_table(at: AppTest):
    (table,) = [df.value for df in at.dataframe if "speedup" in df.value.columns]
    return table


def downloads(at: AppTest) -> list[str]:
    return [element.proto.label for element in at.get("download_button")]


def charts(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def test_empty_store_explains_what_to_do():
    at = page()
    assert not at.error
    assert any("No runs yet" in info.value and "Train" in info.value for info in at.info)
    assert not at.get("plotly_chart") and not at.get("download_button")


def test_one_lane(fresh_store):
    run_id = stored_run(fresh_store, ("32-true", "bf16-mixed"))
    at = page()
    assert at.multiselect(key="cmp_runs").value == [run_id]  # the newest run comes preselected
    assert at.multiselect(key="cmp_lanes").value == [f"{run_id}/0", f"{run_id}/1"]
    at.multiselect(key="cmp_lanes").set_value([f"{run_id}/1"]).run()
    assert not at.exception and not at.error and not at.warning
    table = summary_table(at)
    assert table["steps"].tolist() == [10] and "mode" not in table.columns  # the lane label says the mode
    assert {"latest loss", "final loss (mean of last 20)", "final loss Δ"} <= set(table.columns)
    assert "final loss" not in table.columns
    assert table["speedup"].tolist() == ["1.00×"] and table["lane"].iloc[0].startswith("★ bf16-mixed · ")
    assert at.selectbox(key="cmp_baseline").value == f"{run_id}/1"
    assert len(charts(at)) == 4  # one lane: no difference chart; loss, loss vs time, step time, memory
    assert downloads(at) == [*DOWNLOADS, "Report · HTML"]
    assert not any("different runs" in caption.value for caption in at.caption)


def test_three_lanes_of_two_runs(fresh_store):
    first = stored_run(fresh_store, ("bf16-mixed", "32-true"))
    second = stored_run(fresh_store, ("16-mixed",))
    at = page()
    at.multiselect(key="cmp_runs").set_value([second, first]).run()
    assert not at.exception and not at.error
    assert at.multiselect(key="cmp_lanes").value == [f"{second}/0", f"{first}/0", f"{first}/1"]
    assert at.selectbox(key="cmp_baseline").value == f"{first}/1"  # the 32-true lane, though not first
    table = summary_table(at)
    assert [label.split(" · ")[0].removeprefix("★ ") for label in table["lane"]] == ["16-mixed", "bf16-mixed",
                                                                                     "32-true"]
    assert table["lane"].iloc[2].startswith("★ 32-true") and table["speedup"].iloc[2] == "1.00×"
    assert all(cell.endswith("×") for cell in table["speedup"]) and all(table["peak memory"].str.endswith(" MiB"))
    (frame,) = [df for df in at.dataframe if "speedup" in df.value.columns]
    config = {name: c for name, c in json.loads(frame.proto.columns).items() if name != "_index"}
    assert set(config) == set(table.columns)  # every column sized to its content, the table fits the page
    assert sum(c["width"] for c in config.values()) <= tables.TABLE_WIDTH_PX
    assert config["skipped steps"]["label"] == "skipped" and "GradScaler" in config["skipped steps"]["help"]

    loss_vs_step, difference, loss_vs_time, step_time, memory = charts(at)
    assert memory["layout"]["title"]["text"].startswith("Memory held") and len(memory["data"]) == 3  # a bar per lane
    lines = [t for t in loss_vs_step["data"] if t["mode"] == "lines"]
    assert [t["line"]["color"] for t in lines] == [mode_color(m) for m in ("16-mixed", "bf16-mixed", "32-true")]
    assert [t["line"]["dash"] for t in lines] == ["solid", "dash", "dash"]
    assert loss_vs_step["layout"]["yaxis"]["type"] == "log"
    # Log axes label every tick with its power of ten ("200", "500"), not a bare "2" or "5".
    assert loss_vs_step["layout"]["yaxis"]["minorloglabels"] == "complete"
    assert difference["layout"]["title"]["text"].startswith("Loss minus the baseline's (32-true")
    assert [t["name"] for t in difference["data"] if t["mode"] == "lines"] == table["lane"].tolist()[:2]
    assert len([t for t in loss_vs_time["data"] if t["mode"] == "lines"]) == 3
    assert loss_vs_time["layout"]["yaxis"]["minorloglabels"] == "complete"
    medians = [t for t in step_time["data"] if t.get("line", {}).get("width")]
    assert [t["name"] for t in medians] == table["lane"].str.removeprefix("★ ").tolist()
    assert len([t for t in step_time["data"] if t.get("fill") == "tonexty"]) == 3  # a p10-p90 band per lane
    assert step_time["layout"]["yaxis"]["type"] == "linear"
    assert "median" in loss_vs_time["layout"]["xaxis"]["title"]["text"]
    assert downloads(at) == [*DOWNLOADS, f"Report · HTML · {second[-6:]}", f"Report · HTML · {first[-6:]}"]
    assert any("different runs" in caption.value for caption in at.caption)

    at.toggle(key="cmp_log_y").set_value(False).run()
    at.radio(key="cmp_time_axis").set_value("wall").run()
    at.toggle(key="cmp_log_ms").set_value(True).run()
    at.toggle(key="cmp_raw_step_times").set_value(True).run()
    assert not at.exception
    loss_vs_step, _, loss_vs_time, step_time, _ = charts(at)
    assert loss_vs_step["layout"]["yaxis"]["type"] == "linear"
    assert step_time["layout"]["yaxis"]["type"] == "log"
    assert step_time["layout"]["yaxis"]["minorloglabels"] == "complete"
    assert len([t for t in step_time["data"] if t["name"].endswith("(each step)")]) == 3
    assert "wall clock" in loss_vs_time["layout"]["xaxis"]["title"]["text"]

    at.number_input(key="cmp_k").set_value(3).run()
    assert not at.exception and "mean of the last 3 steps" in " ".join(c.value for c in at.caption)
    assert "final loss (mean of last 3)" in summary_table(at).columns


def test_the_diverged_column_appears_only_when_a_lane_diverged(fresh_store):
    config = tiny(("32-true", "bf16-mixed"), optimizer="sgd", faults=(FaultSpec.parse("grad_inf:layer2.bias@2"),))
    run = Run(config, open_store(fresh_store)).start()  # no scaler: the inf is applied and the weights turn inf
    run.join()
    at = page()
    assert not at.exception
    table = summary_table(at)
    assert "diverged" in table.columns and (table["diverged"] == "yes").all()
    assert any("Diverged: the last recorded loss is inf/NaN" in c.value for c in at.caption)
    clean = stored_run(fresh_store, ("32-true",))
    at.run()  # the new run joins the picker's options
    at.multiselect(key="cmp_runs").set_value([clean]).run()
    assert "diverged" not in summary_table(at).columns
    assert any("No lane diverged" in c.value for c in at.caption)


def test_lanes_that_trained_identically_get_a_note(fresh_store):
    first = stored_run(fresh_store, ("32-true", "bf16-mixed"))
    second = stored_run(fresh_store, ("32-true",))  # same seed and batches as the first run's 32-true lane
    at = page()
    at.multiselect(key="cmp_runs").set_value([second, first]).run()
    assert not at.exception and not at.error
    notes = [info.value for info in at.info if "bit for bit" in info.value]
    assert len(notes) == 1
    assert f"32-true · {second[-6:]} and 32-true · {first[-6:]} recorded the same loss, bit for bit" in notes[0]


def test_a_chosen_baseline_stays_and_removing_a_run_removes_its_lanes(fresh_store):
    first = stored_run(fresh_store, ("32-true", "bf16-mixed"))
    second = stored_run(fresh_store, ("16-mixed",))
    at = page()
    at.multiselect(key="cmp_runs").set_value([second, first]).run()
    at.selectbox(key="cmp_baseline").set_value(f"{second}/0").run()
    assert summary_table(at)["lane"].iloc[0].startswith("★ 16-mixed")
    at.multiselect(key="cmp_lanes").set_value([f"{second}/0", f"{first}/0"]).run()
    assert at.selectbox(key="cmp_baseline").value == f"{second}/0"  # the user's choice survives
    at.multiselect(key="cmp_runs").set_value([first]).run()
    assert not at.exception
    assert at.multiselect(key="cmp_lanes").value == [f"{first}/0"]  # the lane left out stays out
    assert at.selectbox(key="cmp_baseline").value == f"{first}/0"  # its lane left: back to the default


def test_zero_lanes_chosen_says_what_to_do(fresh_store):
    run_id = stored_run(fresh_store, ("32-true",))
    at = page()
    at.multiselect(key="cmp_lanes").set_value([]).run()
    assert not at.exception and not at.error
    assert any("Choose at least one run" in info.value for info in at.info)
    assert not at.get("plotly_chart")
    at.multiselect(key="cmp_runs").set_value([]).run()
    assert not at.exception and at.multiselect(key="cmp_lanes").value == []
    at.multiselect(key="cmp_runs").set_value([run_id]).run()
    assert at.multiselect(key="cmp_lanes").value == [f"{run_id}/0"]


def test_a_live_run_can_be_picked_and_refreshes(stepped_launches, no_leaked_threads, monkeypatch, fragment_timers):

    from pages.common import get_manager

    timers = fragment_timers
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({4, 10}))  # lane steps: two lanes, 2 then 5 steps
    run = get_manager().launch(tiny(("32-true", "16-mixed"), steps=100_000))
    try:
        run.wait_until(stepped_launches.parked)
        at = page()
        assert timers["comparison"] == 10.0  # the summary, the charts and the compiled lanes redraw while it trains
        assert at.multiselect(key="cmp_runs").value == [run.run_id]
        assert any("still training" in caption.value for caption in at.caption)
        assert summary_table(at)["steps"].tolist() == [2, 2]
        run.resume()
        run.wait_until(stepped_launches.parked)
        at.run()  # what the page's live timer does
        assert not at.exception
        assert summary_table(at)["steps"].tolist() == [5, 5]
        run.resume()
    finally:
        run.stop()
    at.run()  # finished now: the page redraws without the live timer
    assert not at.exception and not any("still training" in caption.value for caption in at.caption)
    assert summary_table(at)["steps"].tolist() == run.frame().groupby("lane").size().tolist()
    assert timers["comparison"] is None


@pytest.mark.parametrize("runs", [0, 1])
def test_reachable_from_the_app(fresh_store, runs):
    if runs:
        stored_run(fresh_store, ("32-true", "bf16-mixed"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    at.switch_page("pages/compare.py").run()
    assert not at.exception
    assert at.title[0].value == "Compare runs"
    assert len(at.get("plotly_chart")) == 5 * runs  # loss, loss minus the baseline's, loss vs time, step time, memory


def test_a_damaged_store_leaves_the_page_working_in_memory(fresh_store):
    """app.py shows the store banner; the page itself must just go on with the in-memory runs."""
    fresh_store.write_bytes(b"this is not a database" * 10)
    at = page()
    assert not at.error and any("No runs yet" in info.value for info in at.info)


def test_a_redraw_reads_the_lanes_summary_and_every_record_only_for_a_download(fresh_store, monkeypatch):
    from amp_core.views import compare

    stored_run(fresh_store, ("32-true", "bf16-mixed"))
    gathered = []
    every_record = compare.gather_steps
    monkeypatch.setattr(compare, "gather_steps", lambda *a: gathered.append(a) or every_record(*a))
    at = page()
    assert not at.exception and summary_table(at)["steps"].tolist() == [10, 10]
    at.run()  # what the live timer does
    assert gathered == []  # the charts and the table read the multi-resolution summary, not every record
    assert "Records · CSV" in downloads(at)
    assert "20 step records of 2 lane(s), gathered when you ask for them" in " ".join(c.value for c in at.caption)
