"""The engine's own hooks a RunConfig asks for (replay snapshots, layer amax sampling, compiled lanes), put in front of
the caller's RunHooks (runner.py) when a Run is made, and the ProbeTrack a race lane hands its sampled probes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from amp_core.config import RunConfig
from amp_core.probes.block_sampling import block_sample_probe
from amp_core.probes.layer_amax import LayerAmaxProbe
from amp_core.probes.sampled import ProbeTrack
from amp_core.race.compiled import compile_hooks
from amp_core.race.snapshots import SnapshotHook, SnapshotRing


def with_engine_hooks(hooks, config: RunConfig, snapshots: SnapshotRing):
    """`hooks` (a RunHooks) with what `config` asks of the engine in front: the replay snapshots (into `snapshots`)
    as the first before hook, the layer amax (and a block-scaled lane's block numerics) as the first sampled probes of
    each lane, and the compiled lanes' (compile time kept out of steps)."""
    before = [SnapshotHook(snapshots)] if snapshots.every > 0 else []
    every = config.amax_every
    # A block-scaled lane's GEMM operands are sampled on the same steps as its layers' amax (probes.block_sampling).
    amax = [lambda run, lane: LayerAmaxProbe(every), lambda run, lane: block_sample_probe(every, lane)] \
        if every > 0 else []
    hooks = replace(hooks, before_lane_step=[*before, *hooks.before_lane_step], probes=[*amax, *hooks.probes])
    return compile_hooks(hooks, config)


def lane_probe_track(run: Any, lane: Any) -> ProbeTrack:
    """What a race lane offers its sampled probes (probes.sampled): its model, mode, batch, loss and scale, its events
    in the run's sink. `run` and `lane` are a runner.Run and its lanes.Lane (not imported: the runner imports this
    module). A probe's failure is a warning event, and the lane goes on."""
    state = lane.state
    scaler = state.scaler

    def event(kind: str, message: str, step: int, **data) -> None:
        run.sink.event(kind, message, lane.index, step, **data)

    def failed(what: str, exc: Exception, step: int) -> bool:
        event("warning", f"{what} failed: {type(exc).__name__}: {exc}", step)
        return True

    return ProbeTrack(lane=lane.index, mode=lambda: state.precision.mode, model=state.model, event=event,
                      failed=failed, steps_done=lambda: lane.steps_done,
                      active=lambda: lane.state is not None and lane.status in ("running", "finished"),
                      batch=lambda: run.batch_of(lane), precision=state.precision, loss=state.workload.loss,
                      scale=lambda: scaler.get_scale() if scaler.is_enabled() else None)
