"""Replay snapshots on CUDA add no host sync (issue 28): their copies go to pinned host buffers allocated at the first
snapshot and reused, on a side stream ordered by events. Counted with torch.cuda.set_sync_debug_mode (bench.overhead's
counter) over runs of N and 2N steps with a snapshot every other step, against the same runs without snapshots and
against a bare loop. Skipped without CUDA (no GPU was lent when this was written: it follows the documented API)."""

from __future__ import annotations

import pytest
import torch
from test_cuda import bare_loop, finished, per_step_syncs

from amp_core.config import RunConfig
from amp_core.race.runner import Run, RunHooks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("mode", ["32-true", "bf16-mixed"])
def test_snapshots_add_no_host_sync(mode):
    config = RunConfig(workload="digits_mlp", modes=(mode,), steps=40, device="cuda", gradstats_every=0,
                       memory_every=10**9, snapshot_every=2, snapshot_keep=3)

    def run_for(steps: int, snapshot_every: int):
        return finished(RunConfig.from_dict({**config.to_dict(), "steps": steps, "snapshot_every": snapshot_every}))

    with_snapshots = per_step_syncs(lambda steps: run_for(steps, 2))
    without = per_step_syncs(lambda steps: run_for(steps, 0))
    bare = per_step_syncs(lambda steps: bare_loop(config, mode, steps))
    assert with_snapshots == without == bare == 0, (with_snapshots, without, bare)
    run = run_for(40, 2)
    assert run.snapshots.steps(0) == [34, 36, 38]  # the ring kept its newest three
    copies = next(iter(run.snapshots._pinned.values()))
    snapshot = run.snapshots.nearest(0, 38)
    assert all(t.is_pinned() for t in snapshot.model.values())
    # Every buffer was allocated at the first snapshot (keep + 1 sets), and the ring reuses them: after 20 snapshots,
    # the free buffers are exactly one snapshot's worth.
    assert sum(len(pool) for pool in copies._free.values()) == len(snapshot.model) + sum(
        1 for _ in _state_tensors(snapshot.optimizer))


def _state_tensors(tree):
    if isinstance(tree, torch.Tensor):
        if tree.is_pinned():
            yield tree
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _state_tensors(item)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _state_tensors(item)


def test_a_snapshot_holds_the_state_before_its_step():
    """The side stream's copies see the state as the lane's stream left it before the step, not the step's update
    (which waits for them on the device)."""
    config = RunConfig(workload="digits_mlp", modes=("32-true",), steps=8, device="cuda", snapshot_every=5,
                       snapshot_keep=2, seed=4)
    after_step_4 = {}

    def capture(run, lane, step) -> None:
        if step == 4:  # a host copy (a sync: this test's own), the weights the snapshot of step 5 must hold
            after_step_4.update({name: t.detach().cpu().clone() for name, t in lane.state.model.state_dict().items()})

    run = Run(config, hooks=RunHooks(after_lane_step=[capture])).start()
    run.join(300)
    assert run.status == "finished"
    snapshot = run.snapshots.nearest(0, 5)
    snapshot.copied.synchronize()
    assert snapshot.step == 5 and set(snapshot.model) == set(after_step_4)
    assert all(torch.equal(snapshot.model[name], after_step_4[name]) for name in after_step_4)
    changed = run.snapshots.nearest(0, 7)  # none after 5 in a ring of every 5: the same snapshot
    assert changed is snapshot
