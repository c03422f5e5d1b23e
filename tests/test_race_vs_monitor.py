"""One step driver for the race and the Monitor: the same seeded loop run as a race lane and through a Monitor (the
user's own loop, written here by hand) gives equal records — loss, LR, scale, skips, gradient norms, bytes held —
equal sampled gradient statistics and the same skip and scale events."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from amp_core.attach.monitor import Monitor
from amp_core.config import FaultSpec, RunConfig
from amp_core.precision.switches import pin_intra_op_threads
from amp_core.race.runner import Run
from amp_core.race.step import build_lane_state
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.workloads import WORKLOADS

STEPS = 36
FAULT_STEP, FAULT_FACTOR = 7, 1e6
COLUMNS = ["step", "loss", "lr", "scale", "skipped", "grad_norm", "params_bytes", "grads_bytes", "optim_bytes"]
EVENTS = ("skipped_step", "scale_backoff", "scale_growth", "nonfinite_loss", "nonfinite_grads")


@pytest.fixture
def store(fresh_store) -> RunStore:
    return open_store(fresh_store)


def race(config: RunConfig, store: RunStore) -> Run:
    run = Run(config, store).start()
    run.join(120)
    assert run.status == "finished", [e.message for e in run.events()]
    return run


def monitored(config: RunConfig, store, **settings) -> Monitor:
    """The race lane's training written as a user's loop (the lane's own model, optimizer and scaler, built as the
    race builds them; the same batches; the loss_scale fault as a multiplied loss), recorded by a Monitor on a thread
    with one intra-op thread, as the race's."""
    mode, workload = config.modes[0], WORKLOADS[config.workload]
    data = workload.load_data(config)
    torch.manual_seed(config.seed)
    base = workload.build_model(config.size, data)
    lane = build_lane_state(config, 0, mode, base, workload, "cpu")
    model, optimizer, scaler, precision = lane.model, lane.optimizer, lane.scaler, lane.precision
    out = []

    def loop() -> None:
        pin_intra_op_threads(1)
        generator = torch.Generator().manual_seed(config.seed)
        with Monitor(model, optimizer, scaler=scaler, mode=mode, store=store, **settings) as monitor:
            for step in range(config.steps):
                x, y = data.sample(generator, config.batch_size)
                optimizer.zero_grad(set_to_none=True)
                with precision.forward_context():
                    loss = workload.loss(model(x), y)
                if step == FAULT_STEP and config.faults:
                    loss = loss * FAULT_FACTOR
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                monitor.step(loss, samples=config.batch_size)
        out.append(monitor)

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join(120)
    return out[0]


def events(store: RunStore, run_id: str) -> list[tuple[str, int]]:
    frame = store.events(run_id)
    return [(kind, int(step)) for kind, step in zip(frame["kind"], frame["step"], strict=True) if kind in EVENTS]


def grad_stats(store: RunStore, run_id: str) -> dict[int, list[dict]]:
    """Each sampled step's gradient statistics, without the share of updates lost to rounding (a Monitor, which does
    not see the step begin, cannot measure it)."""
    return {step: [dataclasses.replace(stats, lost_update_fraction=None) for stats in store.grad_stats(run_id, 0, step)]
            for step in store.grad_stat_steps(run_id, 0)}


@pytest.mark.parametrize(("mode", "faults", "grad_norm_every"), [
    ("16-mixed", (FaultSpec(kind="loss_scale", step=FAULT_STEP, duration=1, factor=FAULT_FACTOR),), 1),
    ("bf16-mixed", (), 5),
])
def test_a_race_lane_and_a_monitor_record_the_same_steps(store, mode, faults, grad_norm_every):
    # A 16-mixed race lane measures the gradient norm on every step (its gradients can overflow): the Monitor is
    # asked for the same; probe_budget=0 lets every sampled gradient statistic be taken, as the race does.
    config = RunConfig(workload="mlp_regression", modes=(mode,), steps=STEPS, seed=3, intra_op_threads=1,
                       faults=faults, gradstats_every=10, memory_every=8, grad_norm_every=grad_norm_every)
    run = race(config, store)
    monitor = monitored(config, store, grad_norm_every=grad_norm_every, gradstats_every=10, memory_every=8,
                        probe_budget=0)
    raced = store.steps(run.run_id)[COLUMNS].reset_index(drop=True)
    watched = store.steps(monitor.run_id)[COLUMNS].reset_index(drop=True)
    assert raced["step"].tolist() == list(range(STEPS))
    assert raced.equals(watched), raced.compare(watched) if raced.shape == watched.shape else watched
    if faults:
        assert bool(raced.loc[FAULT_STEP, "skipped"]) and raced["scale"].nunique() > 1
    else:
        assert not raced["skipped"].any() and raced["scale"].isna().all()
    assert raced["grad_norm"].notna().sum() >= STEPS // grad_norm_every - 1  # the faulted step's norm is NaN
    assert events(store, run.run_id) == events(store, monitor.run_id)
    assert not faults or ("skipped_step", FAULT_STEP) in events(store, run.run_id)
    sampled = grad_stats(store, run.run_id)
    assert set(sampled) >= {0, 10, 20, 30} and sampled == grad_stats(store, monitor.run_id)
