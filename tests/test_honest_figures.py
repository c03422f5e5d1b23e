"""Measuring must not change what is measured (issue 10), on real torch on a CPU: fp32 gradient norms, per-lane
memory that other lanes do not move, the runner's in-flight path (figures that reach the host later, as on CUDA),
fused Adam, GPU sizes and the marked step estimate. The same checks on a GPU are in test_cuda.py."""

from __future__ import annotations

import math
import time
import weakref

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from amp_core.config import SIZES, ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.diagnostics.cost import StepEstimate, estimate_step, step_flops
from amp_core.probes.memory import SavedTensorsProbe
from amp_core.race import step as step_module
from amp_core.race.runner import Run, build_lane_state
from amp_core.race.step import train_step
from amp_core.telemetry import HostMeter, Meter, Window
from amp_core.telemetry.sampled import grad_norms
from amp_core.workloads import WORKLOADS, check_launch
from amp_core.workloads.base import Data, Workload

GRADS = 100_000
GRAD_VALUE = 300.0
TRUE_NORM = GRAD_VALUE * math.sqrt(GRADS)  # 94,868.3


def finished(config: RunConfig) -> Run:
    run = Run(config).start()
    run.join(120)
    assert not run.alive
    return run


# --- gradient norms in fp32 ------------------------------------------------------------------------------------
def test_fp16_gradient_norm_is_finite_in_fp32():
    grads = [torch.full((GRADS,), GRAD_VALUE, dtype=torch.float16)]
    assert not torch.isfinite(torch._foreach_norm(grads)[0])  # what an fp16 norm gives
    per_param, total = grad_norms(grads)
    assert per_param.dtype == total.dtype == torch.float32
    assert total.item() == pytest.approx(TRUE_NORM, rel=1e-3)


class LinearInW(Workload):
    """loss = 300 * sum(w): every gradient element is exactly 300, whatever w is (in fp16 too)."""

    name = "linear_in_w"
    sizes = {"small": {}}

    def load_data(self, config) -> Data:
        return Data(torch.zeros(16, 1), torch.zeros(16, 1), "nothing to learn")

    def build_model(self, size, data):
        class W(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(GRADS))

            def forward(self, x):
                return (self.w * GRAD_VALUE).sum() + 0 * x.sum()

        return W()

    def loss(self, output, target):
        return output


def test_sixteen_true_clipping_acts_on_a_norm_fp16_cannot_hold(monkeypatch):
    monkeypatch.setitem(WORKLOADS, "linear_in_w", LinearInW())
    config = RunConfig(workload="linear_in_w", modes=("16-true",), optimizer="sgd", lr=1.0, grad_clip=1.0)
    data = WORKLOADS["linear_in_w"].load_data(config)
    lane = build_lane_state(config, 0, "16-true", WORKLOADS["linear_in_w"].build_model("small", data),
                            WORKLOADS["linear_in_w"], "cpu")
    result = train_step(lane, data.sample(torch.Generator().manual_seed(0), 4), 0)
    assert result.grad_norm == pytest.approx(TRUE_NORM, rel=1e-3)
    # Clipped to norm 1: each of the 1e5 elements moved by lr * 300 / 94,868 (unclipped it would be 300).
    w = lane.model.w.detach().float()
    assert torch.allclose(w, torch.full_like(w, -1 / math.sqrt(GRADS)), rtol=1e-2)


# --- a lane's memory figure is its own ---------------------------------------------------------------------------
def test_a_lanes_memory_figure_is_the_same_alone_and_in_a_three_lane_race():
    alone = finished(RunConfig(workload="digits_mlp", modes=("bf16-mixed",), steps=30, device="cpu")).frame()
    race = finished(RunConfig(workload="digits_mlp", modes=("32-true", "bf16-mixed", "16-mixed"), steps=30,
                              device="cpu")).frame()
    raced = race[race["mode"] == "bf16-mixed"]
    assert alone["lane_peak_bytes"].notna().all() and raced["lane_peak_bytes"].notna().all()
    assert raced["lane_peak_bytes"].max() == pytest.approx(alone["lane_peak_bytes"].max(), rel=0.02)
    # On a CPU the figure is what the lane holds plus what its forward saves for backward.
    last = alone.iloc[-1]
    assert last["lane_peak_bytes"] == (last["params_bytes"] + last["grads_bytes"] + last["optim_bytes"]
                                       + last["activations_bytes"])
    assert alone["peak_above_start_bytes"].isna().all()  # CUDA only


