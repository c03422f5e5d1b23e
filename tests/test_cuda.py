"""Honest figures on a CUDA GPU (issue 10), on real runs: no host sync beyond a bare loop's, a lane's memory its own,
TF32 per lane under two concurrent runs, fp32 norms in 16-true. Skipped without CUDA; the lead runs them on a GPU."""

from __future__ import annotations

import math
import threading

import numpy as np
import pandas as pd
import pytest
import torch
from test_honest_figures import GRADS, LinearInW
from test_runner import _figures, _no_op

from amp_core.config import FaultSpec, RunConfig, ScalerConfig
from amp_core.precision import availability, switches
from amp_core.race.runner import Run, RunHooks, build_lane_state
from amp_core.race.step import train_step
from amp_core.telemetry import resolve_step
from amp_core.telemetry.sampled import grad_norms
from amp_core.workloads import WORKLOADS
from amp_core.workloads.digits_mlp import DigitsMLP
from bench.overhead import counting_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SYNC_STEPS = 40


def finished(config: RunConfig, timeout: float = 300) -> Run:
    run = Run(config).start()
    run.join(timeout)
    assert run.status == "finished", [e.message for e in run.events() if e.kind == "error"]
    return run


def per_step_syncs(loop) -> float:
    """(syncs of 2N steps - syncs of N steps) / N: set-up and first-step syncs cancel out. A short uncounted loop
    first: the process's first CUDA work (cuBLAS handles, the caching allocator's first blocks) syncs once only."""
    loop(SYNC_STEPS // 10)
    counts = []
    for steps in (SYNC_STEPS, 2 * SYNC_STEPS):
        with counting_syncs() as count:
            loop(steps)
        counts.append(count[0])
    return (counts[1] - counts[0]) / SYNC_STEPS


def bare_loop(config: RunConfig, mode: str, steps: int) -> None:
    """A user's loop with the same model, data, optimizer and scaler; it logs no loss per step."""
    workload = WORKLOADS[config.workload]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    model = workload.build_model(config.size, data).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, fused=True if config.fused_optimizer else None)
    scaler = torch.amp.GradScaler("cuda", enabled=mode == "16-mixed")
    generator = torch.Generator().manual_seed(config.seed)
    for _ in range(steps):
        x, y = (t.cuda(non_blocking=True) for t in data.sample(generator, config.batch_size))
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=mode == "16-mixed"):
            loss = workload.loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    torch.cuda.synchronize()


@pytest.mark.parametrize(("mode", "fused", "bare_syncs"), [("32-true", False, 0), ("16-mixed", False, 1),
                                                           ("16-mixed", True, 0), ("32-true", True, 0)])
def test_a_run_makes_the_same_host_syncs_per_step_as_a_bare_loop(mode, fused, bare_syncs):
    # Ordinary steps only: sampled probes (gradient statistics, memory) may sync, outside the timed window.
    config = RunConfig(workload="digits_mlp", modes=(mode,), steps=SYNC_STEPS, device="cuda", fused_optimizer=fused,
                       gradstats_every=0, memory_every=10**9, scaler=ScalerConfig(init_scale=256.0))
    bare = per_step_syncs(lambda steps: bare_loop(config, mode, steps))
    runner = per_step_syncs(lambda steps: finished(RunConfig.from_dict({**config.to_dict(), "steps": steps})))
    # The counts are integers over 40 and 80 steps: one sync more or less in a whole loop (the caching allocator
    # growing once, say) moves a per-step figure by 1/40, never by a sync a step.
    assert bare == pytest.approx(bare_syncs, abs=0.05)  # GradScaler.step reads found-inf unless fused: it counts
    assert runner == pytest.approx(bare, abs=0.05)


def test_a_lanes_memory_is_the_same_alone_and_in_a_three_lane_race():
    def lane_peak(modes: tuple[str, ...], mode: str) -> tuple[float, float]:
        frame = finished(RunConfig(workload="tiny_transformer", size="medium", modes=modes, steps=30, batch_size=32,
                                   device="cuda", memory_every=10)).frame()
        lane = frame[frame["mode"] == mode]
        assert lane["peak_above_start_bytes"].iloc[1:].notna().all() and (lane["peak_above_start_bytes"] > 0).any()
        return float(lane["lane_peak_bytes"].max()), float(lane["peak_above_start_bytes"].max())

    race = ("bf16-mixed", "32-true", "16-mixed")
    for mode in ("32-true", "16-mixed"):
        alone, raced = lane_peak((mode,), mode), lane_peak(race, mode)
        assert raced[0] == pytest.approx(alone[0], rel=0.02), (mode, alone, raced)
        assert raced[1] == pytest.approx(alone[1], rel=0.02), (mode, alone, raced)


