"""The layer bisect with real training: planted fp16 overflows (one, and two at different depths) beside
large-but-safe modules are found exactly, the fixed lane then trains with no skipped step; a slow bf16 drift is fixed
over a window; the refusals; the marker on its own; the CLI on a stored run; the fix applied to a plain loop."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bisect_workloads import OVERFLOW, SAFE, Amplify, PlantedStack
from cli_process import ROOT

from amp_core.config import ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.diagnostics.bisect import BisectConfig, KeepSetMarker, bisect_run, recorded_bisects
from amp_core.fixes import fix_code, float8_module_filter, keep_in_fp32
from amp_core.race.runner import RunManager
from amp_core.race.snapshots import ReplayError
from amp_core.records.opening import open_store
from amp_core.views.bisect import price_frame
from amp_core.workloads import WORKLOADS

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

TESTS = Path(__file__).resolve().parent


@pytest.fixture()
def planted(monkeypatch):
    workload = PlantedStack()
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    return workload


def race(manager: RunManager, size: str, modes: tuple[str, ...], steps: int = 12, **extra):
    config = RunConfig(workload="planted_stack", size=size, modes=modes, steps=steps, lr=3e-3,
                       scaler=ScalerConfig(init_scale=256.0), **{"snapshot_every": 4, **extra})
    run = manager.launch(config)
    run.join(180)
    assert not run.alive
    return run


def test_the_marker_finds_a_planted_set_in_about_k_log_n_trials_and_answers_known_sets_from_memory():
    names = [f"m{index}" for index in range(48)]
    planted = {"m7", "m40"}
    marker = KeepSetMarker(names)  # no evidence order, no hints: prefixes then ddmin
    trials = 0
    while (chosen := marker.select()) is not None:
        assert marker.remaining() >= 1
        trials += 1
        marker.step(planted <= set(chosen))
    assert sorted(marker.result) == ["m40", "m7"] and marker.remaining() == 0
    log_n = math.ceil(math.log2(len(names)))
    assert trials <= 2 * len(planted) * log_n + log_n, trials  # prefixes, then about 2 log2 n per planted module
    hinted = KeepSetMarker(["m7", *[n for n in names if n != "m7"]])
    seen = []
    while (chosen := hinted.select()) is not None:
        seen.append(chosen)
        hinted.step(planted <= set(chosen), "m40" if chosen == ("m7",) else "")
    assert seen == [("m7",), ("m7", "m40"), ("m40",)] and sorted(hinted.result) == ["m40", "m7"]
    with pytest.raises(RuntimeError, match="nothing was selected"):
        hinted.step(True)


@pytest.mark.parametrize(("size", "expected"), [("small", ["blocks.3.middle"]),
                                                ("medium", ["blocks.1.middle", "blocks.6.middle"])])
def test_planted_fp16_overflows_are_found_exactly_and_the_fixed_lane_trains(planted, size, expected):
    manager = RunManager()
    run = race(manager, size, ("32-true", "16-mixed"))
    assert run.lanes[1].status == "diverged"
    report = bisect_run(manager, run.run_id, "16-mixed", record=True)
    assert report.verdict == "fixed" and report.kept == expected and report.minimal, report.trials
    # Every safe module (x300) is a candidate beside them, and stays out.
    assert report.candidates == 33 and len(report.trials) <= 2 + 2 * len(expected) + 1
    assert [trial.passed for trial in report.trials[:2]] == [False, True]
    assert report.fixed_recipe == "16-mixed+" + "+".join(f"keep:{name}" for name in expected)
    line = report.price_line()
    assert line.startswith(f"keeping {len(expected)} of 33 modules in fp32 fixes it and ") and "(measured)" in line
    rows = {row.recipe: row for row in report.price}
    assert set(rows) == {"16-mixed", report.fixed_recipe, "32-true"}
    assert rows[report.fixed_recipe].skipped == 0 and math.isfinite(rows[report.fixed_recipe].loss)
    assert not math.isfinite(rows["16-mixed"].loss) and rows["16-mixed"].ms_per_step > 0
    assert recorded_bisects(manager.events(run.run_id), 1)[0].kept == expected
    fixed = race(manager, size, ("16-mixed", report.fixed_recipe), steps=10)
    frame = fixed.frame()
    mine = frame[frame["mode"] == report.fixed_recipe]
    assert fixed.lanes[1].status == "finished" and not mine["skipped"].fillna(False).any()
    assert mine["loss"].map(math.isfinite).all()


def test_a_slow_bf16_drift_is_found_over_a_window_and_fixed(planted):
    manager = RunManager()
    run = race(manager, "large", ("32-true", "bf16-mixed"), steps=20, snapshot_every=25)
    report = bisect_run(manager, run.run_id, "bf16-mixed")
    assert report.last_step > report.first_step  # a window, found from the records against the 32-true lane
    assert "above the fp32 band" in report.trials[0].outcome
    assert report.verdict == "fixed" and report.kept == ["blocks.2.middle"], report.trials
    assert "output error" in report.evidence["blocks.2.middle"]


def test_what_cannot_be_bisected_says_why(planted):
    manager = RunManager()
    run = race(manager, "medium", ("32-true", "16-mixed", "bf16-mixed"))
    with pytest.raises(ReplayError, match=r"lane 0 is 32-true: it computes in fp32"):
        bisect_run(manager, run.run_id, 0)
    with pytest.raises(ReplayError, match=r"lane 2 \(bf16-mixed\) did not fail: .*name --step S or --window A:B"):
        bisect_run(manager, run.run_id, "bf16-mixed")
    with pytest.raises(ReplayError, match=r"lane 1 \(16-mixed\) has recorded steps 0-0; step 5 is out of them"):
        bisect_run(manager, run.run_id, 1, step=5)  # a diverged lane stops
    with pytest.raises(ConfigError, match=r"window: write A:B"):
        bisect_run(manager, run.run_id, 1, window="5")
    with pytest.raises(ConfigError, match=r"budget: must be a whole number >= 3"):
        BisectConfig(budget=2)
    spent = bisect_run(manager, run.run_id, 1, check=BisectConfig(budget=3))
    assert spent.verdict == "fixed" and not spent.minimal and len(spent.kept) == 33
    assert "budget (3) ran out" in spent.notes[0] and "perhaps not the smallest" in spent.notes[0]
    late = race(manager, "small", ("16-mixed",), snapshot_every=0)
    with pytest.raises(ReplayError, match=r"no snapshot of lane 0 at or before step 0"):
        bisect_run(manager, late.run_id, 0)
    data = race(manager, "large", ("32-true", "bf16-mixed"), faults=(FaultSpec.parse("batch_outlier:1e38@6"),))
    report = bisect_run(manager, data.run_id, "bf16-mixed")
    assert report.verdict == "data" and report.kept == [] and "fp32 too" in report.why, report.why


def test_cli_bisect_of_a_stored_run_prints_the_trials_the_fix_and_the_price_line_last(tmp_path, planted):
    store = tmp_path / "cli.sqlite3"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    base = [sys.executable, "-m", "amp_core", "--store", str(store)]
    plugin = ["--workload-module", "bisect_workloads"]
    made = subprocess.run([*base, "run", *plugin, "--workload", "planted_stack", "--size", "small", "--modes",
                           "32-true,16-mixed", "--steps", "6", "--init-scale", "256"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    run_id = open_store(store).runs()["run_id"].iloc[0]
    proc = subprocess.run([*base, "bisect", run_id, *plugin, "--lane", "16-mixed"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("keeping 1 of 33 modules in fp32 fixes it and ")
    assert "re-trained alone from its seed" in proc.stdout and "set: blocks.3.middle" in proc.stdout
    assert "keep_in_fp32(model, KEEP)" in proc.stdout and "KEEP = ['blocks.3.middle']" in proc.stdout
    events = open_store(store).events(run_id)
    assert (events["kind"] == "bisected").sum() == 1
    # The stored report's price table (what the pages draw): the failing lane's NaN loss, stored as JSON null, reads
    # as what it is, the others as numbers.
    stored = recorded_bisects(events)[0]
    assert math.isnan({row.recipe: row.loss for row in stored.price}["16-mixed"])
    losses = dict(zip(*price_frame(stored).loc[:, ["lane", "loss"]].T.values, strict=True))
    assert losses["16-mixed"] == "inf/NaN" and math.isfinite(float(losses["32-true"])), losses
    proc = subprocess.run([*base, "bisect", run_id, *plugin, "--lane", "32-true"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: lane: lane 0 is 32-true"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_fix_removes_a_planted_overflow_from_a_plain_loop_outside_amp_lab():
    def train(fix: bool) -> tuple[list[float], int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), Amplify(SAFE), torch.nn.Linear(32, 32),
                                    Amplify(OVERFLOW), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        if fix:
            assert keep_in_fp32(model, ["3"]) == ["3"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        losses, skipped = [], 0
        for _ in range(6):
            inputs, targets = torch.randn(8, 16), torch.randint(0, 4, (8,))
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(inputs).float(), targets)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
            losses.append(float(loss.detach()))
        return losses, skipped

    broken, broken_skips = train(fix=False)
    fixed, fixed_skips = train(fix=True)
    assert not any(map(math.isfinite, broken)) and broken_skips == 6
    assert all(map(math.isfinite, fixed)) and fixed_skips == 0
    with pytest.raises(ValueError, match=r"\+keep:lm_head matches no module"):
        keep_in_fp32(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["lm_head"])


def test_the_float8_filter_leaves_kept_modules_plain_and_the_code_says_how():
    pytest.importorskip("torchao")
    from torchao.float8 import convert_to_float8_training

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Sequential(torch.nn.Linear(32, 32)))
    converted = convert_to_float8_training(model, module_filter_fn=float8_module_filter(["1"]))
    assert type(converted[0]).__name__ == "Float8Linear" and type(converted[1][0]) is torch.nn.Linear
    code = fix_code(["1"], "bf16-mixed+fp8-rowwise")
    assert "float8_module_filter(KEEP)" in code and "class KeepInFp32(Callback)" in code
    compile(code.replace("...", "None"), "fix", "exec")
