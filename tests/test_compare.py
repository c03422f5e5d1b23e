"""amp_core.compare with real CPU runs in a real SQLite store: gather, label, time, chart and export lanes."""

import io
import re
import signal

import numpy as np
import pandas as pd
import pytest
from cli_process import start_cli_run, wait_for_stored_steps

from amp_core.config import RunConfig
from amp_core.race.runner import Run, RunManager
from amp_core.records import STEP_FIELDS
from amp_core.records.opening import open_store
from amp_core.views import compare
from amp_core.views.plots import mode_color
from amp_core.views.summary import summarize


def tiny(modes, steps, **changes) -> RunConfig:
    return RunConfig(workload="mlp_regression", modes=modes, steps=steps, batch_size=16, **changes)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run A: 32-true + 16-mixed (12 steps; fp16 skips its first steps while the scale backs off);
    run B: 16-mixed alone (8 steps). Both finished, both in the store and in the launching manager."""
    store = open_store(tmp_path_factory.mktemp("compare") / "runs.sqlite3")
    manager = RunManager(store)
    run_a = manager.launch(tiny(("32-true", "16-mixed"), 12))
    run_a.join()
    run_b = manager.launch(tiny(("16-mixed",), 8, seed=1))
    run_b.join()
    assert run_a.status == run_b.status == "finished"
    return manager, run_a.run_id, run_b.run_id


def keys_of(run_a, run_b):
    return [f"{run_a}/0", f"{run_a}/1", f"{run_b}/0"]


def test_short_run_id_and_lane_keys():
    assert compare.short_run_id("20250101-120000-a1b2c3") == "a1b2c3"
    assert compare.split_lane_key("20250101-120000-a1b2c3/2") == ("20250101-120000-a1b2c3", 2)


@pytest.mark.parametrize("key", ["no-lane", "run/", "/3", "run/x", "run/-1"])
def test_refuses_a_malformed_lane_key(key):
    with pytest.raises(ValueError, match="a lane key is 'run_id/lane'"):
        compare.split_lane_key(key)


def test_lane_table_labels_every_lane_and_skips_unknown_runs(two_runs):
    manager, run_a, run_b = two_runs
    table = compare.lane_table(manager, [run_a, "no-such-run", run_b, run_a])
    short_a, short_b = compare.short_run_id(run_a), compare.short_run_id(run_b)
    assert table["key"].tolist() == keys_of(run_a, run_b)
    assert table["label"].tolist() == [f"32-true · {short_a}", f"16-mixed · {short_a}", f"16-mixed · {short_b}"]
    assert table["mode"].tolist() == ["32-true", "16-mixed", "16-mixed"] and table["lane"].tolist() == [0, 1, 0]
    assert not table["live"].any() and set(table["status"]) == {"finished"}
    from_store = compare.lane_table(RunManager(manager.store), [run_a, run_b])
    pd.testing.assert_frame_equal(from_store, table)


def test_lane_labels_stay_distinct_when_run_ids_end_alike(tmp_path):
    manager = RunManager(open_store(tmp_path / "runs.sqlite3"))
    for run_id in ("x-abc", "y-abc"):
        Run(tiny(("32-true",), 2), manager.store, run_id=run_id).start().join()
    table = compare.lane_table(manager, ["x-abc", "y-abc"])
    assert table["label"].tolist() == ["32-true · x-abc/0", "32-true · y-abc/0"]


def test_gather_reads_the_same_records_from_memory_and_from_the_store(two_runs):
    manager, run_a, run_b = two_runs
    keys = [f"{run_b}/0", f"{run_a}/1"]
    from_memory = compare.gather_steps(manager, keys)
    from_store = compare.gather_steps(RunManager(manager.store), keys)
    pd.testing.assert_frame_equal(from_memory, from_store)
    assert list(from_memory.columns) == list(STEP_FIELDS)
    assert compare.frame_lane_keys(from_memory) == keys  # lanes in the order asked for
    for _, lane in from_memory.groupby(["run_id", "lane"]):
        assert lane["step"].tolist() == list(range(len(lane)))
    assert len(from_memory) == 8 + 12
    assert from_memory["scale"].notna().all()  # both lanes are 16-mixed
    assert from_memory["peak_above_start_bytes"].isna().all() and str(from_memory["params_bytes"].dtype) == "Int64"


def test_gather_nothing_gives_an_empty_frame_summarize_accepts(two_runs):
    manager, _, _ = two_runs
    frame = compare.gather_steps(manager, [])
    assert frame.empty and list(frame.columns) == list(STEP_FIELDS)
    assert summarize(frame).empty
    assert compare.frame_lane_keys(frame) == []


def test_live_run_ids_lists_only_runs_still_training(tmp_path, no_leaked_threads):
    manager = RunManager(open_store(tmp_path / "runs.sqlite3"))
    done = manager.launch(tiny(("32-true",), 2))
    done.join()
    going = manager.launch(tiny(("32-true",), 100_000))
    try:
        assert compare.live_run_ids(manager, [done.run_id, going.run_id, "no-such-run"]) == [going.run_id]
    finally:
        going.stop()
    assert compare.live_run_ids(manager, [going.run_id]) == []


def test_a_run_another_process_is_writing_counts_as_live(tmp_path):
    """The CLI writes to the same store from its own process: the page's manager only sees the store."""
    path = tmp_path / "runs.sqlite3"
    cli = start_cli_run(path, "--workload", "mlp_regression", "--modes", "32-true", "--steps", "1000000")
    try:
        wait_for_stored_steps(path, cli, more_than=20)
        page_manager = RunManager(open_store(path))
        (run_id,) = page_manager.list_runs()["run_id"]
        assert page_manager.get(run_id) is None  # not this process's run
        assert compare.live_run_ids(page_manager, [run_id]) == [run_id]
        cli.send_signal(signal.SIGINT)  # Ctrl-C: the CLI stops its run cleanly
        assert cli.wait(60) == 0
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert compare.live_run_ids(page_manager, [run_id]) == []
    assert page_manager.run_info(run_id).status == "stopped"
    steps = compare.gather_steps(page_manager, [f"{run_id}/0"])["step"].tolist()
    assert len(steps) > 20 and steps == list(range(len(steps)))
    assert len(steps) == page_manager.run_info(run_id).lanes[0].steps_done


