"""The Monitor on real CPU training loops: exact skipped steps (plain and fused optimizers, the user's own clipping),
the LR the optimizer used (OneCycleLR), bf16 without a scaler, sampled figures, refused settings, a crash; then a
monitored script in a process of its own, followed live by a RunManager and the Train page, and killed with SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest
from torch import nn

from amp_core.attach.monitor import Monitor, MonitorConfig
from amp_core.config import ConfigError
from amp_core.probes.memory import optimizer_state_tensors, tensor_bytes
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.runs import SourceKind
from amp_core.views.live import RecordFollower
from tests.test_page_train import lanes_shown

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "monitor_script.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(64, 10, generator=generator), torch.randn(64, 1, generator=generator) * 5 + 10


def fp16_loop(store: RunStore, steps: int = 40, overflow_at=(), fused: bool = False, clip: float = 0.0,
              onecycle: bool = False, **settings) -> tuple[Monitor, list[int], list[float]]:
    """Seed 000's loop under a Monitor; returns it, the steps whose scale backed off (the loop's own public-API
    check), and the LR the optimizer held as each step began."""
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 1e-2, total_steps=steps, cycle_momentum=False) \
        if onecycle else None
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch()
    backed_off, lrs = [], []
    with Monitor(model, optimizer, scaler, scheduler, store=store, **settings) as monitor:
        for step in range(steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            before = scaler.get_scale()
            scaler.scale(loss * (1e30 if step in overflow_at else 1.0)).backward()
            if clip:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            lrs.append(optimizer.param_groups[0]["lr"])
            scaler.step(optimizer)
            scaler.update()
            if scheduler is not None:
                scheduler.step()
            if scaler.get_scale() < before:
                backed_off.append(step)
            monitor.step(loss, samples=len(x))
    return monitor, backed_off, lrs


@pytest.fixture
def store(fresh_store) -> RunStore:
    return open_store(fresh_store)


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_skipped_steps_are_exact_and_name_the_parameters_that_overflowed(store, fused):
    monitor, backed_off, _ = fp16_loop(store, overflow_at=(12, 25), fused=fused)
    frame = store.steps(monitor.run_id)
    assert len(frame) == 40 and set(frame["lane"]) == {0} and set(frame["rank"]) == {0}
    assert {12, 25} <= set(backed_off)  # the forced overflows, besides the first steps' natural ones at 2^16
    assert frame.loc[frame["skipped"], "step"].tolist() == backed_off
    events = store.events(monitor.run_id)
    skips = events[events["kind"] == "skipped_step"]
    assert skips["step"].astype(int).tolist() == backed_off
    assert all(event["params"] for event in skips["data"])  # every skipped step names its parameters
    assert {p["param"] for p in skips[skips["step"] == 12]["data"].iloc[0]["params"]} <= {"0.weight", "0.bias",
                                                                                           "2.weight", "2.bias"}
    assert not (events["kind"] == "warning").any(), "the skip flag and the scale backoff disagreed"
    assert store.run(monitor.run_id)["status"] == "finished"
    assert (frame["scale"].diff().dropna() < 0).tolist() == frame["skipped"].iloc[:-1].tolist()
    assert monitor.mode == "16-mixed"  # seen from the loop: fp16 autocast in the model's forward


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")  # seed 001's order
def test_the_users_own_clipping_and_onecycle_keep_skips_exact_and_record_the_lr_used(store):
    clip = 1.0
    monitor, backed_off, lrs = fp16_loop(store, steps=60, overflow_at=(30,), clip=clip, onecycle=True,
                                         grad_norm_every=1)
    frame = store.steps(monitor.run_id)
    assert frame.loc[frame["skipped"], "step"].tolist() == backed_off and 30 in backed_off
    assert frame["lr"].tolist() == pytest.approx(lrs, rel=1e-12)  # the LR each step began with, skipped ones too
    assert max(lrs) == pytest.approx(1e-2, rel=1e-3)  # the one cycle's peak was recorded
    stepped = frame[~frame["skipped"]]
    assert (stepped["grad_norm"] <= clip * (1 + 1e-3)).all()  # the gradients the optimizer got: clipped
    assert not math.isfinite(frame.loc[frame["step"] == 30, "grad_norm"].iloc[0])
    assert store.run(monitor.run_id)["config"]["steps"] == 60  # OneCycleLR's total_steps: the run knows its length
    assert store.run(monitor.run_id)["config"]["scheduler"] == "onecycle"


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_plain_steps_kept_for_the_next_drain_record_what_full_steps_record(store):
    """Most steps take the Monitor's plain path (figures kept, recorded in a batch at the next drain): their records
    must equal those of a Monitor that takes the full path on every step (gradient norm every step)."""
    plain, backed_off, lrs = fp16_loop(store, steps=60, overflow_at=(17, 18, 40), onecycle=True)
    full, _, _ = fp16_loop(store, steps=60, overflow_at=(17, 18, 40), onecycle=True, grad_norm_every=1)
    assert plain._driver.plain_until > 2, "the plain path was never open"
    columns = ["step", "loss", "lr", "scale", "skipped", "params_bytes"]
    kept, every = store.steps(plain.run_id)[columns], store.steps(full.run_id)[columns]
    assert kept["step"].tolist() == list(range(60))
    assert kept.equals(every)
    assert kept["lr"].tolist() == pytest.approx(lrs, rel=1e-12)
    assert kept.loc[kept["skipped"], "step"].tolist() == backed_off and {17, 18, 40} <= set(backed_off)
    # The same skips, scale changes and layer-watch events at the same steps. Sorted by step: the layer watch's
    # events are written when its probe is read, which a busy machine can put after a later step's skip.
    kinds = lambda run: sorted(store.events(run)[["kind", "step"]].fillna(-1).values.tolist(),  # noqa: E731
                               key=lambda kind_step: (kind_step[1], kind_step[0]))
    assert kinds(plain.run_id) == kinds(full.run_id)


def test_bf16_autocast_without_a_scaler(store):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch()
    with Monitor(model, optimizer, store=store, name="bf16") as monitor:
        for _ in range(12):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            monitor.step(loss)
    frame = store.steps(monitor.run_id)
    assert monitor.mode == "bf16-mixed" and store.run(monitor.run_id)["modes"] == ["bf16-mixed"]
    assert len(frame) == 12 and not frame["skipped"].any() and frame["scale"].isna().all()
    assert (frame["step_ms"] > 0).all() and frame["samples_per_s"].isna().all()
    assert frame["loss"].iloc[-1] < frame["loss"].iloc[0]


def test_plain_steps_on_a_cpu_keep_their_wall_clock_time_and_the_monitors_own(store):
    # With no scaler on a CPU, the steps that sample nothing are kept as tuples and made records at the next full step
    # or flush: their wall-clock time is their window's end moved to the wall clock then, their probe_ms the Monitor's
    # host time from their window's end to the next window's start.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch()
    started = time.time()
    with Monitor(model, optimizer, store=store, mode="32-true", grad_norm_every=20, memory_every=20,
                 gradstats_every=0) as monitor:
        for _ in range(60):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            monitor.step(loss)
        assert monitor._driver.plain  # the plain path was taken (its steps are what this test is about)
    ended = time.time()
    frame = store.steps(monitor.run_id)
    assert frame["step"].tolist() == list(range(60))
    assert frame["t_wall_s"].is_monotonic_increasing
    assert started <= frame["t_wall_s"].min() and frame["t_wall_s"].max() <= ended
    assert (frame["step_ms"] > 0).all() and (frame["probe_ms"] >= 0).all() and frame["loss"].notna().all()
    assert frame["grad_norm"].notna().tolist() == [step % 20 == 0 for step in range(60)]


def test_sampled_figures_memory_and_gradient_statistics(store):
    monitor, backed_off, _ = fp16_loop(store, steps=31, gradstats_every=10, grad_norm_every=5, memory_every=15,
                                       probe_budget=0)
    frame = store.steps(monitor.run_id).set_index("step")
    params = tensor_bytes(monitor.model.parameters())
    assert (frame["params_bytes"] == params).all() and (frame["grads_bytes"] == params).all()
    optim = tensor_bytes(optimizer_state_tensors(monitor.optimizer))
    assert optim > 2 * params and frame.loc[30, "optim_bytes"] == optim  # Adam's moments (and step counts)
    assert frame["lane_peak_bytes"].iloc[-1] == 2 * params + optim and frame["peak_above_start_bytes"].isna().all()
    measured = frame.index[frame["grad_norm"].notna()].tolist()
    assert measured == sorted({0, 5, 10, 15, 20, 25, 30} | set(backed_off))
    sampled = store.grad_stat_steps(monitor.run_id, 0)
    assert sampled == sorted({0, 10, 20, 30} | set(backed_off))
    stats = store.grad_stats(monitor.run_id, 0, 20)
    assert {s.param for s in stats} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert (frame["probe_ms"] >= 0).all() and (frame["samples_per_s"] > 0).all()


def test_gradient_statistics_stay_within_the_probe_budget(store):
    monitor, backed_off, _ = fp16_loop(store, steps=40, gradstats_every=1, probe_budget=1e-6)
    assert store.grad_stat_steps(monitor.run_id, 0) == [0]  # the first sample used the whole budget (and more)
    frame = store.steps(monitor.run_id)
    assert frame.loc[frame["skipped"], "step"].tolist() == backed_off and len(backed_off) > 1  # skips still exact
    events = store.events(monitor.run_id)
    assert all(e["params"] for e in events[events["kind"] == "skipped_step"]["data"])  # and named


def test_the_costly_probes_share_one_budget(store):
    """Gradient statistics and layer diagnostics take half of probe_budget each while both are sampled; one alone,
    all of it; the Monitor hands each its part."""
    assert MonitorConfig(probe_budget=0.004).probe_share() == 0.002
    assert MonitorConfig(probe_budget=0.004, layers_every=0).probe_share() == 0.004
    assert MonitorConfig(probe_budget=0.004, gradstats_every=0).probe_share() == 0.004
    monitor, _, _ = fp16_loop(store, steps=3, probe_budget=0.004)
    assert monitor._driver.probes.schedule.probe_budget == 0.002 and monitor._layers.budget == 0.002


@pytest.mark.parametrize(("settings", "field"), [({"mode": "fp8"}, "mode"), ({"grad_norm_every": 0}, "grad_norm_every"),
                                                 ({"gradstats_every": -1}, "gradstats_every"),
                                                 ({"flush_every_s": 0}, "flush_every_s"),
                                                 ({"total_steps": 1.5}, "total_steps"),
                                                 ({"probe_budget": 1.0}, "probe_budget")])
def test_bad_settings_are_refused_naming_the_setting(settings, field):
    with pytest.raises(ConfigError, match=f"^{field}: ") as refused:
        MonitorConfig(**settings)
    assert refused.value.field == field


def test_a_crash_inside_the_with_block_leaves_a_failed_run_saying_why(store):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch()
    with pytest.raises(ValueError, match="data ran out"), \
            Monitor(model, optimizer, store=store, mode="32-true") as monitor:
        for step in range(5):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            monitor.step(1.0)
            if step == 3:
                raise ValueError("data ran out")
    run = store.run(monitor.run_id)
    assert run["status"] == "failed" and run["lanes"][0]["status"] == "failed"
    assert "ValueError: data ran out" in run["lanes"][0]["error"]
    assert len(store.steps(monitor.run_id)) == 4
    with pytest.raises(RuntimeError, match="after close"):
        monitor.step(1.0)


def test_a_monitored_run_opens_on_every_page(store):
    monitor, _, _ = fp16_loop(store, steps=30, overflow_at=(12,), onecycle=True)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180).run()
    for page in ("pages/train.py", "pages/compare.py", "pages/op_inspector.py", "pages/layer_numerics.py",
                 "pages/overflow_debugger.py"):
        at.switch_page(page).run()
        assert not at.exception, (page, [e.value for e in at.exception])
    at.switch_page("pages/train.py").run()
    assert at.selectbox(key="train_run_pick").value == monitor.run_id
    lanes = at.dataframe[0].value  # the lanes table
    assert lanes["progress"].tolist() == [1.0] and lanes["steps"].tolist() == ["30 / 30"]  # OneCycleLR's 30 steps
    assert "speed" not in lanes and "memory" not in lanes  # one lane: no 1.00× against itself


# --- a monitored script in a process of its own -------------------------------------------------------------------
def start_script(store: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), "--store", str(store), *args], cwd=ROOT, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def said(proc: subprocess.Popen) -> dict:
    """The script's next JSON line (it writes one at each pause and at the end)."""
    line = proc.stdout.readline()
    assert line, f"the script ended early: {proc.stderr.read()}"
    return json.loads(line)


