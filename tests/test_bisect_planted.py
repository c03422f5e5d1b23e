"""Kept modules and the bisect on the issue's residual MLP (tests/bisect_workloads.ResidualPlanted): blocks whose
Boost's own output leaves fp16's range (scaled back by plain code after it) beside one large-but-safe decoy. A kept
module's fp32 output must reach that code as it is (PyTorch's autocast idiom): kept so, the lane trains; kept with a
cast back to fp16, it does not. The bisect finds exactly the planted set, checks it is 1-minimal, stays within
2·k·log2(n)+4 trials, prints a fix that trains in a plain autocast + GradScaler loop, and never prints as a fix a set
that fails its price race."""

from __future__ import annotations

import math

import pytest
import torch
from bisect_workloads import ResidualPlanted, planted_names

from amp_core import cli, precision
from amp_core.config import RunConfig, ScalerConfig
from amp_core.diagnostics.bisect import bisect_run
from amp_core.fixes import keep_in_fp32
from amp_core.precision import get_precision, keep_output_note
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.views.bisect import bisect_text
from amp_core.workloads import WORKLOADS

pytestmark = pytest.mark.slow  # about a minute on two cores: scheduled first (tests/conftest.py)

STEPS = 60


@pytest.fixture()
def planted(monkeypatch):
    workload = ResidualPlanted()
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    return workload


def race(manager: RunManager, size: str, modes: tuple[str, ...], steps: int = 8, **extra):
    config = RunConfig(workload="residual_planted", size=size, modes=modes, steps=steps, lr=3e-3,
                       scaler=ScalerConfig(init_scale=256.0), snapshot_every=4, **extra)
    run = manager.launch(config)
    run.join(180)
    assert not run.alive
    return run


def after_warmup(frame, mode: str):
    """The lane's rows from its first applied step on (the GradScaler's warm-up skips come before it)."""
    mine = frame[frame["mode"] == mode].sort_values("step")
    applied = mine[~mine["skipped"].fillna(False).astype(bool)]
    assert len(applied), f"{mode} applied no step"
    return mine[mine["step"] >= applied["step"].iloc[0]]