def test_the_saved_tensor_probe_lets_go_of_the_graph_it_measured():
    # A forward measured without a backward must leave nothing behind: ReLU and Softmax save their own outputs,
    # and a pack hook that handed autograd back the tensor itself tied each to its own grad_fn in a cycle no GC can
    # see (on an H100 every run then kept ~2 activations' worth of memory until the process ran out).
    model = nn.Sequential(nn.Linear(100, 400), nn.ReLU(), nn.Linear(400, 10), nn.Softmax(-1))
    inputs = torch.randn(20, 100)
    saved = []

    class Spy(SavedTensorsProbe):
        def _pack(self, tensor):
            saved.append(weakref.ref(tensor))
            return super()._pack(tensor)

    with Spy(list(model.parameters())) as probe:
        model(inputs).sum()
    assert probe.bytes > 0 and len(saved) >= 4
    alive = [ref() for ref in saved if ref() is not None]
    assert all(tensor is inputs for tensor in alive), [tuple(t.shape) for t in alive]


def test_sampled_probes_run_outside_the_timed_step_and_report_their_own_time():
    frame = finished(RunConfig(workload="digits_mlp", modes=("32-true",), steps=60, device="cpu",
                               memory_every=25, gradstats_every=50)).frame().set_index("step")
    probed = {0, 1, 25, 50}
    assert (frame.loc[sorted(probed), "probe_ms"] > 0).all()
    assert (frame.drop(index=sorted(probed))["probe_ms"] == 0).all()


def test_the_gradient_norm_is_measured_where_a_figure_needs_it():
    run = finished(RunConfig(workload="digits_mlp", modes=("32-true", "16-mixed"), steps=25,
                             device="cpu", grad_norm_every=10, gradstats_every=0,
                             scaler=ScalerConfig(init_scale=2.0**24)))
    frame = run.frame()
    fp32, fp16 = (frame[frame["mode"] == mode].set_index("step") for mode in ("32-true", "16-mixed"))
    assert fp32["grad_norm"].dropna().index.tolist() == [0, 10, 20]  # sampled
    # 16-mixed: fp16 gradients overflow in ordinary training, and GradScaler (unfused) skips such a step with the
    # host knowing at once: the norm is measured on the sampled steps and on every skipped one.
    skipped = fp16.index[fp16["skipped"]].tolist()
    assert skipped, "a first scale of 2^24 overflows digits_mlp's fp16 gradients"
    stepped = fp16[~fp16["skipped"]]
    assert stepped["grad_norm"].dropna().index.tolist() == [step for step in (0, 10, 20) if step not in skipped]
    named = {e.step: e.data["params"] for e in run.events() if e.kind == "skipped_step"}
    assert sorted(named) == skipped and all(named.values())  # each skipped step's parameters named (its norms)
    # 16-true: no scaler catches an overflow, so every step's norm is measured.
    pure = finished(RunConfig(workload="mlp_regression", modes=("16-true",), steps=12, device="cpu", optimizer="sgd",
                              grad_norm_every=10, gradstats_every=0)).frame()
    assert len(pure) == 12 and pure["grad_norm"].notna().all()
    clipped = finished(RunConfig(workload="digits_mlp", modes=("32-true",), steps=5, device="cpu",
                                 grad_clip=1.0)).frame()
    assert clipped["grad_norm"].notna().all()