def test_a_dashboard_follows_a_monitored_script_live_and_its_skips_are_exact(fresh_store):
    proc = start_script(fresh_store, "--steps", "40", "--pause-at", "9,24", "--overflow-at", "12,30")
    try:
        first = said(proc)
        manager = RunManager(open_store(fresh_store))
        follower = RecordFollower(first["run_id"])
        (lane,) = follower.update(manager)
        assert lane.stats.records == 10 and proc.poll() is None  # the records are here; the script is still going
        info = manager.run_info(first["run_id"])
        assert info.status == "running" and info.kind is SourceKind.MONITOR and info.attached
        assert not info.controllable and info.writer.startswith("a Monitor in ") and info.pid == proc.pid

        page = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run()
        assert not page.exception
        notes = " ".join(caption.value for caption in page.caption)
        assert "a Monitor in `monitor_script.py`" in notes and "not offered here" in notes
        assert not [b for b in page.button if b.key in ("train_pause", "train_stop")]
        (row,) = lanes_shown(page).to_dict("records")  # the live board's lanes table: one lane, nothing to compare with
        assert row["ms/step"] != "–" and "speed" not in row and "memory" not in row

        proc.stdin.write("\n")
        proc.stdin.flush()
        second = said(proc)
        (lane,) = follower.update(manager)
        assert lane.stats.records == 25 and proc.poll() is None  # more records, still before the end
        proc.stdin.write("\n")
        proc.stdin.flush()
        last = said(proc)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    (lane,) = follower.update(manager)
    assert lane.stats.records == 40
    skipped, _ = lane.skipped()
    assert skipped.tolist() == last["skipped"] and {12, 30} <= set(last["skipped"])
    assert second["skipped"] == [s for s in last["skipped"] if s <= 24]
    assert manager.run_info(first["run_id"]).status == "finished"


