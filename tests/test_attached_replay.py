"""Replays in attach mode, with real training in processes of their own: a Monitor's loop with a planted fp16
overflow in one layer records a replay judged precision that names the layer, a planted outlier batch one judged
data; a model above replay="auto"'s limit keeps nothing and says why and what it would cost; the Hugging Face Trainer
and Lightning callbacks replay a planted non-finite step; the Overflow debugger shows an attached run's replays."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.attach.monitor import MonitorConfig
from amp_core.config import ConfigError
from amp_core.diagnostics.attached_replay import (
    REPLAY_AUTO_MAX_BYTES,
    REPLAY_COST_EVENT,
    REPLAY_OFF_EVENT,
    REPLAY_ON_EVENT,
)
from amp_core.diagnostics.replay_modes import REPLAYED_EVENT, recorded_replays
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.views.replay import replay_frame
from tests.test_browser import CHROMIUM, SETTLED
from tests.test_replay_page import SHOTS, served_page

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def run_script(store: Path, script: str, *args: str) -> tuple[dict, RunManager]:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / script), "--store", str(store), *args], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith(("{", "AMPLAB ")))
    return json.loads(last.removeprefix("AMPLAB ")), RunManager(open_store(store))


AMPLIFIED_OVERFLOW = ("--model", "amplified", "--outlier-at", "30", "--factor", "1000", "--replay", "true")
"""The loop with a planted fp16 overflow in one layer, replay=True: three tests read the one run it makes."""


@pytest.fixture(scope="module")
def amplified_overflow(tmp_path_factory) -> tuple[Path, dict]:
    """A store holding one AMPLIFIED_OVERFLOW run, made once for this module (its store and the script's last line):
    a test copies it (`copy_store`) rather than train the same loop again."""
    store = tmp_path_factory.mktemp("amplified_overflow") / "runs.sqlite3"
    last, _ = run_script(store, "replay_monitor_script.py", *AMPLIFIED_OVERFLOW)
    return store, last


def copy_store(source: Path, target: Path) -> None:
    """`source`'s runs into a new SQLite store at `target` (SQLite's own backup: whole, whatever its journal holds)."""
    with closing(sqlite3.connect(source)) as db, closing(sqlite3.connect(target)) as copy:
        db.backup(copy)


def events_of(manager: RunManager, run_id: str, kind: str) -> list[tuple[int | None, str, dict]]:
    events = manager.events(run_id)
    mine = events[events["kind"] == kind]
    return list(zip(mine["step"], mine["message"], mine["data"], strict=True))


def test_a_planted_fp16_overflow_in_one_layer_is_replayed_and_judged_precision_naming_it(amplified_overflow):
    store, last = amplified_overflow
    manager = RunManager(open_store(store))
    assert last["skipped"] == [30]
    (report,) = recorded_replays(manager.events(last["run_id"]), 0)
    assert report.step == 30 and report.mode == "16-mixed" and report.verdict.kind == "precision"
    assert "amplify" in report.verdict.why
    rows = {row.mode: row for row in report.rows}
    assert set(rows) == {"16-mixed", "bf16-mixed", "32-true", "float64"}
    assert rows["16-mixed"].first_nonfinite == "amplify (forward)" and "65504" in rows["16-mixed"].first_nonfinite_why
    assert rows["16-mixed"].skipped and rows["16-mixed"].update_rel_norm == 0
    for mode in ("32-true", "bf16-mixed", "float64"):
        assert math.isfinite(rows[mode].loss) and rows[mode].grads_finite and not rows[mode].loss_above_band
    assert report.reproduced  # the recorded NaN loss came back in the loop's own mode
    (on,) = events_of(manager, last["run_id"], REPLAY_ON_EVENT)
    assert on[2]["on"] and on[2]["setting"] is True and 0 < on[2]["bytes"] <= REPLAY_AUTO_MAX_BYTES
    config = manager.run_info(last["run_id"]).config["replay"]
    assert config["on"] and config["bytes"] == on[2]["bytes"]
    (cost,) = events_of(manager, last["run_id"], REPLAY_COST_EVENT)
    assert cost[2]["copies"] == 33 and cost[2]["kept_bytes"] > 0 and cost[2]["copy_ms"] > 0  # one per step, and one
    # before the first


def test_by_default_a_skipped_step_is_replayed_from_a_copy_made_only_when_it_skipped(fresh_store):
    """replay="auto": a GradScaler skip leaves the state as it was before the step, so it is copied then, once, with
    the scale the step began with (the back-off undone); no copy is made on the other steps."""
    last, manager = run_script(fresh_store, "replay_monitor_script.py", "--model", "amplified", "--outlier-at", "30",
                               "--factor", "1000")
    assert last["skipped"] == [30]
    (report,) = recorded_replays(manager.events(last["run_id"]), 0)
    assert report.step == 30 and report.verdict.kind == "precision" and "amplify" in report.verdict.why
    assert report.reproduced  # the same NaN loss from the copy made after the skip
    rows = {row.mode: row for row in report.rows}
    frame = manager.steps(last["run_id"])
    assert rows["16-mixed"].scale == frame.loc[frame["step"] == 30, "scale"].iloc[0]  # the scale step 30 began with
    (on,) = events_of(manager, last["run_id"], REPLAY_ON_EVENT)
    assert on[2]["setting"] == "auto" and "skipped steps" in on[1]
    (cost,) = events_of(manager, last["run_id"], REPLAY_COST_EVENT)
    assert cost[2]["copies"] == 1  # the skipped step's, and no other


def test_a_planted_outlier_batch_is_replayed_and_judged_data(fresh_store):
    last, manager = run_script(fresh_store, "replay_monitor_script.py", "--model", "regression", "--outlier-at", "30",
                               "--factor", "30")
    reports = {report.step: report for report in recorded_replays(manager.events(last["run_id"]), 0)}
    outlier = reports[30]
    assert outlier.verdict.kind == "data", outlier.verdict.line()
    assert "fp32 breaks too" in outlier.verdict.why
    reference = next(row for row in outlier.rows if row.mode == "32-true")
    assert reference.loss_above_band and reference.loss > 100 * outlier.band.median
    assert list(replay_frame(outlier)["mode"]) == ["▶ 16-mixed", "bf16-mixed", "32-true ref", "float64 ref"]
    # the scaler's first skipped steps (a run of them) were replayed once, not once each
    assert all(step + 1 not in reports for step in reports)


def test_a_model_above_the_auto_limit_keeps_nothing_and_says_why_and_what_it_would_cost(fresh_store):
    last, manager = run_script(fresh_store, "replay_monitor_script.py", "--model", "wide", "--steps", "2",
                               "--outlier-at", "1", "--factor", "1e6")
    run_id = last["run_id"]
    (off,) = events_of(manager, run_id, REPLAY_OFF_EVENT)
    assert not off[2]["on"] and off[2]["setting"] == "auto" and off[2]["bytes"] > REPLAY_AUTO_MAX_BYTES
    assert "above replay='auto''s limit of 64 MiB" in off[1] and f"{off[2]['bytes'] / 2**20:.3g} MiB" in off[1]
    assert "replay=True turns it on" in off[1]
    assert not events_of(manager, run_id, REPLAYED_EVENT) and not events_of(manager, run_id, REPLAY_COST_EVENT)
    assert manager.run_info(run_id).config["replay"]["on"] is False


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_replay_setting_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match=r"replay.*must be 'auto', True or False"):
        MonitorConfig(replay=value)


@pytest.mark.parametrize(("trainer", "extra"), [("hf", "transformers"), ("lightning", "lightning")])
def test_the_trainer_callbacks_replay_a_planted_non_finite_step(fresh_store, trainer, extra):
    pytest.importorskip(extra, reason=f"the `{'hf' if extra == 'transformers' else extra}` extra is not installed")
    last, manager = run_script(fresh_store, "trainer_script.py", trainer, "--steps", "5", "--replay", "--nan-at", "3")
    (report,) = recorded_replays(manager.events(last["run_id"]), 0)  # the NaN weights after it: one run of failures
    assert report.step == 3 and report.verdict.kind == "data", report.verdict.line()
    assert {row.mode for row in report.rows} == {"32-true", "16-mixed", "bf16-mixed", "float64"}
    assert all(math.isnan(row.loss) for row in report.rows)  # the batch makes the loss NaN in every format
    assert math.isnan(manager.steps(last["run_id"])["loss"].iloc[3])


def test_the_overflow_debugger_shows_an_attached_runs_replays(amplified_overflow, fresh_store):
    store, last = amplified_overflow
    copy_store(store, fresh_store)  # the page's store (AMP_LAB_STORE)
    at = AppTest.from_file(str(ROOT / "pages" / "overflow_debugger.py"), default_timeout=120).run()
    assert not at.exception, at.exception
    assert at.selectbox(key="dbg_run").value == last["run_id"]
    assert not [button for button in at.button if button.key == "dbg_replay"]  # it replays itself
    assert at.selectbox(key=f"dbg_attached_replay_{last['run_id']}").value == 0
    assert any(md.value.endswith("verdict: precision") for md in at.markdown), [md.value for md in at.markdown]
    assert any("Replay is on (replay=True)" in caption.value for caption in at.caption)
    table = next(df.value for df in at.dataframe if "first inf/NaN" in df.value.columns)
    assert table["first inf/NaN"].iloc[0] == "amplify (forward)"
    assert table["what broke"].iloc[0] == "loss · inf/NaN · skip" and math.isnan(table["loss"].iloc[0])


def test_a_loop_without_a_loss_closure_keeps_nothing_by_default_and_a_failed_step_says_what_was_missing(fresh_store):
    import torch
    from torch import nn

    from amp_core.attach.monitor import Monitor

    def loop(**settings) -> str:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        with Monitor(model, optimizer, store=fresh_store, **settings) as monitor:
            for step in range(3):
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y) * (math.inf if step == 1 else 1.0)
                loss.backward()
                optimizer.step()
                monitor.step(loss)
        return monitor.run_id

    manager = RunManager(open_store(fresh_store))
    default = loop()
    (off,) = events_of(manager, default, REPLAY_OFF_EVENT)
    assert "only for a loop that gives the Monitor a loss_fn" in off[1] and not off[2]["on"]
    asked = loop(replay=True)
    assert events_of(manager, asked, REPLAY_ON_EVENT)
    (missing,) = events_of(manager, asked, REPLAY_OFF_EVENT)
    assert missing[0] == 1 and "step 1 failed (loss inf) and was not replayed: pass the step's batch" in missing[1]
    assert not events_of(manager, asked, REPLAYED_EVENT)


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install chromium)")
def test_an_attached_runs_replay_in_chromium(amplified_overflow, tmp_path):
    store = tmp_path / "runs.sqlite3"
    copy_store(amplified_overflow[0], store)
    with served_page(store, "overflow_debugger") as page:
        verdict = page.get_by_role("heading", name="verdict: precision")
        verdict.wait_for(timeout=120_000)
        page.wait_for_function(SETTLED, timeout=60_000)
        assert page.locator("[data-testid='stException']").count() == 0
        assert page.get_by_role("button", name="Replay", exact=True).count() == 0  # it replays itself
        page.get_by_text("only the narrower formats break", exact=False).first.wait_for()
        verdict.evaluate("heading => heading.scrollIntoView({block: 'start'})")
        table = page.locator("[data-testid='stDataFrame']", has_text="update vs fp32")
        table.locator(".dvn-scroller").wait_for()
        fit = table.locator(".dvn-scroller").evaluate("s => [s.scrollWidth, s.clientWidth]")
        assert fit[0] <= fit[1] + 1, fit  # every column of the replay's table shows
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "attached_replay_verdict.png"))


def test_a_replay_of_a_loop_that_keeps_a_module_in_fp32_keeps_it():
    # The user applied the printed fix (amp_core.fixes.keep_in_fp32): every replay of their step, in their mode or
    # another, computes the kept module in fp32 as their loop does; a copy prepared for a recipe would drop it.
    import torch
    from torch import nn

    from amp_core.diagnostics.attached_replay import KeptState
    from amp_core.fixes import keep_in_fp32
    from amp_core.precision import float64_reference, get_precision, is_kept

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    keep_in_fp32(model, ["2"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = KeptState(model, optimizer, None)
    state.keep()
    assert state.kept_fp32 == ["2"]
    for mode in ("bf16-mixed", "16-mixed"):
        precision = get_precision(mode)
        forked, _, _ = state.fork(precision, None)
        assert is_kept(forked[2]) and not is_kept(forked[0])
        with precision.forward_context():
            assert forked(torch.randn(2, 8)).dtype == torch.float32, mode
    wide = float64_reference()  # the reference computes everything in float64, the kept module too
    forked, _, _ = state.fork(wide, None)
    assert not is_kept(forked[2]) and forked(torch.randn(2, 8, dtype=torch.float64)).dtype == torch.float64
