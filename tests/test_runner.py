"""The runner, on real torch: every workload x mode trains, lanes are fair, skips are exact, threads end."""

from __future__ import annotations

import copy
import gzip
import struct
import time

import numpy as np
import pandas as pd
import pytest
import torch
from failing_workload import OutOfMemoryAt
from stepped_run import SteppedRun
from torch.nn import functional as F

from amp_core.config import FaultSpec, RunConfig, ScalerConfig
from amp_core.precision import MODES, availability
from amp_core.race.runner import Run, RunHooks, RunLimitError, RunManager, build_lane_state
from amp_core.race.step import train_step
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.workloads import WORKLOADS

CPU_MODES = [m for m in MODES if availability(m, "cpu")[0]]


class RecordingRun(Run):
    """A real Run that also keeps each lane's initial weights and every batch it fed (test instrumentation, through
    the run's hooks)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial, self.fed = [], []
        self.hooks.lane_setup.append(lambda run, lane: run.initial.append(copy.deepcopy(lane.state.model.state_dict())))
        self.hooks.before_lane_step.append(
            lambda run, lane, step: run.fed.append((lane.index, step, [t.clone() for t in run.batch_of(lane)])))


def finished(config: RunConfig, store: RunStore | None = None) -> Run:
    run = Run(config, store).start()
    run.join(120)
    assert not run.alive
    return run


@pytest.mark.parametrize("mode", CPU_MODES)
# The transformers architectures (the hf extra) race in tests/test_hf_workloads.py, three modes each in one run.
@pytest.mark.parametrize("workload", [name for name, spec in WORKLOADS.items() if not spec.requires])
def test_every_workload_runs_five_steps_in_every_mode(workload, mode):
    # SGD: fp16 cannot hold Adam's default eps (see test_sixteen_true_adam_divergence_says_why).
    run = finished(RunConfig(workload=workload, modes=(mode,), steps=5, batch_size=8, optimizer="sgd", lr=1e-3))
    lane = run.lanes[0]
    assert (lane.status, lane.error) == ("finished", "")
    frame = run.frame()
    assert frame["step"].tolist() == [0, 1, 2, 3, 4]
    assert np.isfinite(frame["loss"]).all() and (frame["step_ms"] > 0).all()
    assert (frame["params_bytes"] > 0).all() and (frame["activations_bytes"] > 0).all()
    assert frame["scale"].notna().all() == (mode == "16-mixed")


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("workload", ["mlp_regression", "digits_mlp"])
def test_loss_falls_over_200_steps(workload, mode):
    frame = finished(RunConfig(workload=workload, modes=(mode,), steps=200, lr=1e-2 if workload == "mlp_regression"
                               else 1e-3)).frame()
    first, last = frame["loss"].iloc[:10].mean(), frame["loss"].iloc[-10:].mean()
    assert last < 0.5 * first, (first, last)


def test_lanes_start_identical_and_see_identical_batches():
    run = RecordingRun(RunConfig(workload="digits_mlp", modes=("32-true", "bf16-mixed", "16-mixed", "bf16-true"),
                                 steps=6, batch_size=16)).start()
    run.join(60)
    fp32 = run.initial[0]
    for lane, state in zip(run.lanes, run.initial, strict=True):
        dtype = next(iter(state.values())).dtype
        for name, tensor in state.items():
            assert torch.equal(tensor, fp32[name].to(dtype)), (lane.mode, name)
    by_step = {}
    for lane, step, batch in run.fed:
        by_step.setdefault(step, []).append((lane, batch))
    assert sorted(by_step) == list(range(6))
    for fed in by_step.values():
        assert [lane for lane, _ in fed] == [0, 1, 2, 3], "lanes are interleaved A B C D each step"
        for _, batch in fed[1:]:
            assert all(torch.equal(a, b) for a, b in zip(batch, fed[0][1], strict=True))
    assert not torch.equal(by_step[0][0][1][0], by_step[1][0][1][0]), "batches differ from step to step"


def test_fp32_lane_is_bit_identical_to_a_plain_loop():
    seed, steps, batch_size, lr = 3, 30, 32, 1e-3
    run = finished(RunConfig(workload="digits_mlp", modes=("32-true",), steps=steps, batch_size=batch_size, lr=lr,
                             seed=seed))
    # The seed notes' loop, written out by hand, with the intra-op threads the run measured and chose (a
    # different thread count may sum in another order: equal to the last bit only with the same one).
    threads = run.events()[0].data["intra_op_threads"]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        losses = plain_loop(seed, steps, batch_size, lr)
    finally:
        torch.set_num_threads(previous)
    assert run.frame()["loss"].tolist() == losses


def plain_loop(seed: int, steps: int, batch_size: int, lr: float) -> list[float]:
    workload = WORKLOADS["digits_mlp"]
    data = workload.load_data(RunConfig(workload="digits_mlp", seed=seed))
    torch.manual_seed(seed)
    model = workload.build_model("small", data)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = data.sample(generator, batch_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_inf_gradient_at_step_n_is_skipped_scale_halves_and_the_scheduler_waits():
    n = 7
    config = RunConfig(workload="mlp_regression", modes=("16-mixed", "32-true"), steps=12, scheduler="onecycle",
                       scaler=ScalerConfig(init_scale=256.0),  # 2**16 overflows this MSE at first (real backoffs)
                       faults=(FaultSpec(kind="grad_inf", step=n, modes=("16-mixed",)),), stop_on_divergence=False)
    run = finished(config)
    frame = run.frame()
    fp16 = frame[frame["mode"] == "16-mixed"].set_index("step")
    assert fp16.index[fp16["skipped"]].tolist() == [n]
    assert fp16.loc[n + 1, "scale"] == fp16.loc[n, "scale"] / 2
    # OneCycleLR did not advance on the skipped step: step n+1 uses the LR step n would have used.
    assert fp16.loc[n + 1, "lr"] == fp16.loc[n, "lr"]
    assert fp16.loc[n, "lr"] != fp16.loc[n - 1, "lr"]
    kinds = [(e.kind, e.step) for e in run.events() if e.lane == 0]
    assert ("skipped_step", n) in kinds and ("scale_backoff", n) in kinds and ("fault", n) in kinds


def test_a_skipped_step_leaves_the_parameters_unchanged():
    config = RunConfig(workload="mlp_regression", modes=("16-mixed",), faults=(FaultSpec(kind="grad_inf", step=1),),
                       scaler=ScalerConfig(init_scale=256.0))
    workload = WORKLOADS["mlp_regression"]
    data = workload.load_data(config)
    lane = build_lane_state(config, 0, "16-mixed", workload.build_model("small", data), workload, "cpu")
    generator = torch.Generator().manual_seed(0)
    assert not train_step(lane, data.sample(generator, 64), 0).skipped
    before = copy.deepcopy(lane.model.state_dict())
    optimizer_before = copy.deepcopy(lane.optimizer.state_dict()["state"])
    result = train_step(lane, data.sample(generator, 64), 1)
    assert result.skipped and result.scale_after == result.scale / 2
    assert result.bad_params == [{"param": "layer1.weight", "inf": 1, "nan": 0}]
    for name, tensor in lane.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for index, state in lane.optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], optimizer_before[index]["exp_avg"])


def test_pause_resume_stop(no_leaked_threads):
    run = SteppedRun(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=100_000)).start()
    run.wait_until(lambda r: r.lane_steps > 10)
    with run.progress:  # no lane step is counted while the pause lands
        run.pause()
        paused_at = run.lane_steps
    # The lane step under way when pause() landed may still finish (in either window, however slow the machine);
    # none starts after it.
    assert run.steps_within(0.5) + run.steps_within(0.5) <= 1
    assert run.status == "paused" and run.alive and len(run.sink.records) == run.lane_steps <= paused_at + 1
    run.resume()
    resumed_at = run.lane_steps
    run.wait_until(lambda r: r.lane_steps > resumed_at + 10)
    run.stop()
    assert not run.alive
    assert run.status == "stopped" and {lane.status for lane in run.lanes} == {"stopped"}
    control = [e.kind for e in run.events() if e.kind in ("paused", "resumed", "stopped", "finished")]
    assert control == ["paused", "resumed", "stopped"]


def test_wait_paused_returns_once_the_thread_stands_with_every_step_recorded(no_leaked_threads):
    config = RunConfig(workload="mlp_regression", modes=("32-true",), steps=100_000, snapshot_every=0)
    run = Run(config).start()
    assert not run.wait_paused(0.05)  # running: it never stands
    for _ in range(3):  # pause and resume in quick turns, as bench.overhead's turns do
        run.pause()
        assert run.wait_paused(60.0)
        made = run.lanes[0].steps_done
        assert len(run.frame()) == made and run.status == "paused"
        run.resume()
        deadline = time.monotonic() + 60
        while run.lanes[0].steps_done < made + 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert run.lanes[0].steps_done >= made + 5  # it went on: the last wait did not answer for an older pause
    run.stop()
    assert run.status == "stopped"


def test_pause_at_stops_every_lane_before_that_step_and_runs_on_from_there(no_leaked_threads):
    config = RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=60, snapshot_every=0)
    run = Run(config)
    run.start()
    run.pause()  # from a standing start, as bench.overhead's turns begin
    assert run.wait_paused(60.0)
    for upto in (7, 8, 31):  # the next step, and a run of them
        run.pause_at(upto)
        assert run.wait_paused(60.0) and run.status == "paused"
        assert [lane.steps_done for lane in run.lanes] == [upto, upto]
        frame = run.frame()
        assert len(frame) == 2 * upto and frame.groupby("mode")["step"].max().tolist() == [upto - 1, upto - 1]
    paused = [e for e in run.events() if e.kind == "paused"]
    assert [e.step for e in paused[1:]] == [7, 8, 31] and paused[-1].message == "paused before step 31"
    run.pause_at(1_000)  # past the end: the run finishes and never stands
    run.join(60.0)
    assert run.status == "finished" and not run.wait_paused(0.01)
    assert len(run.frame()) == 2 * config.steps
    run.pause_at(70)  # an ended run is left as it is
    assert run.status == "finished"


def test_stop_ends_the_run_within_a_step(no_leaked_threads):
    run = SteppedRun(RunConfig(workload="mlp_regression", modes=("32-true",), steps=100_000)).start()
    run.wait_until(lambda r: r.lane_steps >= 3)
    run.stop()  # waits up to the run's own 30 s: a busy machine may take seconds to schedule the thread
    assert not run.alive and run.ended and run.status == "stopped"


def test_fifty_start_stop_cycles_leave_no_threads(no_leaked_threads):
    for _ in range(50):
        run = Run(RunConfig(workload="mlp_regression", modes=("32-true",), steps=100_000)).start()
        run.stop()
        assert not run.alive and run.status == "stopped"


def test_a_failing_lane_does_not_stop_the_others():
    # fp16 weights and an LR spike: the 16-true lane diverges, the fp32 lane goes on to the end.
    config = RunConfig(workload="mlp_regression", modes=("32-true", "16-true"), steps=40, optimizer="sgd", lr=1e-3,
                       faults=(FaultSpec(kind="grad_nan", step=5, modes=("16-true",)),))
    run = finished(config)
    fp32, fp16 = run.lanes
    assert fp32.status == "finished" and fp32.steps_done == 40
    assert fp16.status == "diverged" and "loss became nan at step 6" in fp16.error
    assert run.status == "finished"
    assert [e.kind for e in run.events() if e.lane == 1][-2:] == ["nonfinite_loss", "diverged"]


def test_a_lane_out_of_memory_fails_alone(monkeypatch):
    workload = OutOfMemoryAt(step=4)  # the autocast lanes' models ask for more memory than there is at step 4
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    run = finished(RunConfig(workload=workload.name, modes=("32-true", "16-mixed", "bf16-mixed"), steps=12))
    assert [lane.status for lane in run.lanes] == ["finished", "failed", "failed"]
    assert run.status == "finished" and run.lanes[0].steps_done == 12
    for lane in run.lanes[1:]:
        assert lane.steps_done == 4 and "can't allocate memory" in lane.error and lane.error.startswith("RuntimeError")
    errors = [(e.lane, e.step) for e in run.events() if e.kind == "error"]
    assert errors == [(1, 4), (2, 4)]
    assert run.frame().groupby("lane").size().tolist() == [12, 4, 4]


def test_sixteen_true_adam_divergence_says_why():
    run = finished(RunConfig(workload="digits_mlp", modes=("16-true",), steps=10))
    assert run.lanes[0].status == "diverged"
    assert "eps=1e-08 is 0 in float16" in run.lanes[0].error


def test_manager_limits_concurrent_runs_and_lists_them(no_leaked_threads):
    manager = RunManager(open_store(), max_running=1)
    run = manager.launch(RunConfig(workload="mlp_regression", modes=("32-true",), steps=100_000))
    with pytest.raises(RunLimitError, match="runs: 1 runs are already going"):
        manager.launch(RunConfig(workload="mlp_regression", modes=("32-true",), steps=10))
    manager.stop_all()
    assert not run.alive
    listed = manager.list_runs()
    assert listed["run_id"].tolist() == [run.run_id] and listed["status"].iloc[0] == "stopped"
    assert manager.run_info(run.run_id).lanes[0].mode == "32-true"


def test_snapshot_of_a_lane_is_a_copy(no_leaked_threads):
    run = SteppedRun(RunConfig(workload="mlp_regression", modes=("32-true",), steps=100_000), pause_after={4}).start()
    try:
        run.wait_until(SteppedRun.parked)
        snap = run.snapshot_lane(0)
        live = dict(run.lanes[0].state.model.named_parameters())
        assert snap.step == 4
        assert all(torch.equal(p, live[name]) for name, p in snap.model.named_parameters())  # the weights of now
        with torch.no_grad():
            for p in snap.model.parameters():
                p.add_(1.0)
        assert all(not torch.equal(p, live[name]) for name, p in snap.model.named_parameters())
    finally:
        run.stop()


def _write_idx(path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_digits_mlp_reads_mnist_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (50, 28, 28)))
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 50))
    run = finished(RunConfig(workload="digits_mlp", modes=("32-true",), steps=3, batch_size=8, data_dir=str(tmp_path)))
    assert run.lanes[0].status == "finished"
    assert "MNIST idx: 50 images of 28x28" in run.data.description
    assert run.frame()["params_bytes"].iloc[0] == (784 * 256 + 256 + 256 * 10 + 10) * 4


def test_a_damaged_idx_file_fails_the_run_with_a_message(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03garbage")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x02ab")
    run = finished(RunConfig(workload="digits_mlp", modes=("32-true",), steps=3, data_dir=str(tmp_path)))
    assert run.status == "failed"
    assert any(e.kind == "error" and "train-images-idx3-ubyte" in e.message for e in run.events())


def test_scaler_settings_reach_the_scaler():
    run = finished(RunConfig(workload="mlp_regression", modes=("16-mixed",), steps=6,
                             scaler=ScalerConfig(init_scale=8.0, growth_interval=2)))
    assert run.frame()["scale"].tolist() == [8.0, 8.0, 16.0, 16.0, 32.0, 32.0]


def _no_op(run, lane, step) -> None:
    """An after_lane_step hook that watches nothing: with it every step takes the full path (Run._loop)."""


def _figures(run: Run):
    """A run's records without the figures that are times, and its events without their times."""
    frame = run.frame().drop(columns=["run_id", "t_wall_s", "step_ms", "samples_per_s", "probe_ms"])
    events = [(e.kind, e.lane, e.step, e.message) for e in run.events() if e.kind != "started"]
    return frame, events


