"""The step recorder's batch of host-kept plain steps (StepRecorder.add_host): the same records, hooks and stops as
the steps added one at a time (StepRecorder.add), from figures measured by a real training loop on a CPU."""

from __future__ import annotations

import time

import pandas as pd
import pytest
import torch
from torch import nn

from amp_core.records.sink import RecordSink
from amp_core.telemetry import StepRecorder, StepResult
from amp_core.telemetry.meters import HostMeter


def kept_steps(count: int) -> list[tuple]:
    """HOST_KEPT tuples of `count` real steps of a small regression (window read on the host meter's clock)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    clock, kept = HostMeter.clock, []
    for step in range(count):
        start = clock()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        end = clock()
        kept.append((step, optimizer.param_groups[0]["lr"], start, end, loss.item(), 32 if step % 3 else None,
                     0.001 * step))
    return kept


def recorder_with_hook(stop_at: int | None = None) -> tuple[StepRecorder, object, list[StepResult], list[int]]:
    sink = RecordSink("recorder-test")
    recorder = StepRecorder(sink)
    track = recorder.track(0, "32-true", HostMeter())
    track.held = (1000, 1000, 2000)  # as a memory step before these left them
    seen: list[StepResult] = []
    dropped: list[int] = []

    def hook(hooked_track, result: StepResult) -> None:
        seen.append(result)
        if result.step == stop_at:  # what the runner does when a lane stops
            dropped.append(recorder.drop(hooked_track))

    recorder.on_record.append(hook)
    return recorder, track, seen, dropped


def one_by_one(recorder: StepRecorder, track, kept: list[tuple], wall: float) -> None:
    """The steps through `add`, each its StepResult as the generic path makes it."""
    for step, lr, start, end, value, samples, probe_s in kept:
        recorder.add(track, StepResult(step=step, lr=lr, t_wall_s=end + wall, scaled=False, step_ms=(end - start) * 1e3,
                                       loss=value, skipped=False, probe_ms=probe_s * 1e3, filled=True), samples)
        if track.dropped:
            break


def test_a_batch_of_host_kept_steps_records_what_the_steps_one_at_a_time_record():
    kept = kept_steps(12)
    batch, batch_track, batch_seen, _ = recorder_with_hook()
    batch.add_host(batch_track, kept)
    single, single_track, single_seen, _ = recorder_with_hook()
    wall = time.time() - HostMeter.clock()
    one_by_one(single, single_track, kept, wall)
    got, want = (recorder.sink.records.frame().drop(columns="run_id") for recorder in (batch, single))
    assert len(got) == 12 and list(got["step"]) == list(range(12))
    # Wall-clock times differ by the microseconds between the two `time.time()` reads; every other figure is equal.
    assert (got["t_wall_s"] - want["t_wall_s"]).abs().max() < 1.0
    pd.testing.assert_frame_equal(got.drop(columns="t_wall_s"), want.drop(columns="t_wall_s"))
    assert got["loss"].iloc[-1] < got["loss"].iloc[0]  # real training
    assert got["samples_per_s"].isna().sum() == 4  # the steps with no batch size given
    assert got["params_bytes"].eq(1000).all() and got["optim_bytes"].eq(2000).all()
    assert [r.step for r in batch_seen] == [r.step for r in single_seen] == list(range(12))
    assert all(r.loss == s.loss and r.step_ms == s.step_ms and r.skipped is False
               for r, s in zip(batch_seen, single_seen, strict=True))
    assert batch.sink.events == single.sink.events == []  # finite, unsampled steps leave no event


@pytest.mark.parametrize("stop_at", [0, 5, 11])
def test_a_hook_that_stops_the_lane_stops_the_batch_and_counts_what_it_left_out(stop_at):
    recorder, track, seen, dropped = recorder_with_hook(stop_at)
    recorder.add_host(track, kept_steps(12))
    assert [r.step for r in seen] == list(range(stop_at + 1))
    assert list(recorder.sink.records.frame()["step"]) == list(range(stop_at + 1))
    assert dropped == [11 - stop_at]  # the steps of the batch after the one that stopped it
