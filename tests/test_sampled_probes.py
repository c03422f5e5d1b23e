"""One extension point for a per-step diagnostic (amp_core.probes.sampled): a probe written once runs in a race lane
and in a user's loop under a Monitor, carried by the step driver of each, and records the same thing both ways."""

from __future__ import annotations

import pytest

from amp_core.config import RunConfig
from amp_core.probes.layer_amax import LayerAmaxProbe
from amp_core.probes.layerwatch import LayerWatchProbe
from amp_core.race.runner import Run, RunHooks
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from tests.test_race_vs_monitor import monitored

EVERY = 4


@pytest.fixture
def store(fresh_store) -> RunStore:
    return open_store(fresh_store)


def layer_samples(store, run_id: str) -> dict[int, dict]:
    frame = store.events(run_id)
    return {int(step): data for kind, step, data in zip(frame["kind"], frame["step"], frame["data"], strict=True)
            if kind == "layer_amax"}


@pytest.mark.parametrize("mode", ["32-true", "16-mixed"])
def test_the_layer_watch_records_the_same_in_a_race_lane_and_under_a_monitor(mode, store):
    """The same seeded loop, once as a race lane carrying the layer watch and once as a user's loop whose Monitor
    carries it: each watched step's layer figures (module, output and gradient abs max, the cast shares, the loss
    scale) are equal. (The race's own forward for the saved-tensor bytes, on its memory steps, is not the step's:
    the probe stands aside for it.)"""
    config = RunConfig(workload="mlp_regression", modes=(mode,), steps=3 * EVERY + 1, seed=3, intra_op_threads=1,
                       gradstats_every=0, amax_every=0)
    hooks = RunHooks(probes=[lambda run, lane: LayerWatchProbe(EVERY)])
    run = Run(config, store, hooks=hooks).start()
    run.join(120)
    assert run.status == "finished", [e.message for e in run.events()]
    monitor = monitored(config, store, layers_every=EVERY, probe_budget=0, gradstats_every=0)
    raced, attached = layer_samples(store, run.run_id), layer_samples(store, monitor.run_id)
    assert sorted(raced) == sorted(attached) == list(range(0, config.steps, EVERY))
    for step, data in raced.items():
        other = attached[step]
        assert data["modules"] == other["modules"] and len(data["modules"]) > 1
        for key in ("output_amax", "grad_amax", "shares"):  # one loop, the same batches: the same numbers
            assert data[key] == other[key], (step, key)
        assert data["scale"] == other["scale"] and data["why"] == other["why"] == "sampled"


def test_the_race_s_layer_amax_is_a_probe_its_driver_carries(store):
    """RunConfig.amax_every configures the layer amax probe on each lane's driver (no lane-step hook of its own): its
    samples arrive every N steps, and a lane's probe lets its shadow copy go when the run ends."""
    carried = {}

    def seen(run, lane, step):
        carried[lane.index] = lane.state.driver.sampled

    seen.every = EVERY  # the steps between samples stay plain
    config = RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=2 * EVERY + 1,
                       amax_every=EVERY, gradstats_every=0)
    run = Run(config, store, hooks=RunHooks(after_lane_step=[seen])).start()
    run.join(120)
    assert run.status == "finished", [e.message for e in run.events()]
    assert run.hooks.after_lane_step == [seen]
    assert len(carried) == 2 and all(len(probes) == 1 and isinstance(probes[0], LayerAmaxProbe)
                                     for probes in carried.values())
    assert all(probes[0]._sampler is None for probes in carried.values()), "the shadow copies are let go"
    frame = store.events(run.run_id)
    sampled = sorted((int(lane), int(step)) for kind, lane, step in zip(frame["kind"], frame["lane"], frame["step"],
                                                                        strict=True) if kind == "layer_amax")
    assert sampled == [(lane, step) for lane in (0, 1) for step in (0, EVERY, 2 * EVERY)]
