"""Seed replicates: lanes = modes x seeds in one interleaved run, each seed's lanes sharing weights and batches; the
across-seeds statistics and their rule; the charts' one band per mode; the Train and Compare pages with such a run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from figure_json import values
from streamlit.testing.v1 import AppTest

from amp_core.config import MAX_SEEDS, ConfigError, RunConfig
from amp_core.race.distributed import DistributedRun
from amp_core.race.runner import Run, RunManager
from amp_core.records import STEP_FIELDS
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.views import compare, plots, summary
from tests.test_runner import RecordingRun

ROOT = Path(__file__).resolve().parents[1]
MODES = ("32-true", "bf16-mixed")


def seeded(seeds: int = 3, steps: int = 6, seed: int = 0, store: RunStore | None = None,
           modes=MODES) -> RecordingRun:
    # One intra-op thread: a run of one seed and a run of three then make the very same float operations.
    run = RecordingRun(RunConfig(workload="digits_mlp", modes=modes, steps=steps, batch_size=16, seeds=seeds,
                                 seed=seed, intra_op_threads=1), store).start()
    run.join(120)
    assert run.status == "finished", [lane.error for lane in run.lanes]
    return run


# --- the config ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, MAX_SEEDS + 1, 1.5, "2", True])
def test_seeds_outside_one_to_max_are_refused(bad):
    with pytest.raises(ConfigError, match=f"seeds: must be a whole number from 1 to {MAX_SEEDS}"):
        RunConfig(seeds=bad)


def test_lanes_are_each_seeds_modes_and_the_config_round_trips():
    config = RunConfig(modes=("32-true", "16-mixed"), seed=5, seeds=2)
    assert config.lanes() == (("32-true", 5), ("16-mixed", 5), ("32-true", 6), ("16-mixed", 6))
    assert RunConfig.from_dict(config.to_dict()) == config
    old = config.to_dict()
    del old["seeds"]  # a run saved before seed replicates
    assert RunConfig.from_dict(old).seeds == 1


def test_a_torchrun_job_refuses_seed_replicates():
    with pytest.raises(ConfigError, match="seeds: seed replicates are not offered with --nproc"):
        DistributedRun(RunConfig(modes=("32-true",), seeds=2))


# --- the run -------------------------------------------------------------------------------------------------------
def test_lanes_are_modes_times_seeds_and_each_seed_shares_weights_and_batches(tmp_path):
    store = open_store(tmp_path / "runs.sqlite3")
    run = seeded(seeds=3, store=store)
    assert [(lane.mode, lane.seed) for lane in run.lanes] == [(m, s) for s in range(3) for m in MODES]
    # Interleaved step by step: every lane's step k before any lane's step k + 1.
    assert [step for _, step, _ in run.fed] == [step for step in range(6) for _ in range(6)]
    by_lane = {index: [batch for i, _, batch in run.fed if i == index] for index in range(6)}
    for seed in range(3):
        first, second = 2 * seed, 2 * seed + 1  # the two modes of this seed
        for name, weights in run.initial[first].items():
            assert torch.equal(weights, run.initial[second][name]), name
        for a, b in zip(by_lane[first], by_lane[second], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # ... and seeds differ from each other, in weights and batches.
    assert not any(torch.equal(weights, run.initial[2][name]) for name, weights in run.initial[0].items())
    assert not torch.equal(by_lane[0][0][0], by_lane[2][0][0])

    frame = run.frame()
    first_loss = frame[frame["step"] == 0].set_index("lane")["loss"]
    for seed in range(3):
        same_seed = abs(first_loss[2 * seed] - first_loss[2 * seed + 1])
        assert same_seed / first_loss[2 * seed] < 1e-3  # one model, one batch: only the mode's rounding differs
        other = first_loss[2 * ((seed + 1) % 3)]
        assert abs(first_loss[2 * seed] - other) > 100 * same_seed  # another seed: other weights, other batch

    # The seed of every lane is in its metadata, live and after a restart (a fresh manager reads the store).
    expected = [{"seed": s} for s in range(3) for _ in MODES]
    stored = RunManager(store).run_info(run.run_id).lanes
    assert [lane.meta for lane in stored] == expected
    assert [lane.mode for lane in stored] == list(MODES) * 3
    assert summary.lane_seeds(run.run_id, stored) == {f"{run.run_id}/{i}": i // 2 for i in range(6)}


def test_a_replicate_trains_exactly_as_a_run_of_its_own_seed():
    replicated = seeded(seeds=2, steps=5).frame()
    alone = seeded(seeds=1, steps=5, seed=1).frame()
    for lane, mode in enumerate(MODES):
        mine = replicated[replicated["lane"] == 2 + lane]["loss"].to_numpy()  # seed 1 is the second replicate
        theirs = alone[alone["lane"] == lane]["loss"].to_numpy()
        assert np.array_equal(mine, theirs), mode


# --- the statistics ------------------------------------------------------------------------------------------------
def constructed(final: dict[str, list[float]], step_ms: dict[str, list[float]] | None = None,
                steps: int = 30) -> tuple[pd.DataFrame, dict[str, int]]:
    """Records of one run whose lanes (mode x seed) hold a constant loss (their final loss) and step time."""
    rows, seeds, lane = [], {}, 0
    for mode, losses in final.items():
        for seed, loss in enumerate(losses):
            ms = (step_ms or {}).get(mode, [1.0] * len(losses))[seed]
            rows += [{"run_id": "r", "lane": lane, "mode": mode, "step": step, "t_wall_s": 1e9 + step, "loss": loss,
                      "step_ms": ms, "samples_per_s": 1.0, "lr": 1e-3, "scale": np.nan, "skipped": False,
                      "grad_norm": 1.0, "params_bytes": 10, "grads_bytes": 10, "optim_bytes": 20,
                      "activations_bytes": 5, "peak_above_start_bytes": None, "lane_peak_bytes": None,
                      "probe_ms": 0.0, "rank": 0} for step in range(steps)]
            seeds[f"r/{lane}"] = seed
            lane += 1
    return pd.DataFrame(rows, columns=list(STEP_FIELDS)), seeds


def verdicts(final, step_ms=None) -> dict[str, str]:
    frame, seeds = constructed(final, step_ms)
    table = summary.replicate_table(summary.lanes(frame), seeds)
    differences = summary.replicate_differences(table)
    return dict(zip(differences["figure"], differences["verdict"], strict=True))


def test_the_rule_tells_a_gap_larger_than_the_spread_from_one_within_it():
    # a: mean 1, sd 0.1; b: mean 1.5, sd 0.1, 3 seeds each: threshold 2 * sqrt(0.01/3 + 0.01/3) = 0.163.
    apart = verdicts({"32-true": [0.9, 1.0, 1.1], "bf16-mixed": [1.4, 1.5, 1.6]},
                     {"32-true": [1.0, 1.1, 0.9], "bf16-mixed": [1.0, 1.05, 0.95]})
    assert apart == {"final loss": "different", "median ms/step": "within the spread"}
    close = verdicts({"32-true": [0.9, 1.0, 1.1], "bf16-mixed": [1.0, 1.1, 1.2]},
                     {"32-true": [1.0, 1.01, 0.99], "bf16-mixed": [2.0, 2.02, 1.98]})
    assert close == {"final loss": "within the spread", "median ms/step": "different"}
    assert verdicts({"32-true": [1.0], "bf16-mixed": [5.0]}) == {"final loss": "cannot tell",
                                                                  "median ms/step": "cannot tell"}


def test_the_threshold_is_two_standard_errors_of_the_difference():
    frame, seeds = constructed({"32-true": [1.0, 2.0, 3.0], "16-mixed": [2.0, 4.0, 6.0, 8.0]})
    table = summary.replicate_table(summary.lanes(frame), seeds)
    assert table["lanes"].tolist() == [3, 4] and table["seeds"].tolist() == [[0, 1, 2], [0, 1, 2, 3]]
    assert table["final_loss_mean"].tolist() == pytest.approx([2.0, 5.0])
    assert table["final_loss_sd"].tolist() == pytest.approx([1.0, np.std([2, 4, 6, 8], ddof=1)])
    row = summary.replicate_differences(table).iloc[0]
    expected = 2 * math.sqrt(1.0 / 3 + np.var([2, 4, 6, 8], ddof=1) / 4)
    assert row["threshold"] == pytest.approx(expected) and row["difference"] == pytest.approx(3.0)
    assert expected == pytest.approx(2 * math.sqrt(2)) and row["verdict"] == "different"  # 3 > 2.83
    sentences = summary.difference_sentences(summary.replicate_differences(table))
    assert sentences[0].startswith("16-mixed vs 32-true, final loss: 5 vs 2")


def test_a_diverged_seed_leaves_the_mean_and_is_counted():
    frame, seeds = constructed({"32-true": [1.0, 1.2, 1.1], "16-mixed": [1.0, np.nan, 1.1]})
    table = summary.replicate_table(summary.lanes(frame), seeds)
    assert table["diverged"].tolist() == [0, 1] and table["final_loss_n"].tolist() == [3, 2]
    assert table["final_loss_mean"].iloc[1] == pytest.approx(1.05)


# --- the charts ----------------------------------------------------------------------------------------------------
def bands(figure) -> list[str]:
    """Names of the filled bands of a figure (dict or go.Figure)."""
    data = figure["data"] if isinstance(figure, dict) else figure.to_plotly_json()["data"]
    return [trace["name"] for trace in data if trace.get("fill") == "tonexty"]


def legend(figure) -> list[str]:
    data = figure.to_plotly_json()["data"]
    return [trace["name"] for trace in data if trace.get("showlegend", True) and trace.get("mode") == "lines"]


def test_charts_draw_one_mean_and_one_band_per_mode_not_a_line_per_seed():
    run = seeded(seeds=3, steps=8)
    series = summary.lanes(run.frame())
    seeds = {f"{run.run_id}/{lane.index}": lane.seed for lane in run.lanes}
    figures = plots.train_figures(series, seeds=seeds)
    for name in ("loss", "step_time"):
        assert bands(figures[name]) == [f"{mode} · mean of 3 seeds (min-max band)" for mode in MODES], name
        assert legend(figures[name]) == [f"{mode} · mean of 3 seeds" for mode in MODES], name
    # The mean line is the mean across seeds, the band their min and max, step by step.
    loss = figures["loss"].to_plotly_json()["data"]
    frame = run.frame()
    seed_losses = np.stack([frame[frame["lane"] == lane]["loss"].to_numpy() for lane in (0, 2, 4)])
    low, high, mean = (values(trace["y"]).astype(float) for trace in loss[:3])
    assert np.allclose(mean, seed_losses.mean(axis=0)) and np.allclose(low, seed_losses.min(axis=0))
    assert np.allclose(high, seed_losses.max(axis=0))
    assert [trace["name"] for trace in figures["memory"].to_plotly_json()["data"]] == list(MODES)
    # Without the seeds every lane is its own line (what a run of one seed per mode draws).
    assert bands(plots.loss_figure(series)) == []

    labels = {f"{run.run_id}/{lane.index}": lane.mode for lane in run.lanes}
    for figure in (compare.loss_vs_step_figure(series, labels, seeds=seeds),
                   compare.loss_vs_time_figure(series, labels, seeds=seeds),
                   compare.step_time_figure(series, labels, seeds=seeds)):
        short = compare.short_run_id(run.run_id)
        assert bands(figure) == [f"{mode} · {short} · mean of 3 seeds (min-max band)" for mode in MODES]
    assert len(bands(compare.step_time_figure(series, labels))) == 6  # p10-p90 per lane without the seeds


# --- the pages -----------------------------------------------------------------------------------------------------
def page_charts(at: AppTest) -> dict[str, dict]:
    return {chart.key: json.loads(chart.proto.spec) for chart in at.get("plotly_chart")}


def test_train_page_launches_seeds_per_mode_and_draws_a_band_per_mode():
    at = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run()
    assert not at.exception
    at.multiselect(key="train_modes").set_value(list(MODES))
    at.number_input(key="train_steps").set_value(10)
    at.number_input(key="train_seeds").set_value(2)
    at.selectbox(key="train_workload").set_value("mlp_regression")
    at.button(key="train_launch").click().run()
    from pages.common import get_manager

    (run,) = get_manager().runs()
    assert [(lane.mode, lane.seed) for lane in run.lanes] == [(m, s) for s in range(2) for m in MODES]
    run.join(120)
    at.run()
    assert not at.exception and not at.error
    (lanes,) = [frame.value for frame in at.dataframe if "progress" in frame.value.columns]
    assert lanes["lane"].tolist() == [f"{m} · seed {s}" for s in range(2) for m in MODES]
    (across,) = [frame.value for frame in at.dataframe if "seeds" in frame.value.columns]
    assert across["mode"].tolist() == list(MODES) and across["seeds"].tolist() == ["0, 1", "0, 1"]
    assert any("Welch-style" in caption.value for caption in at.caption)
    assert sum(" vs 32-true, " in text.value for text in at.markdown) == 2  # final loss and speed
    charts = page_charts(at)
    for key in ("train_chart_loss", "train_chart_step_time"):
        assert bands(charts[key]) == [f"{mode} · mean of 2 seeds (min-max band)" for mode in MODES], key


def test_compare_page_groups_a_seeded_run_by_mode(fresh_store):
    run = Run(RunConfig(workload="mlp_regression", modes=MODES, steps=10, batch_size=16, seeds=2),
              open_store(fresh_store)).start()
    run.join(120)
    at = AppTest.from_file(str(ROOT / "pages" / "compare.py"), default_timeout=60).run()
    assert not at.exception and not at.error
    labels = [at.multiselect(key="cmp_lanes").format_func(key) for key in at.multiselect(key="cmp_lanes").value]
    short = compare.short_run_id(run.run_id)
    assert labels == [f"{m} · seed {s} · {short}" for s in range(2) for m in MODES]
    (across,) = [frame.value for frame in at.dataframe if "diverged seeds" in frame.value.columns]
    assert across["mode"].tolist() == list(MODES)
    assert any("Welch-style" in caption.value for caption in at.caption)
    charts = page_charts(at)
    for key in ("cmp_chart_loss_vs_step", "cmp_chart_loss_vs_time", "cmp_chart_step_time"):
        assert bands(charts[key]) == [f"{mode} · {short} · mean of 2 seeds (min-max band)" for mode in MODES], key
    # Seed lanes are inside bands, not lines that could hide each other: no overlap note about them.
    assert not [info.value for info in at.info if "each other" in info.value]
    assert "Report · HTML" in [element.proto.label for element in at.get("download_button")]


def test_each_mode_is_told_against_the_baseline_mode_wherever_it_is():
    frame, seeds = constructed({"bf16-mixed": [1.0, 1.1], "32-true": [1.0, 1.2], "16-mixed": [3.0, 3.1]})
    differences = summary.replicate_differences(summary.replicate_table(summary.lanes(frame), seeds))
    assert set(differences["mode_a"]) == {"32-true"}
    assert differences["mode_b"].tolist() == ["bf16-mixed", "bf16-mixed", "16-mixed", "16-mixed"]
    assert differences["verdict"].tolist()[::2] == ["within the spread", "different"]  # final loss