def line_traces(fig) -> list:
    return [t for t in fig.data if t.mode == "lines"]


def test_loss_vs_step_colours_by_mode_and_dashes_by_run(two_runs):
    manager, run_a, run_b = two_runs
    keys = keys_of(run_a, run_b)
    frame = compare.gather_steps(manager, keys)
    labels = dict(zip(keys, ["A fp32", "A fp16", "B fp16"], strict=True))
    fig = compare.loss_vs_step_figure(frame, labels, log_y=True)
    lines = line_traces(fig)
    assert [t.name for t in lines] == ["A fp32", "A fp16", "B fp16"]
    assert [t.line.color for t in lines] == [mode_color("32-true"), mode_color("16-mixed"), mode_color("16-mixed")]
    assert [t.line.dash for t in lines] == ["solid", "solid", "dash"]
    assert fig.layout.yaxis.type == "log"
    assert fig.layout.yaxis.minorloglabels == "complete"  # "200, 500", not "2, 5": ticks carry their power of ten
    assert compare.loss_vs_step_figure(frame, labels).layout.yaxis.minorloglabels is None  # linear: no such ticks
    fp16_a = frame[(frame["run_id"] == run_a) & (frame["lane"] == 1)]
    assert list(lines[1].y) == fp16_a["loss"].tolist()
    skipped_steps = fp16_a.loc[fp16_a["skipped"], "step"].tolist()
    assert skipped_steps, "16-mixed starts at scale 65536 and must skip some steps on this workload"
    markers = [t for t in fig.data if t.mode == "markers" and t.legendgroup == keys[1]]
    assert len(markers) == 1 and list(markers[0].customdata) == skipped_steps


def lanes_of(manager, keys):
    return compare.gather_lanes(manager, keys)


@pytest.mark.parametrize("time_axis", ["compute", "wall"])
def test_loss_vs_time_uses_the_chosen_clock(two_runs, time_axis):
    manager, run_a, run_b = two_runs
    frame = compare.gather_steps(manager, keys_of(run_a, run_b))
    fig = compare.loss_vs_time_figure(lanes_of(manager, keys_of(run_a, run_b)), time_axis=time_axis, log_y=False)
    drawn = [np.asarray(t.x) for t in line_traces(fig)]
    assert len(drawn) == 3
    for x, (_, lane) in zip(drawn, frame.groupby(["run_id", "lane"], sort=False), strict=True):
        ms = lane["step_ms"].to_numpy()
        if time_axis == "compute":  # the running sum of the rolling median of the lane's step times
            median = pd.Series(ms).rolling(25, min_periods=1).median().to_numpy()
            np.testing.assert_allclose(x, np.cumsum(median) / 1e3, rtol=1e-6)
        else:  # wall clock since the lane's first step began
            start = lane["t_wall_s"].iloc[0] - ms[0] / 1e3
            np.testing.assert_allclose(x, lane["t_wall_s"] - start, rtol=1e-6, atol=1e-5)
            assert (np.diff(x) > 0).all()
    assert fig.layout.xaxis.title.text == compare.TIME_AXES[time_axis]