def test_plain_steps_record_what_full_steps_record():
    # 32-true and bf16-mixed lanes take plain steps between the sampled ones; 16-mixed (a scaler) never does.
    config = RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed", "16-mixed"), steps=120,
                       intra_op_threads=1, seed=5)
    plain = finished(config)
    full = Run(config, hooks=RunHooks(after_lane_step=[_no_op])).start()
    full.join(120)
    assert [lane.plain for lane in plain.lanes] == [True, True, False]
    assert not any(lane.plain for lane in full.lanes)
    (plain_frame, plain_events), (full_frame, full_events) = _figures(plain), _figures(full)
    assert len(plain_frame) == 3 * 120 and [lane.steps_done for lane in plain.lanes] == [120] * 3
    pd.testing.assert_frame_equal(plain_frame, full_frame)
    assert plain_events == full_events
    assert plain.frame()["step_ms"].gt(0).all() and plain.frame()["probe_ms"].notna().all()


def test_a_plain_lane_whose_loss_goes_nonfinite_stops_on_that_step():
    # SGD with a huge LR blows fp32 up within a few steps, with no fault planned: the lane's steps are plain ones.
    config = RunConfig(workload="mlp_regression", modes=("32-true",), steps=60, optimizer="sgd", lr=1e4,
                       intra_op_threads=1)
    plain = finished(config)
    full = Run(config, hooks=RunHooks(after_lane_step=[_no_op])).start()
    full.join(120)
    lane = plain.lanes[0]
    assert lane.plain and lane.status == "diverged"
    losses = plain.frame()["loss"]
    first_bad = int(plain.frame()["step"][~np.isfinite(losses)].iloc[0])
    assert first_bad > 1, "the divergence must come on a plain step for this test to mean anything"
    assert plain.frame()["step"].max() == first_bad == lane.steps_done - 1
    assert f"loss became {losses.iloc[-1]} at step {first_bad}" in lane.error
    pd.testing.assert_frame_equal(_figures(plain)[0], _figures(full)[0])
    assert _figures(plain)[1] == _figures(full)[1]