class TF32Watched(DigitsMLP):
    """digits_mlp whose forward pre-hook counts the forward passes that ran with TF32 on."""

    def __init__(self, name: str, counts: dict[str, int]):
        self.name = name
        self.counts = counts

    def build_model(self, size, data):
        model = super().build_model(size, data)
        counts = self.counts

        def hook(module, args) -> None:
            counts["forwards"] += 1
            counts["tf32"] += switches.tf32_enabled()

        model.register_forward_pre_hook(hook)  # lane copies (deepcopy) keep it
        return model


@pytest.mark.skipif(torch.cuda.is_available() and not availability("tf32", "cuda")[0], reason="needs TF32")
def test_tf32_is_per_lane_under_two_concurrent_runs(monkeypatch):
    fp32_counts, tf32_counts = {"forwards": 0, "tf32": 0}, {"forwards": 0, "tf32": 0}
    monkeypatch.setitem(WORKLOADS, "tf32_watch_fp32", TF32Watched("tf32_watch_fp32", fp32_counts))
    monkeypatch.setitem(WORKLOADS, "tf32_watch_tf32", TF32Watched("tf32_watch_tf32", tf32_counts))
    before = switches._read_tf32()
    runs = [Run(RunConfig(workload=name, modes=(mode,), steps=300, device="cuda"))
            for name, mode in (("tf32_watch_fp32", "32-true"), ("tf32_watch_tf32", "tf32"))]
    go = threading.Barrier(2)
    starters = [threading.Thread(target=lambda r=run: (go.wait(), r.start())) for run in runs]
    for thread in starters:
        thread.start()
    for thread in starters:
        thread.join()
    for run in runs:
        run.join(300)
        assert run.status == "finished"
    assert fp32_counts["forwards"] >= 300 and fp32_counts["tf32"] == 0
    assert tf32_counts["forwards"] >= 300 and tf32_counts["tf32"] == tf32_counts["forwards"]
    assert switches._read_tf32() == before


def test_sixteen_true_norm_is_finite_and_clipping_acts_on_cuda(monkeypatch):
    grads = [torch.full((100_000,), 300.0, dtype=torch.float16, device="cuda")]
    _, total = grad_norms(grads)
    assert total.item() == pytest.approx(300 * math.sqrt(1e5), rel=1e-3)
    monkeypatch.setitem(WORKLOADS, "linear_in_w", LinearInW())
    config = RunConfig(workload="linear_in_w", modes=("16-true",), optimizer="sgd", lr=1.0, grad_clip=1.0,
                       device="cuda")
    data = WORKLOADS["linear_in_w"].load_data(config)
    lane = build_lane_state(config, 0, "16-true", WORKLOADS["linear_in_w"].build_model("small", data),
                            WORKLOADS["linear_in_w"], "cuda")
    result = resolve_step(lane.meter, train_step(lane, data.sample(torch.Generator().manual_seed(0), 4), 0),
                          wait=True)
    assert result.grad_norm == pytest.approx(300 * math.sqrt(GRADS), rel=1e-3)
    w = lane.model.w.detach().float()
    assert torch.allclose(w, torch.full_like(w, -1 / math.sqrt(GRADS)), rtol=1e-2)


@pytest.mark.parametrize("fused", [False, True])
def test_a_cuda_run_records_every_step_and_names_a_skipped_steps_parameter(fused):
    n = 7
    run = finished(RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed", "bf16-mixed"), steps=40,
                             device="cuda", fused_optimizer=fused, scaler=ScalerConfig(init_scale=256.0),
                             faults=(FaultSpec(kind="grad_inf", step=n, param="layer2.bias", modes=("16-mixed",)),)))
    frame = run.frame()
    for lane in range(3):
        records = frame[frame["lane"] == lane]
        assert records["step"].tolist() == list(range(40))
        assert (records["step_ms"] > 0).all() and records["loss"].map(math.isfinite).all()
        assert records["t_wall_s"].is_monotonic_increasing
        assert records["lane_peak_bytes"].iloc[1:].notna().all()
    fp16 = frame[frame["lane"] == 1].set_index("step")
    assert fp16.index[fp16["skipped"]].tolist() == [n]
    assert fp16.loc[n + 1, "scale"] == fp16.loc[n, "scale"] / 2
    (skip,) = [e for e in run.events() if e.kind == "skipped_step"]
    assert [p["param"] for p in skip.data["params"]] == ["layer2.bias"]


