"""The engine's own hooks a RunConfig asks for (replay snapshots, layer amax sampling, compiled lanes), put in front of
the caller's RunHooks (runner.py) when a Run is made."""

from __future__ import annotations

from dataclasses import replace

from amp_core.block_sampling import BlockNumericsHook
from amp_core.compiled import compile_hooks
from amp_core.config import RunConfig
from amp_core.layer_amax import LayerAmaxHook
from amp_core.snapshots import SnapshotHook, SnapshotRing


def with_engine_hooks(hooks, config: RunConfig, snapshots: SnapshotRing):
    """`hooks` (a RunHooks) with what `config` asks of the engine in front: the replay snapshots (into `snapshots`)
    as the first before hook, the layer amax as the first after hook, and the compiled lanes' (compile time kept out
    of steps)."""
    before = [SnapshotHook(snapshots)] if snapshots.every > 0 else []
    # A block-scaled lane's operand numerics are sampled on the same steps as its layers' amax.
    amax = [LayerAmaxHook(config.amax_every), BlockNumericsHook(config.amax_every)] if config.amax_every > 0 else []
    hooks = replace(hooks, before_lane_step=[*before, *hooks.before_lane_step],
                    after_lane_step=[*amax, *hooks.after_lane_step],
                    lane_end=[*(hook.lane_end for hook in amax), *hooks.lane_end])
    return compile_hooks(hooks, config)
