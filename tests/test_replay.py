"""Replay with real training: snapshots, the verdicts (a planted outlier batch is data, a planted fp16 overflow in
one layer is precision and names it), bit-for-bit reproduction of the recorded loss, refusals, spikes, the CLI."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from cli_process import ROOT
from replay_workloads import AmplifiedNorm
from test_monitor import fp16_loop

from amp_core.cli import main
from amp_core.config import ConfigError, FaultSpec, RunConfig
from amp_core.diagnostics.replay import ReplayError, replay_run
from amp_core.probes.faults import FaultPlan
from amp_core.probes.spikes import SpikeRule
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.views.replay import replay_frame, replay_text, spike_loss_figure, steps_to_review
from amp_core.workloads import WORKLOADS

MIXED = ("32-true", "16-mixed", "bf16-mixed")


def finished_run(manager: RunManager, config: RunConfig):
    run = manager.launch(config)
    run.join(180)
    assert not run.alive
    return run


def outlier_config(**extra) -> RunConfig:
    return RunConfig(workload="mlp_regression", modes=MIXED, steps=45, snapshot_every=10,
                     faults=(FaultSpec.parse("batch_outlier:30@40"),), **extra)


def test_batch_outlier_fault_scales_floating_tensors_only_on_its_step():
    plan = FaultPlan.for_lane((FaultSpec.parse("batch_outlier:1000@3"),), "32-true")
    inputs, labels = torch.ones(2, 3), torch.tensor([1, 2])
    assert plan.perturb_batch(2, (inputs, labels)) == (inputs, labels)
    scaled = plan.perturb_batch(3, (inputs, labels))
    assert scaled[0].max().item() == 1000.0 and scaled[1] is labels and inputs.max().item() == 1.0
    assert [step for step, _ in plan.take_fired()] == [3]
    assert FaultSpec.parse("batch_outlier:1e3@40").describe() == "batch inputs and targets x 1000 at step 40"
    with pytest.raises(ConfigError, match=r"faults\.factor"):
        FaultSpec.parse("batch_outlier:-2@4")


def test_a_planted_outlier_batch_is_judged_data_in_every_lane():
    manager = RunManager()
    run = finished_run(manager, outlier_config())
    assert run.snapshots.steps(0) == [0, 10, 20, 30, 40]
    for lane in (0, 1):  # from the 32-true lane and from the 16-mixed lane that skipped the step
        report = replay_run(manager, run.run_id, lane, 40)
        assert report.verdict.kind == "data", report.verdict.line()
        assert report.faults == ["batch inputs and targets x 30 at step 40"]
        assert "fp32 breaks too" in report.verdict.why and "planted on this step" in report.verdict.why
        reference = next(row for row in report.rows if row.mode == "32-true")
        assert reference.loss_above_band and reference.loss > 100 * report.band.median
        assert report.start_step == 40 and report.reproduced
    sixteen = next(row for row in report.rows if row.mode == "16-mixed")
    assert sixteen.skipped and not sixteen.grads_finite and sixteen.update_rel_norm == 0
    assert {row.mode for row in report.rows} == {*MIXED, "float64"}


def test_a_planted_fp16_overflow_in_one_layer_is_judged_precision_and_names_it(monkeypatch):
    workload = AmplifiedNorm()
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    manager = RunManager()
    config = RunConfig(workload=workload.name, modes=MIXED, steps=32, snapshot_every=10, lr=1e-3,
                       faults=(FaultSpec.parse("batch_outlier:1000@30"),))
    run = finished_run(manager, config)
    statuses = [lane.status for lane in run.lanes]
    assert statuses == ["finished", "diverged", "finished"], statuses  # only fp16's forward overflowed
    report = replay_run(manager, run.run_id, "16-mixed", 30)
    assert report.verdict.kind == "precision", report.verdict.line()
    sixteen = next(row for row in report.rows if row.mode == "16-mixed")
    assert sixteen.first_nonfinite == "amplify (forward)" and "65504" in sixteen.first_nonfinite_why
    assert "16-mixed" in report.verdict.why and "amplify" in report.verdict.why
    for mode in ("32-true", "bf16-mixed", "float64"):
        row = next(row for row in report.rows if row.mode == mode)
        assert math.isfinite(row.loss) and row.grads_finite and not row.loss_above_band, row
    assert report.reproduced  # the run's NaN loss came back
    bf16 = next(row for row in report.rows if row.mode == "bf16-mixed")
    assert bf16.update_cosine > 0.9 and 0.5 < bf16.update_rel_norm < 2


@pytest.mark.parametrize("mode", MIXED)
def test_a_replay_from_a_snapshot_reproduces_the_recorded_loss_bit_for_bit(mode):
    manager = RunManager()
    run = finished_run(manager, RunConfig(workload="digits_mlp", modes=MIXED, steps=30, snapshot_every=10))
    lane = MIXED.index(mode)
    recorded = run.frame().query(f"lane == {lane} and step == 27")["loss"].item()
    report = replay_run(manager, run.run_id, mode, 27)
    assert report.start_step == 20 and report.source.startswith("snapshot of step 20")
    assert report.own.loss == recorded and report.reproduced  # exact: re-trained 7 steps from the snapshot
    assert report.verdict.kind == "unclear"  # an ordinary step: nothing breaks in any mode


def test_a_step_older_than_the_oldest_snapshot_is_refused_with_the_reason():
    manager = RunManager()
    run = finished_run(manager, RunConfig(workload="mlp_regression", modes=("32-true",), steps=30,
                                          snapshot_every=5, snapshot_keep=2))
    assert run.snapshots.steps(0) == [20, 25]
    with pytest.raises(ReplayError, match=r"step 12 is older than lane 0's oldest snapshot \(step 20\): the run keeps "
                                          r"its newest 2 snapshots, one every 5 steps"):
        replay_run(manager, run.run_id, 0, 12)
    with pytest.raises(ReplayError, match="has recorded steps 0-29, not 30"):
        replay_run(manager, run.run_id, 0, 30)
    with pytest.raises(ReplayError, match="no lane '16-mixed'"):
        replay_run(manager, run.run_id, "16-mixed", 3)
    off = finished_run(manager, RunConfig(workload="mlp_regression", modes=("32-true",), steps=5, snapshot_every=0))
    with pytest.raises(ReplayError, match="keeps no snapshots"):
        replay_run(manager, off.run_id, 0, 3)


def test_an_attached_run_is_refused_saying_its_model_lives_in_its_own_process(fresh_store):
    store = open_store(fresh_store)
    monitor, _, _ = fp16_loop(store, steps=5)
    with pytest.raises(ReplayError, match="is an attached run: its model and data live in the process that wrote it"):
        replay_run(RunManager(store), monitor.run_id, 0, 3)


def test_snapshots_keep_their_time_out_of_the_timed_step_and_bounded():
    manager = RunManager()
    run = finished_run(manager, RunConfig(workload="digits_mlp", modes=("32-true",), steps=40, snapshot_every=3,
                                          snapshot_keep=4, memory_every=1000, gradstats_every=0))
    assert run.snapshots.steps(0) == [30, 33, 36, 39]
    probe = run.frame().set_index("step")["probe_ms"]
    assert (probe[[30, 33, 36, 39]] > 0).all() and (probe[[31, 32, 34, 35]] == 0).all()
    assert run.snapshots.nbytes() > 0


def test_spikes_against_the_rolling_band_and_the_steps_to_review():
    manager = RunManager()
    run = finished_run(manager, outlier_config())
    steps = run.frame()
    review = steps_to_review(steps, 1, SpikeRule())
    assert ("spike", 40) in set(zip(review["what"], review["step"], strict=True))
    assert "skipped" in set(review["what"])
    fp32 = steps_to_review(steps, 0, SpikeRule())
    assert list(fp32["step"]) == [40] and list(fp32["what"]) == ["spike"] and fp32["band ≤"].iloc[0] < 1000
    # A lane with no steps yet: its chart says so where the points would be, with no axes drawn around nothing.
    empty = spike_loss_figure(steps.iloc[0:0], 1, "16-mixed", SpikeRule()).to_dict()
    assert not empty["data"] and empty["layout"]["annotations"][0]["text"] == "no steps yet"
    assert empty["layout"]["xaxis"]["visible"] is False
    with pytest.raises(ConfigError, match=r"spikes\.k"):
        SpikeRule(k=0)
    with pytest.raises(ConfigError, match=r"spikes\.window"):
        SpikeRule(window=0)


def cli_exit_code(argv: list[str]) -> int:
    """The CLI's exit code in this process: main()'s, or argparse's SystemExit."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_cli_replay_of_a_stored_run_prints_the_table_and_the_verdict(tmp_path, capsys):
    """The run and the replay in processes of their own; the refusals (parsed and checked before any replay) through
    the same main() in this one, a torch import each spared."""
    store = tmp_path / "cli.sqlite3"
    base = [sys.executable, "-m", "amp_core", "--store", str(store)]
    made = subprocess.run([*base, "run", "--workload", "mlp_regression", "--modes", ",".join(MIXED), "--steps", "45",
                           "--fault", "batch_outlier:30@40"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    run_id = open_store(store).runs()["run_id"].iloc[0]
    proc = subprocess.run([*base, "replay", run_id, "--lane", "16-mixed", "--step", "40"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("verdict: data — ")
    assert "re-trained alone from its seed" in proc.stdout and "equals the recorded one bit for bit" in proc.stdout
    refusals = ((["--lane", "9", "--step", "40"], "error: lane: "), (["--lane", "0", "--step", "45"], "error: step"),
                (["--lane", "0", "--step", "-x"], "error: argument --step"))
    capsys.readouterr()
    for argv, why in [*(([run_id, *bad], why) for bad, why in refusals),
                      (["no-such-run", "--lane", "0", "--step", "1"], "error: run: no run 'no-such-run'")]:
        assert cli_exit_code(["--store", str(store), "replay", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(why) and len(err.strip().splitlines()) == 1, err


def test_replay_table_and_text():
    manager = RunManager()
    run = finished_run(manager, outlier_config())
    report = replay_run(manager, run.run_id, 1, 40)
    frame = replay_frame(report)
    assert list(frame["mode"]) == ["32-true ref", "▶ 16-mixed", "bf16-mixed", "float64 ref"]
    assert frame["what broke"].iloc[1] == "band · inf/NaN · skip" and frame["scale"].iloc[0] == "—"
    text = replay_text(report)
    assert text.splitlines()[-1] == report.verdict.line() and "scale" in text


LOW_BIT = ("32-true", "bf16-mixed+adamw-8bit")


@pytest.mark.parametrize("mode", LOW_BIT)
@pytest.mark.extra("recipes")
def test_a_low_bit_state_lane_replays_in_every_mode_from_a_snapshot(mode):
    manager = RunManager()
    run = finished_run(manager, RunConfig(workload="digits_mlp", modes=LOW_BIT, steps=30, snapshot_every=10,
                                          optimizer="adamw"))
    recorded = run.frame().query(f"lane == {LOW_BIT.index(mode)} and step == 27")["loss"].item()
    report = replay_run(manager, run.run_id, mode, 27)
    assert report.own.loss == recorded and report.reproduced  # the own mode keeps its own (8-bit or fp32) state
    assert {row.mode for row in report.rows} >= set(LOW_BIT)
    assert all(math.isfinite(row.loss) and row.grads_finite for row in report.rows)


@pytest.mark.extra("recipes")
def test_carrying_adam_state_between_torch_and_torchao_formats():
    from torchao.optim import AdamW8bit

    from amp_core.diagnostics.replay import carry_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Linear(128, 64)  # 8192 weights: torchao keeps them in 8 bits (a block of 256 values each)
    low = AdamW8bit(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(16, 128)).square().mean().backward()
        low.step()
        low.zero_grad()
    weight = model.weight
    assert type(low.state[weight]["exp_avg"]).__name__ == "OptimState8bit"
    plain = torch.optim.AdamW(model.parameters(), lr=5e-4)
    carry_optimizer_state(plain, low)  # 8-bit -> fp32: the values the 8-bit state stands for
    assert type(plain.state[weight]["exp_avg"]) is torch.Tensor
    assert torch.equal(plain.state[weight]["exp_avg"], low.state[weight]["exp_avg"].dequantize())
    assert isinstance(plain.param_groups[0]["lr"], float)
    assert plain.param_groups[0]["lr"] == float(torch.tensor(1e-3))  # the LR torchao stepped with (an fp32 tensor)
    again = AdamW8bit(model.parameters(), lr=5e-4)
    carry_optimizer_state(again, plain)  # fp32 -> 8-bit: quantized into torchao's own buffers, its LR a tensor
    assert type(again.state[weight]["exp_avg_sq"]).__name__ == "OptimState8bit"
    carried, values = again.state[weight]["exp_avg"].dequantize(), plain.state[weight]["exp_avg"]
    assert torch.linalg.norm(carried - values) / torch.linalg.norm(values) < 0.02  # 8 bits' own rounding
    lr = again.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and float(lr) == float(torch.tensor(1e-3))
    model(torch.randn(16, 128)).square().mean().backward()
    again.step()  # torchao takes the carried state as its own