# --- the in-flight path: figures that reach the host later (CUDA's contract, on real torch on a CPU) ----------
class LaggingMeter(Meter):
    """CudaMeter's contract on a CPU: a step's figures become readable only once `lag` later steps were sent (a
    device that is behind), or when waited for. Test instrumentation of the meter seam (the telemetry's Meter
    interface, implemented whole); the training is real."""

    device = torch.device("cpu")

    def __init__(self, lag: int):
        self.lag = lag
        self.sent = 0
        self.waits = 0

    def open(self, scale=None) -> Window:
        window = Window(time.perf_counter(), scale_before=None if scale is None else float(scale))
        window.done = False  # "forced": waited for
        return window

    def close(self, window) -> None:
        window.end = time.perf_counter()

    def send(self, window, values) -> None:
        window.values = torch.cat([torch.as_tensor(v).detach().reshape(-1).float() for v in values])
        self.sent += 1
        window.start = (window.start, self.sent)

    def ready(self, window) -> bool:
        return window.done or self.sent - window.start[1] >= self.lag

    def wait(self, window) -> None:
        self.waits += 1
        window.done = True

    def peek(self, window):
        assert self.ready(window), "read before the figures were there"
        return window.scale_before, window.values.tolist()

    def on_host(self, window) -> None:
        return None

    def receive(self, window):
        scale, values = self.peek(window)
        return (window.end - window.start[0]) * 1e3, scale, values

    def open_memory_window(self) -> int:
        return 0

    def close_memory_window(self, opened) -> int | None:
        return None if opened is None else 4096

    def lane_peak_bytes(self, held_bytes, peak_bytes):
        return peak_bytes


@pytest.fixture
def lagging(monkeypatch):
    meters: list[LaggingMeter] = []

    def meter_for(device):
        meters.append(LaggingMeter(lag=3))
        return meters[-1]

    monkeypatch.setattr(step_module, "meter_for", meter_for)
    return meters


def test_in_flight_steps_become_the_same_records_in_order(lagging):
    config = RunConfig(workload="digits_mlp", modes=("32-true", "bf16-mixed", "16-mixed"), steps=40, device="cpu",
                       intra_op_threads=1, grad_norm_every=1)
    deferred = finished(config).frame()
    assert lagging and sum(m.sent for m in lagging) == 120
    at_once = Run(config)
    lagging.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_module, "meter_for", lambda device: HostMeter())
        at_once.start().join(120)
    immediate = at_once.frame()
    training = ["lane", "step", "loss", "lr", "scale", "skipped", "grad_norm", "params_bytes", "grads_bytes",
                "optim_bytes", "activations_bytes"]
    for lane in range(3):
        assert deferred[deferred["lane"] == lane]["step"].tolist() == list(range(40))  # each lane in order
    # The same training and the same figures: only when they reached the host differs.
    pd.testing.assert_frame_equal(deferred.sort_values(["lane", "step"])[training].reset_index(drop=True),
                                  immediate.sort_values(["lane", "step"])[training].reset_index(drop=True))
    assert deferred["scale"].notna().sum() == 40  # the 16-mixed lane's scale came through the deferred copies
    # The meter's memory window (on CUDA the allocator's) is what the lane peak adds to the bytes held.
    measured = deferred.dropna(subset=["peak_above_start_bytes"])
    assert (measured["peak_above_start_bytes"] == 4096).all() and measured["step"].min() == 1
    held = measured["params_bytes"] + measured["grads_bytes"] + measured["optim_bytes"]
    assert (measured["lane_peak_bytes"] == held + 4096).all()


def test_plain_steps_whose_figures_arrive_later_record_what_host_steps_record(lagging):
    # CUDA's plain steps (StepDriver.device_plain: the window, the work, the loss sent behind it) on a meter with
    # CUDA's contract: the same records as a host meter's steps (plain ones, and full ones for 16-mixed, whose
    # scaler a host-metered plain step does not take), each lane in order. A first scale of 2^24 makes the fp16
    # lane skip some steps: a skipped plain step takes the full path and names its parameters.
    config = RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed", "16-mixed"), steps=80,
                       device="cpu", intra_op_threads=1, seed=3, scaler=ScalerConfig(init_scale=2.0**24))
    deferred_run = finished(config)
    assert [lane.plain for lane in deferred_run.lanes] == [True, True, True]
    assert sum(m.sent for m in lagging) == 240
    lagging.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_module, "meter_for", lambda device: HostMeter())
        immediate = finished(config).frame()
    deferred = deferred_run.frame()
    training = ["lane", "step", "loss", "lr", "scale", "skipped", "grad_norm", "params_bytes", "optim_bytes"]
    for lane in range(3):
        assert deferred[deferred["lane"] == lane]["step"].tolist() == list(range(80))
    pd.testing.assert_frame_equal(deferred.sort_values(["lane", "step"])[training].reset_index(drop=True),
                                  immediate.sort_values(["lane", "step"])[training].reset_index(drop=True))
    skipped = deferred[deferred["skipped"]]["step"].tolist()
    assert len(skipped) >= 2 and max(skipped) > 1, "the fp16 lane must skip on a plain step"
    named = {e.step: e.data["params"] for e in deferred_run.events() if e.kind == "skipped_step"}
    assert sorted(named) == sorted(skipped) and all(named.values())


