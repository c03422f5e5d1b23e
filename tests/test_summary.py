"""summarize() on hand-made records (every figure computed by hand below) and on real CPU runs."""

import math

import pandas as pd
import pytest

from amp_core.config import RunConfig
from amp_core.precision import MODES, availability
from amp_core.race.runner import Run
from amp_core.records import STEP_FIELDS
from amp_core.views.summary import SUMMARY_COLUMNS, default_baseline, lane_key, peak_bytes, summarize

CPU_MODES = [mode for mode in MODES if availability(mode, "cpu")[0]]


def lane_records(run_id, lane, mode, step_ms, losses, *, params, grads, optim, activations, skipped=None,
                 lane_peak=None):
    """One lane's step records; memory figures are per-step lists or one number for every step."""
    n = len(step_ms)

    def per_step(value):
        return list(value) if isinstance(value, list) else [value] * n

    return pd.DataFrame({
        "run_id": run_id, "lane": lane, "mode": mode, "step": range(n), "t_wall_s": [1000.0 + i for i in range(n)],
        "loss": losses, "step_ms": step_ms, "samples_per_s": 1.0, "lr": 1e-3,
        "scale": 65536.0 if mode == "16-mixed" else None, "skipped": skipped or [False] * n, "grad_norm": 1.0,
        "params_bytes": per_step(params), "grads_bytes": per_step(grads), "optim_bytes": per_step(optim),
        "activations_bytes": per_step(activations), "peak_above_start_bytes": None,
        "lane_peak_bytes": per_step(lane_peak), "probe_ms": 0.0,
    }, columns=list(STEP_FIELDS))


def interleave(*lanes: pd.DataFrame) -> pd.DataFrame:
    """Rows in runner order: step 0 of every lane, then step 1, ..."""
    return pd.concat(lanes, ignore_index=True).sort_values(["step", "run_id", "lane"], kind="stable",
                                                           ignore_index=True)


# Run "r1": lane 0 in fp32, lane 1 in 16-mixed (records without a lane peak). Run "r2": one bf16-true lane
# reporting its own peak.
FP32 = lane_records("r1", 0, "32-true", [12.0, 10.0, 10.0, 40.0], [4.0, 3.0, 2.0, 1.0],
                    params=1000, grads=1000, optim=[0, 2000, 2000, 2000], activations=[600, 500, 500, 500])
# median ms 11; held bytes per step: 2600, 4500, 4500, 4500 -> peak 4500; final loss (k=2): (2 + 1) / 2 = 1.5
FP16 = lane_records("r1", 1, "16-mixed", [6.0, 5.0, 5.0, 30.0], [4.0, math.inf, 2.5, 1.5],
                    params=500, grads=500, optim=[0, 2000, 2000, 2000], activations=250,
                    skipped=[False, True, False, False])
# median 5.5 -> speedup 11 / 5.5 = 2; peak 3250 -> ratio 3250 / 4500; final (2.5 + 1.5) / 2 = 2 -> delta +0.5;
# one skipped step; its inf loss was transient, so it did not diverge.
BF16 = lane_records("r2", 0, "bf16-true", [8.0, 8.0, 8.0], [3.0, math.nan, math.nan],
                    params=100, grads=100, optim=0, activations=100, lane_peak=[9000, 8000, 7000])
# median 8 -> speedup 11 / 8; lane peak 9000 -> ratio 2; the last two losses are NaN: final loss NaN, diverged.


def by_key(summary: pd.DataFrame) -> dict[str, dict]:
    return {lane_key(row["run_id"], row["lane"]): row for row in summary.to_dict("records")}


def test_hand_computed_figures_against_the_default_baseline():
    frame = pd.concat([BF16, interleave(FP32, FP16)], ignore_index=True)  # a non-fp32 lane comes first
    assert default_baseline(frame) == "r1/0"
    summary = summarize(frame, last_k=2)
    assert list(summary.columns) == list(SUMMARY_COLUMNS)
    assert [(r, n) for r, n in zip(summary["run_id"], summary["lane"], strict=True)] == [("r2", 0), ("r1", 0),
                                                                                         ("r1", 1)]
    rows = by_key(summary)
    fp32, fp16, bf16 = rows["r1/0"], rows["r1/1"], rows["r2/0"]

    assert (fp32["median_ms"], fp32["speedup"], fp32["mem_ratio"], fp32["loss_delta"]) == (11.0, 1.0, 1.0, 0.0)
    assert fp32["peak_bytes"] == 4500 and fp32["peak_mib"] == pytest.approx(4500 / 2**20)
    assert fp32["final_loss"] == 1.5

    assert fp16["median_ms"] == 5.5 and fp16["speedup"] == pytest.approx(2.0)
    assert fp16["peak_bytes"] == 3250 and fp16["mem_ratio"] == pytest.approx(3250 / 4500)
    assert fp16["final_loss"] == pytest.approx(2.0) and fp16["loss_delta"] == pytest.approx(0.5)
    assert (fp16["skipped_steps"], fp16["diverged"], fp16["steps"]) == (1, False, 4)

    assert bf16["speedup"] == pytest.approx(11 / 8)
    assert bf16["peak_bytes"] == 9000 and bf16["mem_ratio"] == pytest.approx(2.0)
    assert math.isnan(bf16["final_loss"]) and math.isnan(bf16["loss_delta"])
    assert (bf16["skipped_steps"], bf16["diverged"], bf16["steps"]) == (0, True, 3)