def test_plain_cuda_steps_record_what_full_steps_record():
    # On CUDA, 32-true, bf16-mixed and 16-mixed (an unfused GradScaler: the host knows a skip at once) lanes take
    # plain steps between the sampled ones (StepDriver.device_plain: the window, the work and the loss sent, no
    # probes); a skipped step takes the full path. A hook that watches nothing makes every step a full one: the
    # records are the same. A first scale of 2^24 makes the fp16 lane skip its first steps.
    config = RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed", "16-mixed"), steps=80,
                       device="cuda", seed=5, scaler=ScalerConfig(init_scale=2.0**24))
    plain = finished(config)
    full = Run(config, hooks=RunHooks(after_lane_step=[_no_op])).start()
    full.join(300)
    assert full.status == "finished"
    assert [lane.plain for lane in plain.lanes] == [True, True, True]
    assert not any(lane.plain for lane in full.lanes)
    (plain_frame, plain_events), (full_frame, full_events) = _figures(plain), _figures(full)
    assert len(plain_frame) == 3 * 80
    skipped = plain_frame[plain_frame["skipped"]]["step"].tolist()
    assert len(skipped) >= 2 and max(skipped) > 1, "the fp16 lane must skip on a plain step"
    assert sum(e[0] == "skipped_step" for e in plain_events) == len(skipped)
    pd.testing.assert_frame_equal(plain_frame, full_frame)
    assert plain_events == full_events
    assert plain.frame()["step_ms"].gt(0).all()


def test_a_plain_cuda_lane_whose_loss_goes_nonfinite_stops_with_nothing_recorded_after_it():
    # SGD with a huge LR blows fp32 up within a few steps: the loss arrives with the window's figures, after the lane
    # queued more plain steps; the lane stops on the first non-finite loss and records none of the steps after it.
    config = RunConfig(workload="mlp_regression", modes=("32-true",), steps=200, optimizer="sgd", lr=1e4,
                       device="cuda")
    run = Run(config).start()
    run.join(300)
    lane = run.lanes[0]
    assert lane.plain and lane.status == "diverged"
    frame = run.frame()
    losses = frame["loss"]
    first_bad = int(frame["step"][~np.isfinite(losses)].iloc[0])
    assert first_bad > 1, "the divergence must come on a plain step for this test to mean anything"
    assert frame["step"].max() == first_bad and frame["step"].tolist() == list(range(first_bad + 1))
    assert f"at step {first_bad}" in lane.error


@pytest.mark.parametrize("group", [1 << 21, 16])
def test_gradient_statistics_on_cuda_read_back_once_per_group_and_match_the_cpus(monkeypatch, group):
    """A sampled step's gradient statistics on CUDA: the same figures as the CPU's, with one host sync per group (its
    one transfer: no bincount's read of its largest key, no pageable copy of the pieces' sizes)."""
    from test_debugger import _mixed_gradients

    from amp_core.probes import gradstats

    monkeypatch.setattr(gradstats, "GROUP_ELEMENTS", group)
    groups, count = [], gradstats._group_counts
    monkeypatch.setattr(gradstats, "_group_counts", lambda pieces, scale: groups.append(len(pieces)) or count(
        pieces, scale))  # the real counts, each group's call noted
    named = _mixed_gradients()
    on_cpu = gradstats.named_grad_stats(named, 2.0**16)
    on_gpu = [(name, grad.cuda()) for name, grad in named]
    gradstats.named_grad_stats(on_gpu, 2.0**16)  # the process's first use of these kernels, uncounted
    torch.cuda.synchronize()
    groups.clear()
    with counting_syncs() as syncs:
        figures = gradstats.named_grad_stats(on_gpu, 2.0**16)
    assert figures == on_cpu
    assert syncs[0] == len(groups) and len(groups) == (1 if group > 1000 else 11), (syncs[0], groups)