def plain_loop(model: torch.nn.Module, workload: ResidualPlanted, steps: int = STEPS) -> tuple[list[float], int]:
    """The user's own loop: torch.autocast(fp16) + GradScaler; (losses, steps skipped after the first applied one)."""
    data = workload.load_data(RunConfig(workload=workload.name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    generator = torch.Generator().manual_seed(0)
    losses, skipped, applied = [], 0, False
    for _ in range(steps):
        index = torch.randint(0, len(data.inputs), (32,), generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = workload.loss(model(data.inputs[index]), data.targets[index])
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skip = scaler.get_scale() < before
        skipped += skip and applied
        applied = applied or not skip
        losses.append(float(loss.detach()))
    return losses, skipped


@pytest.mark.parametrize(("mode", "handed_on"), [("16-mixed", torch.float32), ("bf16-mixed", torch.float32),
                                                 ("16-true", torch.float16), ("bf16-true", torch.bfloat16)])
def test_a_kept_modules_output_stays_fp32_in_mixed_modes_and_is_cast_back_in_true_ones(planted, mode, handed_on):
    precision = get_precision(f"{mode}+keep:blocks.3.boost")
    model = precision.prepare_module(planted.build_model("small", None))
    seen = {}
    model.blocks[3].boost.register_forward_hook(lambda module, args, output: seen.update(out=output.dtype))
    model.blocks[3].fc.register_forward_hook(lambda module, args, output: seen.update(fc=output.dtype))
    with precision.forward_context():
        model(precision.prepare_input(torch.randn(4, 32)))
    assert seen["out"] == handed_on
    assert seen["fc"] == (torch.float16 if mode.startswith("16") else torch.bfloat16)  # the rest stays 16-bit
    note = keep_output_note(mode)
    assert ("stays fp32" in note) == (mode.endswith("mixed")) and ("consumes it kept too" in note) == \
        mode.endswith("true")


def test_kept_with_its_fp32_output_the_lane_trains_kept_with_a_cast_back_it_does_not(planted):
    manager = RunManager()
    run = race(manager, "small", ("16-mixed", "16-mixed+keep:blocks.3.boost"), steps=STEPS)
    frame = run.frame()
    assert run.lanes[0].status == "diverged"
    fixed = after_warmup(frame, "16-mixed+keep:blocks.3.boost")
    assert run.lanes[1].status == "finished" and frame[frame["lane"] == 1]["step"].max() == STEPS - 1
    assert fixed["loss"].map(math.isfinite).all() and not fixed["skipped"].fillna(False).any()
    # The same module kept in the same loop, its output cast back to fp16 at its boundary (the old behaviour): inf.
    torch.manual_seed(0)
    kept = planted.build_model("small", None)
    keep_in_fp32(kept, ["blocks.3.boost"])
    losses, skipped = plain_loop(kept, planted)
    assert all(map(math.isfinite, losses)) and skipped == 0
    torch.manual_seed(0)
    cast_back = planted.build_model("small", None)
    precision.keep_in_fp32(cast_back, ["blocks.3.boost"], restore_dtype=torch.float16)
    losses, _ = plain_loop(cast_back, planted, steps=6)
    assert not any(map(math.isfinite, losses))


@pytest.mark.parametrize("size", ["small", "medium", "large"])
def test_the_bisect_finds_exactly_the_planted_set_checks_it_and_its_printed_fix_trains_a_plain_loop(planted, size):
    manager = RunManager()
    run = race(manager, size, ("32-true", "16-mixed"))
    report = bisect_run(manager, run.run_id, "16-mixed")
    expected = planted_names(size)
    assert report.verdict == "fixed" and report.kept == expected and report.minimal, report.trials
    decoy = f"blocks.{planted.sizes[size]['decoy']}.boost"
    assert decoy not in report.kept and report.candidates == 42
    bound = 2 * len(expected) * math.log2(report.candidates) + 4
    assert len(report.trials) <= bound, (len(report.trials), bound)
    # 1-minimal, and the report shows it: without each member the step fails again.
    assert list(report.without) == expected and all("loss" in why for why in report.without.values())
    text = bisect_text(report)
    for name in expected:
        assert f"1-minimal: without {name}: step 0: loss" in text
    assert "keep: in 16-mixed a kept module's output stays fp32" in text
    # The printed fix, pasted into the user's plain autocast + GradScaler loop, trains clean; without it, inf.
    code = text[text.index("# Keep "):text.index("# Hugging Face")]
    torch.manual_seed(0)
    model = planted.build_model(size, None)
    exec(compile(code, "printed fix", "exec"), {"model": model})
    losses, skipped = plain_loop(model, planted)
    assert all(map(math.isfinite, losses)) and skipped == 0, (losses, skipped)
    torch.manual_seed(0)
    losses, _ = plain_loop(planted.build_model(size, None), planted, steps=4)
    assert not any(map(math.isfinite, losses))


def test_a_set_that_fails_its_price_race_is_not_printed_as_a_fix_and_a_lane_that_never_failed_exits_2(planted,
                                                                                                   capsys, tmp_path):
    store = tmp_path / "bisect.sqlite3"
    manager = RunManager(open_store(store))
    run = race(manager, "xl", ("32-true", "16-mixed"))
    report = bisect_run(manager, run.run_id, "16-mixed", record=True)
    assert report.kept == ["blocks.3.boost"] and report.verdict == "not-fixed", report.why
    assert "passes the bisected step but not the price race" in report.why
    fixed = next(row for row in report.price if row.recipe == "16-mixed+keep:blocks.3.boost")
    assert fixed.failure.startswith("step ") and "loss" in fixed.failure
    text = bisect_text(report)
    assert "set:" not in text and "keep_in_fp32" not in text and text.splitlines()[-1] == report.why
    assert report.price_line() == report.why
    # A lane that never failed: one line, exit 2.
    code = cli.main(["--store", str(store), "bisect", run.run_id, "--lane", "32-true"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "computes in fp32" in err
    clean = race(manager, "small", ("32-true", "bf16-mixed"))
    code = cli.main(["--store", str(store), "bisect", clean.run_id, "--lane", "bf16-mixed"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "did not fail" in err, err


def test_in_a_true_mode_the_report_says_kept_outputs_are_cast_back_and_keeping_the_consumer_fixes_it(planted):
    manager = RunManager()  # SGD: Adam's fp16 states break a 16-true lane by themselves after a step
    run = race(manager, "small", ("32-true", "16-true"), optimizer="sgd")
    report = bisect_run(manager, run.run_id, "16-true")
    # Every leaf kept, each output is cast back to fp16 at its boundary: the boost's is inf there, whatever is kept.
    assert report.verdict == "not-fixed" and [trial.passed for trial in report.trials] == [False, False]
    assert "in 16-true a kept module's output is cast back to fp16" in report.why
    assert "consumes it kept too" in report.why and "keep that container" in report.why
    # The container whose forward scales the boost's output back, kept: the lane trains.
    fixed = race(manager, "small", ("16-true+keep:blocks.3",), steps=20, optimizer="sgd")
    frame = fixed.frame()
    assert fixed.lanes[0].status == "finished" and frame["loss"].map(math.isfinite).all()
