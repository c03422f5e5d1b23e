"""Replay snapshots on a CPU copy the lane's state into host buffers reused from one snapshot to the next
(snapshots.ReusedCopies): once the ring is full no snapshot allocates, each snapshot still holds the state before its
step, and a snapshot a replay holds (`lease`) keeps its buffers when it leaves the ring."""

from __future__ import annotations

import torch

from amp_core.config import RunConfig
from amp_core.lanes import build_bases
from amp_core.runner import Run, RunHooks
from amp_core.snapshots import SnapshotRing
from amp_core.step import build_lane_state, train_step
from amp_core.workloads import WORKLOADS


def _pointers(snapshot) -> set[int]:
    return {t.data_ptr() for t in snapshot.model.values()} | {
        t.data_ptr() for state in snapshot.optimizer["state"].values() for t in state.values()
        if isinstance(t, torch.Tensor)}


def test_a_full_ring_reuses_its_buffers_and_each_snapshot_holds_the_state_before_its_step(no_leaked_threads):
    config = RunConfig(workload="digits_mlp", modes=("32-true", "bf16-mixed"), steps=40, snapshot_every=2,
                       snapshot_keep=3, seed=3)
    before: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    pointers: list[set[int]] = []

    def weights_after(run, lane, step) -> None:  # the state the snapshot of the next step must hold
        before[(lane.index, step + 1)] = {k: v.detach().clone() for k, v in lane.state.model.state_dict().items()}

    def newest_pointers(run, lane, step) -> None:  # after the SnapshotHook, the ring's first before-hook
        if lane.index == 0 and run.snapshots.due(step):
            pointers.append(_pointers(run.snapshots.nearest(0, step)))

    run = Run(config, hooks=RunHooks(before_lane_step=[newest_pointers], after_lane_step=[weights_after])).start()
    run.join(300)
    assert run.status == "finished"
    for lane in (0, 1):
        assert run.snapshots.steps(lane) == [34, 36, 38]
        for step in run.snapshots.steps(lane):
            snapshot = run.snapshots.nearest(lane, step)
            assert all(torch.equal(snapshot.model[name], before[(lane, step)][name]) for name in snapshot.model)
    held = [_pointers(run.snapshots.nearest(lane, step)) for lane in (0, 1) for step in run.snapshots.steps(lane)]
    assert sum(map(len, held)) == len(set().union(*held))  # no two snapshots share a buffer
    # The first snapshots allocate (step 0's holds no optimizer state yet, and both lanes draw on one pool of buffers)
    # until the rings are full and give back what leaves them (here by lane 0's eighth); the last ten allocated nothing.
    assert len(pointers) == 20 and all(later <= set().union(*pointers[:10]) for later in pointers[10:])
    assert len(set().union(*pointers)) < sum(map(len, pointers)) / 2


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
        for step in range(2, 6):  # step 0's snapshot leaves the ring at once; later ones reuse what the ring frees
            ring.take(lane, step, data.sample(order, 16), order)
            train_step(lane, data.sample(order, 16), step)
        assert ring.steps(0) == [4, 5]
        assert all(torch.equal(oldest.model[name], kept[name]) for name in kept)
        assert not _pointers(oldest) & (_pointers(ring.nearest(0, 4)) | _pointers(ring.nearest(0, 5)))
