"""The Hugging Face Trainer and Lightning callbacks on the real trainers (tiny random-init models, CPU), each in a
process of its own followed live by a RunManager and the Train page: one record per optimizer step with the loss the
trainer computed, and the precision that really ran (fp16 asked and not applied; fp16 without loss scaling)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.records.schema import FP16_WITHOUT_SCALING, PRECISION_NOT_APPLIED, WHAT_RAN_EVENTS
from amp_core.runs import SourceKind
from amp_core.views.live import RecordFollower
from amp_core.views.numerics import amax_samples
from amp_core.views.report import run_report_html

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "trainer_script.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
"""The trainers' processes: no speed is checked here, so OpenMP's idle threads sleep, as in the whole suite
(tests/child_env.py)."""


def start(store: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), *args, "--store", str(store)], cwd=ROOT, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def said(proc: subprocess.Popen) -> dict:
    """The script's next line of its own (trainers print other lines too)."""
    while line := proc.stdout.readline():
        if line.startswith("AMPLAB "):
            return json.loads(line.removeprefix("AMPLAB "))
    raise AssertionError(f"the script ended early: {proc.stderr.read()[-3000:]}")


def go_on(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()


def follow_live(store: Path, trainer_args: tuple[str, ...], integration: str, pause_at: int, steps: int):
    """Run the script, check at its pause that a RunManager and the Train page follow it live, let it finish; returns
    (its last line, the manager, the lane's series)."""
    proc = start(store, *trainer_args, "--steps", str(steps), "--pause-at", str(pause_at))
    try:
        paused = said(proc)
        manager = RunManager(open_store(store))
        follower = RecordFollower(paused["run_id"])
        (lane,) = follower.update(manager)
        assert lane.stats.records == pause_at + 1 and proc.poll() is None  # recorded so far; still going
        info = manager.run_info(paused["run_id"])
        assert info.status == "running" and info.config["integration"] == integration
        assert info.kind is SourceKind.INTEGRATION and info.attached and not info.controllable
        assert info.writer.startswith(f"the AMP Lab callback of a {integration} in ")

        page = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run()
        assert not page.exception
        notes = " ".join(caption.value for caption in page.caption)
        assert f"the AMP Lab callback of a {integration} in `trainer_script.py`" in notes
        assert "not offered here" in notes
        assert not [b for b in page.button if b.key in ("train_pause", "train_stop")]
        go_on(proc)
        last = said(proc)
        assert proc.wait(120) == 0, proc.stderr.read()[-3000:]
    finally:
        proc.kill()
    (lane,) = follower.update(manager)
    assert lane.stats.records == steps
    assert manager.run_info(last["run_id"]).status == "finished"
    return last, manager, lane


def what_ran(manager: RunManager, run_id: str) -> dict[str, str]:
    events = manager.events(run_id)
    return dict(zip(events["kind"], events["message"], strict=True))


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers", reason="the `hf` extra (pip install -e .[hf]) is not installed")


@pytest.fixture
def lightning():
    return pytest.importorskip("lightning", reason="the `lightning` extra (pip install -e .[lightning]) is not "
                                                   "installed")


def test_hf_trainer_followed_live_one_record_per_optimizer_step_with_the_loss_it_logged(fresh_store, transformers):
    last, manager, _ = follow_live(fresh_store, ("hf", "--accumulate", "2"), "Hugging Face Trainer", 2, 6)
    frame = manager.steps(last["run_id"])
    assert frame["step"].tolist() == list(range(6))  # six optimizer steps of two micro-batches each
    assert frame["loss"].tolist() == pytest.approx(last["losses"], rel=1e-6)  # what the Trainer logged
    assert frame["lr"].iloc[0] == pytest.approx(3e-3) and frame["lr"].is_monotonic_decreasing  # its linear decay
    assert frame["samples_per_s"].notna().all() and frame["grad_norm"].notna().iloc[0]
    assert last["mode"] == "32-true" and PRECISION_NOT_APPLIED not in what_ran(manager, last["run_id"])


def test_hf_fp16_on_a_cpu_is_recorded_as_the_fp32_that_ran_and_says_so(fresh_store, transformers):
    proc = start(fresh_store, "hf", "--fp16", "--steps", "3")
    last = said(proc)
    assert proc.wait(120) == 0
    manager = RunManager(open_store(fresh_store))
    assert last["mode"] == "32-true" and manager.run_info(last["run_id"]).lanes[0].mode == "32-true"
    message = what_ran(manager, last["run_id"])[PRECISION_NOT_APPLIED]
    assert message.startswith("fp16 asked (16-mixed), not applied: the ops ran in fp32")
    assert message in run_report_html(manager, last["run_id"])

    page = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run()
    assert not page.exception
    assert any("fp16 asked (16-mixed), not applied" in warning.value for warning in page.warning)


def test_hf_bf16_is_recorded_as_bf16_mixed_with_no_warning(fresh_store, transformers):
    proc = start(fresh_store, "hf", "--bf16", "--steps", "2")
    last = said(proc)
    assert proc.wait(120) == 0
    manager = RunManager(open_store(fresh_store))
    assert last["mode"] == "bf16-mixed"
    assert not set(what_ran(manager, last["run_id"])) & set(WHAT_RAN_EVENTS)
    samples = amax_samples(manager.events(last["run_id"]))  # layer diagnostics: step 0 is sampled by default
    assert samples["step"].unique().tolist() == [0] and "transformer.h.0.attn.c_attn" in samples["module"].tolist()


def test_lightning_followed_live_one_record_per_optimizer_step(fresh_store, lightning):
    last, manager, _ = follow_live(fresh_store, ("lightning", "--accumulate", "2"), "Lightning", 3, 6)
    frame = manager.steps(last["run_id"])
    losses = last["losses"]  # each batch's loss; a step's record holds the mean of its two batches
    assert frame["loss"].tolist() == pytest.approx([(a + b) / 2 for a, b in zip(losses[::2], losses[1::2],
                                                                                strict=True)], rel=1e-5)
    assert last["mode"] == "32-true" and not set(what_ran(manager, last["run_id"])) & set(WHAT_RAN_EVENTS)


def test_lightning_fp16_true_says_it_runs_without_loss_scaling(fresh_store, lightning):
    proc = start(fresh_store, "lightning", "--precision", "16-true", "--steps", "2")
    last = said(proc)
    assert proc.wait(120) == 0
    manager = RunManager(open_store(fresh_store))
    assert last["mode"] == "16-true"
    message = what_ran(manager, last["run_id"])[FP16_WITHOUT_SCALING]
    assert "without loss scaling" in message and message in run_report_html(manager, last["run_id"])


def test_lightning_16_mixed_on_a_cpu_is_recorded_as_the_bf16_mixed_lightning_ran(fresh_store, lightning):
    proc = start(fresh_store, "lightning", "--precision", "16-mixed", "--steps", "2")
    last = said(proc)
    assert proc.wait(120) == 0
    assert last["mode"] == "bf16-mixed"  # Lightning 2.6 swaps it (with a warning) before any callback sees it


@pytest.mark.parametrize(("example", "args", "extra"), [
    ("hf_trainer.py", ("--steps", "4", "--logging-steps", "1"), "transformers"),
    ("lightning_module.py", ("--steps", "6", "--precision", "bf16-mixed"), "lightning")])
def test_the_trainer_examples_run_and_finish(fresh_store, example, args, extra):
    pytest.importorskip(extra, reason=f"the `{'hf' if extra == 'transformers' else extra}` extra is not installed")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--store", str(fresh_store), *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = open_store(fresh_store)
    (run_id,) = store.runs()["run_id"]
    run = store.run(run_id)
    steps = int(args[1])
    assert run["status"] == "finished" and len(store.steps(run_id)) == steps
    assert f"run {run_id}: {steps} steps ({run['modes'][0]})" in proc.stdout
