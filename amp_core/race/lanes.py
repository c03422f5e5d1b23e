"""A run's lanes: what the race loop (runner.py) steps, and what it says of them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from amp_core.config import RunConfig
from amp_core.formats.memory import scale_text
from amp_core.precision import Precision
from amp_core.probes.faults import param_by_name
from amp_core.race.step import LaneState
from amp_core.telemetry import LaneTrack
from amp_core.workloads import Data, Workload


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
        """pending | running | compiling (amp_core.race.compiled) | finished | stopped | diverged | failed."""
        self.error = ""
        self.steps_done = 0
        self.state: LaneState | None = None
        self.track: LaneTrack | None = None
        """Its records and carried memory figures (telemetry), from the run's setup."""
        self.plain = False
        """Its steps that sample nothing may be plain ones, decided when the loop begins."""
        self.plain_step: Callable[[int, tuple, int | None], tuple | None] | None = None
        """A plain lane's plain step (its driver's `plain_step` around `step.plain_work`), made when the loop
        begins."""


def divergence_hint(config: RunConfig, precision: Precision) -> str:
    """Why a lane may have diverged, when the config makes it likely (shown with the divergence event)."""
    dtype = precision.param_dtype
    if config.optimizer != "sgd" and torch.tensor(config.eps, dtype=dtype).item() == 0:
        return (f" — Adam's eps={config.eps:g} is 0 in {str(dtype).removeprefix('torch.')}, and its second moment "
                "underflows there too: try eps=1e-4 or SGD for this mode")
    return ""


def plan_plain_steps(lanes: list[Lane], everies: tuple[int, ...] | None, counts_calls: bool) -> bool:
    """Whether a race may take plain steps, set on each lane as the loop begins: where every lane-step hook acts every
    N steps only (`everies`, RunHooks.plain_steps) and the sink's flush needs no call per step (`counts_calls`: a
    RankSink's does), the steps that sample nothing of a lane that needs nothing else are plain."""
    plain_run = everies is not None and not counts_calls
    for lane in lanes:
        if lane.state is not None:
            lane.plain = lane.state.driver.plain = plain_run and lane.state.plain
            lane.state.driver.also_every = everies or ()
    return plain_run


def run_outcome(lanes: list[Lane], failed_whole: bool, stop_asked: bool) -> str:
    """A run's final status: failed when it failed as a whole or every lane did, else stopped when asked to, else
    finished."""
    if failed_whole or (lanes and all(lane.status == "failed" for lane in lanes)):
        return "failed"
    return "stopped" if stop_asked else "finished"


def build_bases(config: RunConfig, workload: Workload, data: Data) -> list[torch.nn.Module]:
    """Each seed replicate's initial model: every mode of a seed starts from that seed's weights. A fault naming a
    parameter the model lacks fails the run here, at setup, not at the fault's step."""
    bases = []
    for replicate in range(config.seeds):
        torch.manual_seed(config.seed + replicate)
        bases.append(workload.build_model(config.size, data))
    for fault in config.faults:
        if fault.kind in ("grad_inf", "grad_nan"):
            param_by_name(bases[0], fault.param)
    return bases


def started_event(config: RunConfig, lanes: list[Lane], bases: list[torch.nn.Module], device: torch.device,
                  threads: str, described: list[tuple[str, dict]]) -> tuple[str, dict]:
    """A run's `started` event once its lanes are built, as (message, data): the lanes, where they run and on how many
    threads, the FP8 layers of each FP8 recipe, each recipe's report by mode (the replicate-0 lanes whose recipe has
    options), and what the `describe` hooks said (`described`: their clauses and data)."""
    what = f"{config.workload} x {', '.join(config.modes)}"
    if config.seeds > 1:
        what += f" x {config.seeds} seeds ({config.seed}-{config.seed + config.seeds - 1})"
    recipes = {lane.mode: lane.state.precision.recipe_report(bases[lane.replicate])
               for lane in lanes if lane.replicate == 0 and lane.state.precision.options}
    skipped = "".join(f"; {recipe}: {len(report['fp8_layers'])} Linear layers in FP8, skipped "
                      f"{', '.join(report['fp8_skipped']) or 'none'}"
                      for recipe, report in recipes.items() if "fp8_layers" in report)
    skipped += "".join(f"; {recipe}: {len(report['block_layers'])} Linear layers in {report['block_format']}, "
                       f"skipped {', '.join(report['block_skipped']) or 'none'}, scales "
                       f"{scale_text(report['block_scales'])}"
                       for recipe, report in recipes.items() if "block_layers" in report)
    message = f"{what} on {device}; {threads}{skipped}" + "".join(f"; {clause}" for clause, _ in described)
    data = {"intra_op_threads": torch.get_num_threads(), "recipes": recipes}
    return message, data | {key: value for _, extra in described for key, value in extra.items()}