def test_a_paused_plain_run_shows_every_step_it_made(no_leaked_threads):
    # Nothing sampled after step 1: every later step is a plain one, kept until a flush (0.5 s) or the pause.
    config = RunConfig(workload="mlp_regression", modes=("32-true",), steps=100_000, memory_every=10**6,
                       grad_norm_every=10**6, gradstats_every=0, snapshot_every=0)
    run = Run(config).start()
    deadline = time.monotonic() + 60
    while run.lanes[0].steps_done < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    run.pause()
    while run.status != "paused" and time.monotonic() < deadline:
        time.sleep(0.01)
    # The step under way when the pause landed ends; then the thread records what it kept and waits.
    while len(run.frame()) != run.lanes[0].steps_done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.lanes[0].plain and run.status == "paused"
    assert len(run.frame()) == run.lanes[0].steps_done >= 40
    run.stop()
    assert run.status == "stopped" and len(run.frame()) == run.lanes[0].steps_done


class CallCounter:
    """Python-level calls (sys.setprofile's 'call' events) between consecutive reads of `mark` (a C function the
    loop calls once per step) in frames named `frame`, on every thread started while it counts."""

    def __init__(self, mark: str, frame: str):
        self.mark, self.frame, self.steps, self.calls = mark, frame, [], 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self.calls += 1
        elif event == "c_call" and getattr(arg, "__name__", "") == self.mark and frame.f_code.co_name == self.frame:
            self.steps.append(self.calls)
            self.calls = 0

    def typical(self) -> float:
        return float(np.median(self.steps[5:]))


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed"])
def test_a_plain_step_makes_no_more_python_calls_than_the_bare_loop(mode):
    # What the harness adds between two steps on a CPU is mostly cold Python (a call ~1 us right after the training
    # work): a race lane's plain step calls its driver's host_plain once, which calls the training work once; the
    # bare loop (bench.overhead's) calls GradScaler's three no-op methods and a null context instead.
    import sys
    import threading

    from bench.overhead import BareLoop

    config = RunConfig(workload="digits_mlp", size="small", batch_size=16, modes=(mode,), steps=120,
                       intra_op_threads=1, device="cpu")
    runner = CallCounter("item", "plain")  # host_plain's step reads its loss once, as it keeps the step
    threading.setprofile(runner)
    try:
        run = finished(config)
    finally:
        threading.setprofile(None)
    assert run.status == "finished" and run.lanes[0].plain
    bare, loop = CallCounter("item", "steps"), BareLoop(config, mode)  # the loss read: once a step
    sys.setprofile(bare)
    try:
        loop.steps(60)
    finally:
        sys.setprofile(None)
    assert len(runner.steps) > 60 and len(bare.steps) == 60
    assert runner.typical() <= bare.typical(), (runner.typical(), bare.typical())