def test_an_explicit_baseline_turns_the_ratios_around():
    rows = by_key(summarize(interleave(FP32, FP16), baseline="r1/1", last_k=2))
    assert rows["r1/0"]["speedup"] == pytest.approx(5.5 / 11)
    assert rows["r1/0"]["mem_ratio"] == pytest.approx(4500 / 3250)
    assert rows["r1/0"]["loss_delta"] == pytest.approx(-0.5)
    assert (rows["r1/1"]["speedup"], rows["r1/1"]["mem_ratio"], rows["r1/1"]["loss_delta"]) == (1.0, 1.0, 0.0)


@pytest.mark.parametrize(("last_k", "fp32_final", "fp16_final"), [
    (1, 1.0, 1.5),
    (3, 2.0, 2.0),  # fp16: the inf is left out of (inf, 2.5, 1.5)
    (100, 2.5, (4.0 + 2.5 + 1.5) / 3),  # a window longer than the lane takes every step
])
def test_final_loss_is_the_mean_of_the_last_k_finite_losses(last_k, fp32_final, fp16_final):
    rows = by_key(summarize(interleave(FP32, FP16), last_k=last_k))
    assert rows["r1/0"]["final_loss"] == pytest.approx(fp32_final)
    assert rows["r1/1"]["final_loss"] == pytest.approx(fp16_final)
    assert rows["r1/1"]["loss_delta"] == pytest.approx(fp16_final - fp32_final)


def test_a_lane_ending_on_inf_diverged_and_keeps_a_non_finite_final_loss():
    ended_inf = lane_records("r3", 0, "16-true", [5.0, 5.0], [2.0, math.inf], params=1, grads=1, optim=0,
                             activations=0)
    (row,) = summarize(ended_inf, last_k=1).to_dict("records")
    assert row["diverged"] is True and row["final_loss"] == math.inf
    (row,) = summarize(ended_inf, last_k=2).to_dict("records")
    assert row["diverged"] is True and row["final_loss"] == 2.0


def test_without_an_fp32_lane_the_first_lane_is_the_baseline():
    frame = pd.concat([BF16, FP16], ignore_index=True)
    assert default_baseline(frame) == "r2/0"
    rows = by_key(summarize(frame))
    assert rows["r2/0"]["speedup"] == 1.0 and rows["r1/1"]["speedup"] == pytest.approx(8 / 5.5)


def test_peak_bytes_prefers_the_lane_peak_and_falls_back_row_by_row():
    frame = pd.concat([FP32.iloc[:2], BF16.iloc[:1]], ignore_index=True)
    assert peak_bytes(frame).tolist() == [2600.0, 4500.0, 9000.0]


def test_empty_records_give_an_empty_summary_with_every_column():
    empty = pd.DataFrame({name: [] for name in STEP_FIELDS})
    summary = summarize(empty)
    assert summary.empty and list(summary.columns) == list(SUMMARY_COLUMNS)
    assert default_baseline(empty) is None


def test_refuses_a_baseline_that_is_not_among_the_lanes():
    with pytest.raises(ValueError, match=r"baseline lane 'r9/0' has no records here; lanes: r1/0, r1/1"):
        summarize(interleave(FP32, FP16), baseline="r9/0")


@pytest.mark.parametrize("last_k", [0, -3])
def test_refuses_a_final_loss_window_under_one(last_k):
    with pytest.raises(ValueError, match="last_k must be at least 1"):
        summarize(interleave(FP32, FP16), last_k=last_k)


@pytest.mark.parametrize("mode", [mode for mode in CPU_MODES if mode != "32-true"])
def test_real_run_against_fp32(mode):
    """A real two-lane CPU run: the fp32 baseline is 1x of itself, and every figure is the records' own."""
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true", mode), steps=6, batch_size=16)).start()
    run.join()
    frame = run.frame()
    rows = by_key(summarize(frame, last_k=3))
    fp32, other = rows[f"{run.run_id}/0"], rows[f"{run.run_id}/1"]
    assert (fp32["speedup"], fp32["mem_ratio"], fp32["loss_delta"]) == (1.0, 1.0, 0.0)
    lane = frame[frame["lane"] == 1]
    held = lane[["params_bytes", "grads_bytes", "optim_bytes", "activations_bytes"]].sum(axis=1).max()
    assert fp32["steps"] == 6 and other["steps"] == len(lane) and other["mode"] == mode
    assert other["speedup"] == pytest.approx(fp32["median_ms"] / lane["step_ms"].median())
    assert other["mem_ratio"] == pytest.approx(held / fp32["peak_bytes"])
    assert other["skipped_steps"] == int(lane["skipped"].sum())
    # A lane the runner stopped as diverged (fp16 weights can overflow here) ended on a non-finite loss.
    assert other["diverged"] == (run.lanes[1].status == "diverged")
    if not other["diverged"]:
        assert other["loss_delta"] == pytest.approx(lane["loss"].astype(float).tail(3).mean() - fp32["final_loss"])
    if mode in ("bf16-true", "16-true"):  # half-size parameters and gradients
        assert other["mem_ratio"] < 1