def test_sigkill_of_a_monitored_script_leaves_an_interrupted_run_with_its_records(fresh_store):
    proc = start_script(fresh_store, "--steps", "40", "--pause-at", "14")
    try:
        paused = said(proc)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        proc.kill()
    manager = RunManager(open_store(fresh_store))  # a dashboard (re)started after the script died
    info = manager.run_info(paused["run_id"])
    assert info.status == "interrupted" and info.lanes[0].status == "interrupted"
    assert info.lanes[0].steps_done == 15
    assert len(manager.steps(paused["run_id"])) == 15
    events = manager.events(paused["run_id"])
    assert "interrupted" in events["kind"].tolist()


@pytest.mark.parametrize(("example", "args"), [("monitor_seed000.py", ("--epochs", "1", "--samples", "2000")),
                                               ("monitor_onecycle.py", ("--epochs", "1"))])
def test_the_monitor_examples_run_and_finish(fresh_store, example, args):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--store", str(fresh_store), *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    store = open_store(fresh_store)
    (run_id,) = store.runs()["run_id"]
    run = store.run(run_id)
    frame = store.steps(run_id)
    assert run["status"] == "finished" and run["modes"] == ["16-mixed"] and len(frame) > 0
    assert f"run {run_id}: {len(frame)} steps (16-mixed)" in proc.stdout
    assert frame["skipped"].any()  # fp16 at the initial scale 2^16 overflows in the first steps: recorded as such


