"""A run's lanes and the hooks a Run is extended by (RunHooks): what the race loop (runner.py) steps and calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from amp_core.config import RunConfig
from amp_core.precision import Precision
from amp_core.step import LaneState, build_lane_state
from amp_core.telemetry import LaneTrack

if TYPE_CHECKING:
    from amp_core.runner import Run


class Lane:
    """One precision mode (and seed replicate) inside a run: its training state and its status."""

    def __init__(self, index: int, mode: str, seed: int = 0, replicate: int = 0):
        self.index = index
        self.mode = mode
        self.seed = seed
        """The seed of the lane's initial weights and batches (RunConfig.seed + replicate)."""
        self.replicate = replicate
        """Which seed replicate of its mode the lane is (0 .. RunConfig.seeds - 1)."""
        self.status = "pending"
        """pending | running | finished | stopped | diverged | failed."""
        self.error = ""
        self.steps_done = 0
        self.state: LaneState | None = None
        self.track: LaneTrack | None = None
        """Its records and carried memory figures (telemetry), from the run's setup."""
        self.plain = False
        """Its steps that sample nothing may be plain ones (step.plain_step), decided when the loop begins."""


def divergence_hint(config: RunConfig, precision: Precision) -> str:
    """Why a lane may have diverged, when the config makes it likely (shown with the divergence event)."""
    dtype = precision.param_dtype
    if config.optimizer != "sgd" and torch.tensor(config.eps, dtype=dtype).item() == 0:
        return (f" — Adam's eps={config.eps:g} is 0 in {str(dtype).removeprefix('torch.')}, and its second moment "
                "underflows there too: try eps=1e-4 or SGD for this mode")
    return ""


LaneHook = Callable[["Run", Lane, int], float | None]


@dataclass(slots=True)
class RunHooks:
    """Where a Run is extended — the torchrun race, recipes, replay snapshots, tests — instead of by overriding its
    methods. Every hook runs on the run's own thread, in the order of its list; none may call `st.*`.

    - `build_lane(config, index, mode, base_model, workload, device) -> LaneState`: how a lane's model, optimizer,
      scheduler and scaler are built (default `build_lane_state`; a recipe that builds its own optimizer replaces it);
    - `lane_setup(run, lane)`: once every lane's state is built, for each lane in order (wrap its model:
      `lane.state.bind_model(...)`);
    - `setup_done(run)`: after the "started" event, before the first step (replace `run.generators`, say something);
    - `before_lane_step(run, lane, step)` / `after_lane_step(run, lane, step)`: around each full lane step, the
      lane's batch in `run.batch_of(lane)`; after a failed step `lane.status` is "failed". Between two lane steps the
      lane's model is quiet: a snapshot (`run.snapshot_lane`, or the state itself) can be taken there. A before hook
      that measures returns the host seconds it took (else None): they join the step's probe_ms, outside its step_ms.
      A hook that acts only every N steps says so with an `every` attribute (an int > 0): the steps in between may
      then be plain ones, which no hook sees; a hook without it sees every step (the replay snapshots,
      snapshots.SnapshotHook, are the first before hook when RunConfig.snapshot_every is set; the layer amax,
      layer_amax.LayerAmaxHook, the first after hook when RunConfig.amax_every is);
    - `lane_end(run, lane)`: a lane's state is let go (it failed, diverged or the run ended);
    - `on_divergence(run, lane, why, step)`: a lane's loss went non-finite; default `Run.stop_lane` (torchrun: the
      ranks agree first);
    - `run_end(run)`: the thread's last act, after the final status is set and the records are closed;
    - `lane_meta(run, lane) -> dict`: facts stored with each lane when the run opens, beside its seed (e.g. the FSDP2
      policy it trains under, which Compare names);
    - `describe(run) -> (clause, data)`: once every lane is set up, what the run's `started` event says beyond its
      lanes (a clause of its message, fields of its data).
    """

    build_lane: Callable[..., LaneState] = build_lane_state
    lane_meta: list[Callable[[Run, Lane], dict]] = field(default_factory=list)
    describe: list[Callable[[Run], tuple[str, dict]]] = field(default_factory=list)
    lane_setup: list[Callable[[Run, Lane], None]] = field(default_factory=list)
    setup_done: list[Callable[[Run], None]] = field(default_factory=list)
    before_lane_step: list[LaneHook] = field(default_factory=list)
    after_lane_step: list[LaneHook] = field(default_factory=list)
    on_divergence: Callable[[Run, Lane, str, int], None] | None = None
    lane_end: list[Callable[[Run, Lane], None]] = field(default_factory=list)
    run_end: list[Callable[[Run], None]] = field(default_factory=list)

    def plain_steps(self) -> tuple[int, ...] | None:
        """The every N of each lane-step hook when every one of them acts every N steps only (the steps in between
        may be plain); None when one watches every step."""
        everies = [getattr(hook, "every", None) for hook in (*self.before_lane_step, *self.after_lane_step)]
        return None if None in everies else tuple(everies)


def describe_lanes(config: RunConfig, lanes: list[Lane], bases: list[torch.nn.Module]) -> tuple[str, str, dict]:
    """What a run's `started` event says of its lanes once they are built: (the lanes, the FP8 layers of each FP8
    recipe as clauses, each recipe's report by mode: the replicate-0 lanes whose recipe has options)."""
    what = f"{config.workload} x {', '.join(config.modes)}"
    if config.seeds > 1:
        what += f" x {config.seeds} seeds ({config.seed}-{config.seed + config.seeds - 1})"
    recipes = {lane.mode: lane.state.precision.recipe_report(bases[lane.replicate])
               for lane in lanes if lane.replicate == 0 and lane.state.precision.options}
    skipped = "".join(f"; {recipe}: {len(report['fp8_layers'])} Linear layers in FP8, skipped "
                      f"{', '.join(report['fp8_skipped']) or 'none'}"
                      for recipe, report in recipes.items() if "fp8_layers" in report)
    return what, skipped, recipes