def test_a_plain_lane_whose_loss_arrives_nonfinite_stops_there_and_counts_the_steps_it_ran_after(lagging):
    # SGD with a huge LR blows fp32 up within a few plain steps; the loss reaches the host a few steps later (and the
    # plain steps become records in batches): the lane stops on the first non-finite loss, records nothing after it,
    # and its diverged event counts the steps it ran after.
    run = finished(RunConfig(workload="mlp_regression", modes=("32-true",), steps=200, optimizer="sgd", lr=1e4,
                             device="cpu", intra_op_threads=1))
    lane = run.lanes[0]
    assert lane.plain and lane.status == "diverged"
    frame = run.frame()
    first_bad = int(frame["step"][~np.isfinite(frame["loss"])].iloc[0])
    assert first_bad > 1, "the divergence must come on a plain step for this test to mean anything"
    assert frame["step"].tolist() == list(range(first_bad + 1))
    (diverged,) = [e for e in run.events() if e.kind == "diverged"]
    assert diverged.step == first_bad
    assert diverged.data["steps_run_after"] == sum(m.sent for m in lagging) - first_bad - 1 >= 1


def test_divergence_is_noticed_when_the_figures_arrive_and_later_steps_are_dropped(lagging):
    config = RunConfig(workload="mlp_regression", modes=("32-true", "16-true"), steps=40, optimizer="sgd",
                       faults=(FaultSpec(kind="grad_nan", step=5, modes=("16-true",)),), device="cpu")
    run = finished(config)
    fp32, fp16 = run.lanes
    assert fp32.status == "finished" and fp32.steps_done == 40
    assert fp16.status == "diverged" and "loss became nan at step 6" in fp16.error
    frame = run.frame()
    assert frame[frame["lane"] == 1]["step"].tolist() == list(range(7))
    diverged = [e for e in run.events() if e.kind == "diverged"]
    assert len(diverged) == 1 and diverged[0].data["steps_run_after"] >= 1  # it ran on before the loss was read
    kinds = [e.kind for e in run.events() if e.lane == 1]
    assert "nonfinite_grads" in kinds and kinds[-2:] == ["nonfinite_loss", "diverged"]


def test_a_paused_run_shows_every_step_it_made(lagging):
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=100_000,
                        device="cpu")).start()
    deadline = time.monotonic() + 60
    while len(run.sink.records) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run.pause()
    while len(run.sink.records) != sum(meter.sent for meter in lagging):
        assert time.monotonic() < deadline, "a paused run left lane steps unresolved"
        time.sleep(0.01)
    assert run.status == "paused"
    run.stop()
    assert len(run.frame()) == sum(meter.sent for meter in lagging)


@pytest.mark.parametrize("scheduler", ["none", "onecycle"])
def test_fused_adam_skips_on_the_device_and_the_skip_is_read_later(lagging, scheduler):
    n = 7
    config = RunConfig(workload="mlp_regression", modes=("16-mixed",), steps=12, fused_optimizer=True,
                       scheduler=scheduler, faults=(FaultSpec(kind="grad_inf", step=n, param="layer2.bias"),),
                       scaler=ScalerConfig(init_scale=256.0), device="cpu")
    run = finished(config)
    frame = run.frame().set_index("step")
    assert frame.index[frame["skipped"]].tolist() == [n]
    assert frame.loc[n + 1, "scale"] == frame.loc[n, "scale"] / 2
    if scheduler == "onecycle":  # the schedule waited on the skipped step
        assert frame.loc[n + 1, "lr"] == frame.loc[n, "lr"]
    (skip,) = [e for e in run.events() if e.kind == "skipped_step"]
    if scheduler == "onecycle":
        # The schedule needs the skip at once: found-inf was read then (the one sync it costs), and the gradients
        # were still there to count.
        assert skip.data["params"] == [{"param": "layer2.bias", "inf": 1, "nan": 0}]
    else:
        # Read with the other figures: named from the per-parameter norms that travelled with them (the gradients
        # were gone by then).
        assert skip.data["params"] == [{"param": "layer2.bias", "grad_norm": "inf"}]