def test_time_at_median_speed_is_not_stretched_by_a_stall():
    lane = long_lane(300)
    lane["step_ms"] = 2.0
    lane.loc[150, "step_ms"] = 10_000.0  # one step stalled for ten seconds (a page redrawing, another program)
    fig = compare.loss_vs_time_figure(lane, time_axis="compute")
    (line,) = line_traces(fig)
    assert line.x[-1] == pytest.approx(300 * 2.0 / 1e3)
    walled = compare.loss_vs_time_figure(lane, time_axis="wall")
    assert line_traces(walled)[0].x[-1] > 2.9  # the wall clock (t_wall_s here: 0.01 s a step) tells what happened


def test_refuses_an_unknown_time_axis(two_runs):
    manager, run_a, _ = two_runs
    with pytest.raises(ValueError, match="time_axis must be one of compute, wall"):
        compare.loss_vs_time_figure(lanes_of(manager, [f"{run_a}/0"]), time_axis="cpu")


def long_lane(n: int, mode: str = "32-true", run_id: str = "long") -> pd.DataFrame:
    rng = np.random.default_rng(0)
    loss = 1.0 / np.arange(1, n + 1) + rng.normal(0, 1e-4, n)
    skipped = np.zeros(n, dtype=bool)
    if n > 12_345:
        loss[12_345] = 50.0  # a spike decimation must keep
        skipped[7_777] = True
    return pd.DataFrame({"run_id": run_id, "lane": 0, "mode": mode, "step": np.arange(n), "loss": loss,
                         "step_ms": rng.gamma(4.0, 2.0, n), "skipped": skipped, "t_wall_s": np.arange(n) * 0.01,
                         "lr": 1e-3, "scale": np.nan, "params_bytes": 4000, "grads_bytes": 4000, "optim_bytes": 8000,
                         "activations_bytes": 100, "cuda_peak_bytes": np.nan})


def test_a_20k_step_lane_is_decimated_but_keeps_spikes_and_skips():
    fig = compare.loss_vs_step_figure(long_lane(20_000))
    (line,) = line_traces(fig)
    assert len(line.x) <= 2_100
    assert 12_345 in line.x and max(line.y) == 50.0
    assert 7_777 in line.x
    (markers,) = [t for t in fig.data if t.mode == "markers"]
    assert list(markers.x) == [7_777]


def test_step_time_chart_is_a_median_and_band_per_lane_even_for_a_long_lane():
    frame = pd.concat([long_lane(20_000), long_lane(300, "bf16-mixed", "short")], ignore_index=True)
    frame.loc[frame["step"] == 5_000, "step_ms"] = 5_000.0  # a stall
    fig = compare.step_time_figure(frame, {"long/0": "long lane"}, log_y=True)
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.minorloglabels == "complete"
    medians = [t for t in fig.data if t.mode == "lines" and t.line.width]
    assert [t.name for t in medians] == ["long lane", "short/0"]
    assert [t.line.color for t in medians] == [mode_color("32-true"), mode_color("bf16-mixed")]
    long_ms = frame.loc[frame["run_id"] == "long", "step_ms"]
    assert len(medians[0].x) <= 2_000 and max(medians[0].y) < 3 * long_ms.median()  # the stall moves no median
    assert len(medians[1].x) == 300  # a short lane: a rolling median over its records
    bands = [t for t in fig.data if t.fill == "tonexty"]
    assert [t.name for t in bands] == ["long lane p10-p90", "short/0 p10-p90"]
    raw = compare.step_time_figure(frame, raw=True)
    (dots,) = [t for t in raw.data if t.name == "long/0 (each step)"]
    assert max(dots.y) == 5_000.0  # asked for, every step's time is there, the stall included


def test_lanes_that_trained_identically_are_named_as_hiding_each_other(tmp_path):
    manager = RunManager(open_store(tmp_path / "runs.sqlite3"))
    first = manager.launch(tiny(("32-true", "bf16-mixed"), 12))
    first.join()
    second = manager.launch(tiny(("32-true",), 12))  # same seed, same batches: the same losses, bit for bit
    second.join()
    keys = [f"{first.run_id}/0", f"{first.run_id}/1", f"{second.run_id}/0"]
    frame = compare.gather_steps(manager, keys)
    labels = dict(zip(keys, ["A fp32", "A bf16", "B fp32"], strict=True))
    groups = compare.loss_overlaps(frame, labels, tolerance=0.0)
    assert groups == [{"lanes": ["A fp32", "B fp32"], "steps": 12, "identical": True,
                       "same": [("A fp32", "B fp32")], "max_rel_diff": 0.0}]
    (note,) = compare.overlap_notes(frame[frame["mode"] == "32-true"], labels)
    assert note.startswith("A fp32 and B fp32 recorded the same loss, bit for bit, at every one of their 12 common")


