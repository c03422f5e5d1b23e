"""Replay snapshots on a CPU: each holds the lane's state before its step, in copies of its own (no two snapshots share
a buffer), and a snapshot a replay holds (`lease`) keeps its values when it leaves the ring."""

from __future__ import annotations

import torch

from amp_core.config import RunConfig
from amp_core.race.lanes import build_bases
from amp_core.race.runner import Run, RunHooks
from amp_core.race.snapshots import SnapshotRing
from amp_core.race.step import build_lane_state, train_step
from amp_core.workloads import WORKLOADS


def _pointers(snapshot) -> set[int]:
    return {t.data_ptr() for t in snapshot.model.values()} | {
        t.data_ptr() for state in snapshot.optimizer["state"].values() for t in state.values()
        if isinstance(t, torch.Tensor)}


def test_each_snapshot_holds_the_state_before_its_step_in_copies_of_its_own(no_leaked_threads):
    config = RunConfig(workload="digits_mlp", modes=("32-true", "bf16-mixed"), steps=40, snapshot_every=2,
                       snapshot_keep=3, seed=3)
    before: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def weights_after(run, lane, step) -> None:  # the state the snapshot of the next step must hold
        before[(lane.index, step + 1)] = {k: v.detach().clone() for k, v in lane.state.model.state_dict().items()}

    run = Run(config, hooks=RunHooks(after_lane_step=[weights_after])).start()
    run.join(300)
    assert run.status == "finished"
    for lane in (0, 1):
        assert run.snapshots.steps(lane) == [34, 36, 38]
        for step in run.snapshots.steps(lane):
            snapshot = run.snapshots.nearest(lane, step)
            assert all(torch.equal(snapshot.model[name], before[(lane, step)][name]) for name in snapshot.model)
    held = [_pointers(run.snapshots.nearest(lane, step)) for lane in (0, 1) for step in run.snapshots.steps(lane)]
    assert sum(map(len, held)) == len(set().union(*held))  # no two snapshots share a buffer


def test_a_leased_snapshot_keeps_its_values_when_it_leaves_the_ring():
    config = RunConfig(workload="digits_mlp", modes=("32-true",), batch_size=16)
    workload = WORKLOADS[config.workload]
    data = workload.load_data(config)
    lane = build_lane_state(config, 0, "32-true", build_bases(config, workload, data)[0], workload, "cpu")
    order = torch.Generator().manual_seed(0)
    ring = SnapshotRing(every=1, keep=2)
    for step in range(2):
        ring.take(lane, step, data.sample(order, 16), order)
        train_step(lane, data.sample(order, 16), step)
    with ring.lease(0, 0) as oldest:
        kept = {name: tensor.clone() for name, tensor in oldest.model.items()}
        for step in range(2, 6):  # step 0's snapshot leaves the ring at once
            ring.take(lane, step, data.sample(order, 16), order)
            train_step(lane, data.sample(order, 16), step)
        assert ring.steps(0) == [4, 5]
        assert all(torch.equal(oldest.model[name], kept[name]) for name in kept)
        assert not _pointers(oldest) & (_pointers(ring.nearest(0, 4)) | _pointers(ring.nearest(0, 5)))