def test_fused_adam_is_offered_for_adam_and_adamw_only():
    with pytest.raises(ConfigError, match="fused_optimizer: a fused kernel is offered for adam and adamw"):
        RunConfig(optimizer="sgd", fused_optimizer=True)
    check_launch(RunConfig(optimizer="adamw", fused_optimizer=True, device="cpu"))
    run = finished(RunConfig(workload="digits_mlp", modes=("32-true",), steps=5, fused_optimizer=True,
                             device="cpu"))
    assert run.lanes[0].status == "finished"


# --- GPU sizes and the estimate ---------------------------------------------------------------------------------
def test_gpu_sizes_exist_where_they_are_offered():
    assert "xl" in SIZES
    spec = WORKLOADS["tiny_transformer"].sizes["xl"]
    assert (spec["dim"], spec["layers"], spec["heads"], spec["block"]) == (768, 12, 12, 512)
    data = WORKLOADS["tiny_transformer"].load_data(RunConfig(workload="tiny_transformer", size="xl"))
    with torch.device("meta"):
        model = WORKLOADS["tiny_transformer"].build_model("xl", data)
    assert 80e6 < sum(p.numel() for p in model.parameters()) < 90e6  # GPT-2 small without its 50k embeddings
    assert WORKLOADS["checkerboard_cnn"].sizes["xl"]["channels"] > WORKLOADS["checkerboard_cnn"].sizes["large"][
        "channels"]
    with pytest.raises(ConfigError, match="size: digits_mlp has no size 'xl'; it has small, medium, large"):
        check_launch(RunConfig(workload="digits_mlp", size="xl"))


def test_step_flops_are_counted_not_guessed():
    # digits_mlp small at batch 64: forward 2*64*(64*256 + 256*10); backward: fc1's weight grad only (its input
    # needs none), fc2's weight and input grads.
    forward = 2 * 64 * (64 * 256 + 256 * 10)
    backward = 2 * 64 * 64 * 256 + 2 * (2 * 64 * 256 * 10)
    assert step_flops("digits_mlp", "small", 64) == forward + backward


def test_the_estimate_says_it_is_one_and_is_flops_over_a_measured_rate():
    estimate = estimate_step("tiny_transformer", "xl", 16, "32-true", "cpu")
    assert isinstance(estimate, StepEstimate) and "ESTIMATE" in StepEstimate.__doc__
    assert estimate.flops_per_step > 4e12  # ~6 x 85M parameters x 8192 tokens, plus attention
    assert estimate.ms_per_step == pytest.approx(estimate.flops_per_step / estimate.matmul_flops_per_s * 1e3)
    assert estimate.compute_dtype == "float32"
    with pytest.raises(ConfigError, match="size"):
        estimate_step("digits_mlp", "xl", 16, "32-true", "cpu")


def test_a_sampled_statistics_step_that_a_fused_optimizer_skipped_is_not_read_as_a_lost_update(lagging):
    n = 7
    run = finished(RunConfig(workload="mlp_regression", modes=("16-mixed",), steps=10, fused_optimizer=True,
                             gradstats_every=n, faults=(FaultSpec(kind="grad_inf", step=n, param="layer2.bias"),),
                             scaler=ScalerConfig(init_scale=256.0), device="cpu"))
    frame = run.frame().set_index("step")
    assert frame.index[frame["skipped"]].tolist() == [n]
    stats = [s for _, _, step, s in run.grad_stats() if step == n]
    assert stats and all(s.lost_update_fraction is None for s in stats)  # the probe read found-inf (a sync)
    assert all(s.lost_update_fraction is not None for _, _, step, s in run.grad_stats() if step == 0)