def test_near_identical_lanes_are_told_apart_by_the_difference_chart():
    base = long_lane(300)
    close = long_lane(300, "bf16-mixed", "close").assign(loss=lambda f: f["loss"] * (1 + 3e-3))
    spiky = long_lane(300, "16-mixed", "spiky").assign(loss=lambda f: f["loss"] + 0.05)
    spiky.loc[100:102, "loss"] = 1e6  # a loss spike: three steps far beyond the rest
    frame = pd.concat([base, close, spiky], ignore_index=True)
    (group,) = compare.loss_overlaps(frame)
    assert group["lanes"] == ["long/0", "close/0"] and not group["identical"] and group["same"] == []
    assert group["max_rel_diff"] == pytest.approx(3e-3, rel=1e-2)
    (note,) = compare.overlap_notes(frame)
    assert note.startswith("long/0 and close/0 stay within 0.30% of each other") and "Loss minus the baseline" in note
    fig = compare.loss_difference_figure(frame, "long/0")
    close_line, spiky_line = [t for t in fig.data if t.mode == "lines"]
    np.testing.assert_allclose(close_line.y, base["loss"] * 3e-3, rtol=1e-4)  # losses are held in float32
    np.testing.assert_allclose(np.asarray(spiky_line.y)[[0, 50]], 0.05, rtol=1e-5)
    # The spike would flatten the rest: the axis keeps the bulk, the spike sits on its edge as ▲ with its true value.
    low, high = fig.layout.yaxis.range
    assert low <= 0 < 0.05 < high < 1
    (beyond,) = [t for t in fig.data if t.mode == "markers"]
    assert list(beyond.x) == [100, 101, 102] and set(beyond.y) == {high} and beyond.marker.symbol == "triangle-up"
    np.testing.assert_allclose(beyond.customdata, 1e6 - base["loss"].iloc[100:103], rtol=1e-6)
    assert "▲▼ beyond the axis" in fig.layout.title.text
    calm = compare.loss_difference_figure(frame[frame["run_id"] != "spiky"], "long/0")
    assert calm.layout.yaxis.range is None and not [t for t in calm.data if t.mode == "markers"]
    # A short stretch where the spike is 7.5 % of the points: clipped too (a 99th-percentile rule would keep it).
    short = frame[frame["step"].between(80, 119)]
    (beyond,) = [t for t in compare.loss_difference_figure(short, "long/0").data if t.mode == "markers"]
    assert list(beyond.x) == [100, 101, 102]
    with pytest.raises(ValueError, match="baseline lane"):
        compare.loss_difference_figure(frame, "nope/0")


def test_long_lanes_are_compared_on_bucket_means_and_say_so():
    base = long_lane(30_000)
    close = long_lane(30_000, "bf16-mixed", "close").assign(loss=lambda f: f["loss"] * (1 + 3e-3))
    frame = pd.concat([base, close], ignore_index=True)
    lanes = summarize_lanes(frame)
    assert all(lane.raw is None for lane in lanes)
    (group,) = compare.loss_overlaps(lanes)
    assert group["lanes"] == ["long/0", "close/0"] and not group["identical"]
    assert group["max_rel_diff"] == pytest.approx(3e-3, rel=0.05)
    (note,) = compare.overlap_notes(lanes)
    assert f"on the mean loss of each {lanes[0].bucket_steps:,}-step bucket, not step by step" in note
    fig = compare.loss_difference_figure(lanes, "long/0")
    assert "bucket by bucket" in fig.layout.title.text
    (line,) = line_traces(fig)
    _, means, _ = lanes[0].means("loss")
    np.testing.assert_allclose(line.y, means * 3e-3, rtol=1e-3)  # losses are held in float32


def summarize_lanes(frame):
    from amp_core.views.summary import lanes

    return lanes(frame)