def live_caption(page: AppTest) -> str:
    return next((caption.value for caption in page.caption if " live: redrawn every " in caption.value), "")


def lane_overview(page: AppTest):
    """The Overflow debugger's lane overview table."""
    return next(frame.value for frame in page.dataframe if "skipped steps" in frame.value.columns)


def test_the_debugger_and_layer_numerics_follow_a_monitored_script_live(fresh_store):
    """A Monitor script in a process of its own moves on the Overflow debugger and Layer numerics pages: both see it
    live (redrawn on a timer) while it trains, with the steps it has made, and static once it has finished."""
    proc = start_script(fresh_store, "--steps", "40", "--pause-at", "9,24", "--overflow-at", "12")
    pages = {name: AppTest.from_file(str(ROOT / "pages" / name), default_timeout=120)
             for name in ("overflow_debugger.py", "layer_numerics.py")}
    try:
        first = said(proc)
        seen = {}
        for name, page in pages.items():
            page.run()
            assert not page.exception, (name, [e.value for e in page.exception])
            seen[name] = live_caption(page)
        assert "lane 0 10 steps" in seen["overflow_debugger.py"], seen
        assert "lane 0 10 steps" in seen["layer_numerics.py"], seen
        overview = lane_overview(pages["overflow_debugger.py"])
        assert overview["steps"].tolist() == [10] and overview["skipped steps"].tolist() == [len(first["skipped"])]

        proc.stdin.write("\n")
        proc.stdin.flush()
        second = said(proc)  # paused again after step 24: the pages follow through the store
        for name, page in pages.items():
            page.run()
            assert not page.exception, (name, [e.value for e in page.exception])
            assert "lane 0 25 steps" in live_caption(page), (name, live_caption(page))
        overview = lane_overview(pages["overflow_debugger.py"])
        assert overview["steps"].tolist() == [25] and overview["skipped steps"].tolist() == [len(second["skipped"])]
        assert 12 in second["skipped"]

        proc.stdin.write("\n")
        proc.stdin.flush()
        last = said(proc)
        assert proc.wait(60) == 0 and 12 in last["skipped"]
    finally:
        proc.kill()
    for name, page in pages.items():
        page.run()
        assert not page.exception and not live_caption(page), name  # finished: drawn once, no timer
    assert first["run_id"] == RunManager(open_store(fresh_store)).list_runs()["run_id"].tolist()[0]
