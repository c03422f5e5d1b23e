"""The live view's readers: headline figures per lane, and a follower that reads only new records."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from step_records import records

from amp_core.config import RunConfig
from amp_core.race.runner import RunManager
from amp_core.records import STEP_FIELDS, StepRecord
from amp_core.records.opening import open_store
from amp_core.records.sink import RecordSink
from amp_core.views.live import RecordFollower, format_ratio, format_scale
from amp_core.views.summary import lanes, summarize


def test_headlines_against_the_32_true_lane():
    frame = records(40, modes=("bf16-mixed", "32-true", "16-mixed"), skipped_at=(5, 9))
    frame.loc[frame["mode"] == "bf16-mixed", "step_ms"] = 4.0
    frame.loc[frame["mode"] == "32-true", "step_ms"] = 6.0
    heads = summarize(lanes(frame)).set_index("mode")
    assert heads["is_baseline"].to_dict() == {"bf16-mixed": False, "32-true": True, "16-mixed": False}
    assert heads.loc["bf16-mixed", "speedup"] == pytest.approx(1.5)
    assert heads.loc["32-true", "speedup"] == pytest.approx(1.0)
    held = {"bf16-mixed": 4000 + 4000 + 8000 + 3900, "32-true": 8000 + 4000 + 8000 + 3900}
    assert heads.loc["bf16-mixed", "mem_ratio"] == pytest.approx(held["bf16-mixed"] / held["32-true"])
    assert heads.loc["16-mixed", "skipped_steps"] == 2
    assert heads.loc["16-mixed", "scale"] == 2.0**14
    assert math.isnan(heads.loc["32-true", "scale"])
    last = frame[(frame["mode"] == "bf16-mixed")].iloc[-1]["loss"]
    assert heads.loc["bf16-mixed", "latest_loss"] == np.float32(last)  # records hold losses in float32


def test_headlines_fall_back_to_the_first_lane():
    heads = summarize(lanes(records(5, modes=("bf16-mixed", "16-mixed"))))
    assert heads["is_baseline"].tolist() == [True, False]
    assert summarize([]).empty


def test_lanes_keep_runs_apart_in_order_of_first_appearance():
    first = records(3, modes=("bf16-mixed", "32-true"), run_id="r1")
    second = records(3, modes=("32-true",), run_id="r0")
    split = lanes(pd.concat([first, second], ignore_index=True).iloc[::-1])
    assert [(s.run_id, s.lane, s.mode) for s in split] == [("r0", 0, "32-true"), ("r1", 1, "32-true"),
                                                          ("r1", 0, "bf16-mixed")]
    assert all(s["step"].tolist() == [0.0, 1.0, 2.0] for s in split)


@pytest.mark.parametrize(("value", "text"), [(65536.0, "2^16"), (0.5, "2^-1"), (3.0, "3"), (float("nan"), "no scaler"),
                                             (None, "no scaler")])
def test_format_scale(value, text):
    assert format_scale(value) == text


def test_format_ratio():
    assert format_ratio(1.2345) == "1.23×" and format_ratio(float("nan")) == "–"


def test_follower_reads_a_live_run_incrementally(fresh_store, stepped_launches, no_leaked_threads, monkeypatch):
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({10, 30}))  # lane steps: a page polls twice
    manager = RunManager(open_store(fresh_store))
    run = manager.launch(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=40, device="cpu"))
    follower = RecordFollower(run.run_id)
    seen = []
    for paused_at in (10, 30):
        run.wait_until(stepped_launches.parked)
        series = follower.update(manager)
        assert sum(lane.stats.records for lane in series) == paused_at and run.alive
        seen.append({lane.lane: lane["loss"].copy() for lane in series})
        run.resume()
    run.join()
    series = follower.update(manager)
    assert [lane.stats.records for lane in series] == [40, 40]
    pd.testing.assert_frame_equal(summarize(series), summarize(run.frame()))
    for lane, from_frame in zip(series, lanes(run.frame()), strict=True):
        assert lane.bucket_steps == 1 and (lane["step"] == np.arange(40)).all()
        assert (lane["loss"] == from_frame["loss"]).all()
        for earlier in seen:  # what was read before reads the same now, the new records after it
            assert (lane["loss"][:len(earlier[lane.lane])] == earlier[lane.lane]).all()


def test_follower_reads_a_stored_run_as_another_process_writes_it(fresh_store):
    """A writer (as a CLI run in another process would be) flushes twice; a follower on its own store object reads
    what each flush wrote, every record once, and keeps the chunks it read."""
    config = RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), device="cpu")
    sink = RecordSink("r", open_store(fresh_store))
    sink.open(config.to_dict(), "cpu", "x")
    rows = records(10, modes=("32-true", "bf16-mixed"))
    as_records = [StepRecord(**{k: (None if pd.isna(v) else v) for k, v in row.items()})
                  for row in rows[list(STEP_FIELDS)].to_dict("records")]
    for record in as_records[:7]:  # steps 0-2 both lanes, step 3 lane 0 only
        sink.step(record)
    sink.flush()
    manager = RunManager(open_store(fresh_store))
    follower = RecordFollower("r")
    assert [lane.stats.records for lane in follower.update(manager)] == [4, 3]
    for record in as_records[7:]:
        sink.step(record)
    sink.flush()
    series = follower.update(manager)
    assert [lane.stats.records for lane in series] == [10, 10]
    assert [lane["step"].tolist() for lane in series] == [list(range(10))] * 2
    expected = rows.sort_values(["lane", "step"])["loss"].to_numpy(dtype=np.float32)
    assert np.concatenate([lane["loss"] for lane in series]).tolist() == expected.tolist()
    assert follower.update(manager)[0].stats.records == 10


def test_the_lane_tables_headers_name_the_baseline_only_where_every_column_still_fits():
    from amp_core.views.live import PROGRESS_PX, lane_headers
    from amp_core.views.tables import TABLE_WIDTH_PX, content_widths

    def table(lane_names):
        return pd.DataFrame({"lane": lane_names, "status": "running", "steps": "1,456 / 4,000", "progress": 0.36,
                             "loss now": "0.02091", "ms/step": "2.53", "speed": "0.86×", "memory": "1.00×",
                             "skipped": "0", "scale": "no scaler"})

    labels, widths, caption = lane_headers(table(["32-true", "bf16-mixed"]), "32-true")
    assert labels["speed"] == "speed vs 32-true" and not caption
    assert sum(widths.values()) + PROGRESS_PX <= TABLE_WIDTH_PX
    long = table(["bf16-mixed", "bf16-mixed+compile"])
    labels, widths, caption = lane_headers(long, "bf16-mixed")
    assert labels == {"speed": "speed", "memory": "memory"} and "bf16-mixed" in caption
    assert sum(widths.values()) + PROGRESS_PX <= TABLE_WIDTH_PX
    # the long headers would not have fitted: that is why they were shortened
    full = {"speed": "speed vs bf16-mixed", "memory": "memory vs bf16-mixed"}
    assert sum(content_widths(long.drop(columns="progress"), full).values()) + PROGRESS_PX > TABLE_WIDTH_PX
