"""Ranks in the views, on hand-made records of a 2-rank job (every figure computed by hand below): one summary row per
lane, a row per rank, the spread across ranks, each lane's first rank for single-line charts; the Train page's note
for a run it does not own, its progress for a run of unknown length, and memory bars without unmeasured parts."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from figure_json import values
from step_records import records

from amp_core.attach.monitor import SOURCE as MONITOR_SOURCE
from amp_core.runs import PROBE_RUN_PREFIX, RunInfo, SourceKind, source_kind, writer_words
from amp_core.views import plots
from amp_core.views.live import control_note, progress
from amp_core.views.summary import first_rank, lanes, rank_table, summarize


def two_ranks(steps: int = 10) -> pd.DataFrame:
    """Lanes 32-true and 16-mixed on ranks 0 and 1: rank 1 twice as slow, its loss 1.0 higher, its peak larger."""
    zero = records(steps, modes=("32-true", "16-mixed"), skipped_at=(3,))
    one = zero.copy()
    one["rank"] = 1
    one["step_ms"] = zero["step_ms"] * 2
    one["loss"] = zero["loss"] + 1.0
    one["params_bytes"] = zero["params_bytes"] * 3
    return pd.concat([zero, one], ignore_index=True)


def test_summarize_gives_a_lane_one_row_with_its_ranks_together():
    frame = two_ranks()
    summary = summarize(frame, last_k=4).set_index("mode")
    rank0 = frame[frame["rank"] == 0]
    for mode, row in summary.iterrows():
        lane0 = rank0[rank0["mode"] == mode]
        lane1 = frame[(frame["rank"] == 1) & (frame["mode"] == mode)]
        medians = [lane0["step_ms"].median(), lane1["step_ms"].median()]
        assert row["ranks"] == 2 and row["steps"] == 10
        assert row["median_ms"] == pytest.approx(np.median(medians))
        assert row["rank_imbalance"] == pytest.approx(2.0)
        assert row["final_loss"] == pytest.approx((lane0["loss"].tail(4).mean() + lane1["loss"].tail(4).mean()) / 2,
                                                  rel=1e-6)
        held1 = lane1[["params_bytes", "grads_bytes", "optim_bytes", "activations_bytes"]].sum(axis=1).max()
        assert row["peak_bytes"] == held1  # the larger rank's
    assert summary.loc["16-mixed", "skipped_steps"] == 1 and summary.loc["32-true", "skipped_steps"] == 0
    single = summarize(frame[frame["rank"] == 0])
    assert (single["ranks"] == 1).all() and single["rank_imbalance"].isna().all()


def test_rank_table_has_a_row_per_rank_against_the_fastest():
    table = rank_table(two_ranks(), last_k=4)
    assert table[["mode", "rank"]].values.tolist() == [["32-true", 0], ["32-true", 1], ["16-mixed", 0],
                                                       ["16-mixed", 1]]
    assert table["vs_fastest"].tolist() == pytest.approx([1.0, 2.0, 1.0, 2.0])
    assert table["skipped_steps"].tolist() == [0, 0, 1, 1]
    assert rank_table(records(5)).empty


def test_first_rank_keeps_each_lanes_lowest_rank_only():
    frame = two_ranks()
    assert first_rank(frame).equals(frame[frame["rank"] == 0].reset_index(drop=True))
    plain = records(5)
    assert first_rank(plain) is plain


def test_spread_is_min_median_max_across_ranks_at_each_step():
    frame = two_ranks()
    ranks = [lane for lane in lanes(frame) if lane.mode == "32-true"]
    steps, low, middle, high = plots.rank_spread(ranks, "step_ms")
    lane0 = frame[(frame["rank"] == 0) & (frame["mode"] == "32-true")]["step_ms"].to_numpy()
    assert steps.tolist() == list(range(10))
    np.testing.assert_allclose(low, lane0, rtol=1e-6)
    np.testing.assert_allclose(high, 2 * lane0, rtol=1e-6)
    np.testing.assert_allclose(middle, 1.5 * lane0, rtol=1e-6)


def test_train_figures_draw_ranks_as_a_band_and_a_bar_per_rank():
    figures = plots.train_figures(two_ranks())
    step_time = figures["step_time"].to_plotly_json()["data"]
    assert [trace["name"] for trace in step_time[:3]] == ["32-true · min of 2 ranks", "32-true · max of 2 ranks",
                                                          "32-true · median of 2 ranks"]
    assert step_time[1]["fill"] == "tonexty" and step_time[0]["showlegend"] is False
    loss = figures["loss"].to_plotly_json()["data"]
    assert [trace["name"] for trace in loss if "skipped" in trace["name"]] == ["16-mixed skipped"]
    bars = figures["ranks"].to_plotly_json()["data"]
    assert [(bar["name"], list(bar["x"])) for bar in bars] == [("32-true", ["rank 0", "rank 1"]),
                                                               ("16-mixed", ["rank 0", "rank 1"])]
    assert values(bars[0]["customdata"]).tolist() == pytest.approx([1.0, 2.0])
    assert "ranks" not in plots.train_figures(records(5))
    assert len(figures["scale"].to_plotly_json()["data"]) == 2  # rank 0's scale line and its skipped step


def stored_info(config: dict, status: str = "running", run_id: str = "r1", in_process: bool = False) -> RunInfo:
    """A run as RunReader.run_info types it (its kind and writer from its saved config, as for a stored run)."""
    kind = source_kind(run_id, config)
    return RunInfo(run_id=run_id, config=config, status=status, in_process=in_process, kind=kind,
                   writer=writer_words(kind, config, in_process), host="" if in_process else "box",
                   pid=None if in_process else 42)


def test_a_run_another_process_writes_says_why_it_has_no_controls():
    config = {"source": "monitor", "script": "train.py", "world_size": 4}
    monitor = stored_info(config)
    assert monitor.kind is SourceKind.MONITOR and monitor.attached and not monitor.controllable
    note = control_note(monitor)
    assert note.startswith("Watched live: a Monitor in `train.py`, pid 42 on box (a torchrun job of 4 ranks)")
    assert "not offered here" in note
    cli = stored_info({"workload": "digits_mlp"})
    assert cli.kind is SourceKind.RACE and not cli.attached and not cli.controllable
    assert "another AMP Lab process" in control_note(cli) and "Ctrl-C" in control_note(cli)
    here = stored_info({"workload": "digits_mlp"}, in_process=True)
    assert here.controllable and here.writer == "this process" and control_note(here) == ""
    assert control_note(stored_info(config, status="finished")) == ""
    trainer = stored_info({**config, "integration": "Hugging Face Trainer", "script": "finetune.py"})
    assert trainer.kind is SourceKind.INTEGRATION and trainer.attached
    assert trainer.writer == "the AMP Lab callback of a Hugging Face Trainer in `finetune.py`"
    assert "belong to that Hugging Face Trainer" in control_note(trainer)
    assert stored_info({"source": "monitor"}).writer == "a Monitor in a script"
    assert source_kind(f"{PROBE_RUN_PREFIX}1234", {"workload": "digits_mlp"}) is SourceKind.PROBE
    assert SourceKind.MONITOR == MONITOR_SOURCE  # what a Monitor saves as its config's source is what is read here


def test_progress_of_a_run_of_unknown_length():
    assert progress(30, 120) == (0.25, "30 / 120")
    assert progress(1300, 1200) == (1.0, "1,300 / 1,200")
    assert progress(30, 0) == (0.0, "30 steps")


def test_memory_bars_leave_out_activations_nobody_measured():
    frame = records(5, modes=("16-mixed",))
    assert "activations" in list(plots.memory_figure(frame).to_plotly_json()["data"][0]["x"])
    frame["activations_bytes"] = 0  # a Monitor's run: it does not run the user's forward
    labels = list(plots.memory_figure(frame).to_plotly_json()["data"][0]["x"])
    assert labels == ["parameters", "gradients", "optimizer state", "total held"]
