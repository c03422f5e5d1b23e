"""A run's lanes: what the race loop (runner.py) steps, and what it says of them."""

from __future__ import annotations

import torch

from amp_core.config import RunConfig
from amp_core.precision import Precision
from amp_core.step import LaneState
from amp_core.telemetry import LaneTrack


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
        """pending | running | compiling (amp_core.compiled) | finished | stopped | diverged | failed."""
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