def test_format_summary_reads_like_the_issue_asks(two_runs):
    manager, run_a, run_b = two_runs
    keys = keys_of(run_a, run_b)
    frame = compare.gather_steps(manager, keys)
    summary = summarize(frame, keys[0], last_k=4)
    table = compare.format_summary(summary, {keys[0]: "fp32 A"}, keys[0], last_k=4)
    assert table["lane"].tolist() == ["★ fp32 A", keys[1], keys[2]]
    assert table["speedup"].iloc[0] == "1.00×" and table["memory ratio"].iloc[0] == "1.00×"
    assert table["speedup"].iloc[1] == f"{summary['speedup'].iloc[1]:.2f}×"
    assert table["peak memory"].iloc[1] == f"{summary['peak_mib'].iloc[1]:.3g} MiB"
    # Two losses, two names: the Train page's latest loss, and the mean of the last k steps.
    assert "final loss" not in table.columns and compare.final_loss_column(4) == "final loss (mean of last 4)"
    assert table["latest loss"].tolist() == [f"{v:.4g}" for v in summary["latest_loss"]]
    assert table["final loss (mean of last 4)"].tolist() == [f"{v:.4g}" for v in summary["final_loss"]]
    assert table["latest loss"].tolist() != table["final loss (mean of last 4)"].tolist()
    assert table["final loss Δ"].iloc[0] == "+0" and table["final loss Δ"].iloc[2].startswith(("+", "-"))
    assert table["skipped steps"].tolist() == summary["skipped_steps"].tolist()
    assert table["diverged"].tolist() == ["no", "no", "no"]


def test_format_summary_shows_a_dash_for_missing_figures():
    summary = pd.DataFrame([{"run_id": "r", "lane": 0, "mode": "16-true", "steps": 3, "median_ms": 2.0,
                             "speedup": 1.0, "peak_bytes": 0.0, "peak_mib": 0.0, "mem_ratio": float("nan"),
                             "final_loss": float("nan"), "loss_delta": float("nan"), "latest_loss": float("nan"),
                             "skipped_steps": 0, "diverged": True}])
    row = compare.format_summary(summary).iloc[0]
    assert (row["memory ratio"], row["final loss (mean of last 20)"], row["final loss Δ"], row["latest loss"],
            row["diverged"]) == ("—", "—", "—", "—", "yes")


def test_csv_and_parquet_downloads_round_trip(two_runs):
    manager, run_a, run_b = two_runs
    frame = compare.gather_steps(manager, keys_of(run_a, run_b))
    from_parquet = pd.read_parquet(io.BytesIO(compare.parquet_bytes(frame)))
    pd.testing.assert_frame_equal(from_parquet, frame, check_dtype=False)
    from_csv = pd.read_csv(io.BytesIO(compare.csv_bytes(frame)))
    assert list(from_csv.columns) == list(STEP_FIELDS) and len(from_csv) == len(frame)
    np.testing.assert_allclose(from_csv["loss"], frame["loss"])
    assert from_csv["run_id"].tolist() == frame["run_id"].tolist()


def test_chart_html_is_standalone(two_runs):
    manager, run_a, _ = two_runs
    fig = compare.loss_vs_step_figure(compare.gather_steps(manager, [f"{run_a}/0"]))
    html = compare.figure_html(fig).decode()
    assert html.lstrip().lower().startswith("<!doctype html>") and "Loss vs step" in html
    assert not re.search(r"<script[^>]*\bsrc=", html)  # nothing fetched: plotly.js is inlined
    assert "plotly.js v" in html
    assert len(html) > 1_000_000


def test_what_streamlit_sends_of_each_compare_chart_is_what_a_validated_plotly_figure_gives():
    """Compare's charts skip plotly's validation and deep copies as the Train page's do (plots.ChartFigure): each
    redraw of a live comparison builds and sends them beside a training thread. What st.plotly_chart sends of each
    must equal plotly's own of the same spec."""
    import plotly.graph_objects as go
    import plotly.io as pio
    from figure_json import spec
    from plotly.tools import return_figure_from_figure_or_data

    from amp_core.views.plots import ChartFigure

    def sent(figure) -> dict:
        return spec(pio.to_json(return_figure_from_figure_or_data(figure, validate_figure=True), validate=False))

    frame = pd.concat([long_lane(3_000), long_lane(300, "bf16-mixed", "short")], ignore_index=True)
    figures = [compare.loss_vs_step_figure(frame, log_y=True), compare.loss_vs_time_figure(frame, time_axis="compute"),
               compare.step_time_figure(frame, raw=True, log_y=True), compare.loss_difference_figure(frame, "long/0")]
    for figure in figures:
        assert isinstance(figure, ChartFigure), figure.layout.title.text
        validated = go.Figure({"data": figure._data, "layout": {key: value for key, value in figure._layout.items()
                                                                if key != "template"}})
        assert sent(figure) == sent(validated), figure.layout.title.text
