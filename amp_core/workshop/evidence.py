"""What a workshop scenario's runs recorded, read through a RunReader (live or stored alike), and the figures its
checks read from the records (final loss, median step time, the scale at a step, the first non-finite loss)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from amp_core.config import FINAL_LOSS_WINDOW, FaultSpec, RunConfig
from amp_core.precision import resolve_device
from amp_core.runs import LaneInfo, RunInfo, RunReader, is_live

FINAL_WINDOW = FINAL_LOSS_WINDOW
"""A lane's final loss: the mean of its last this many finite losses."""


class Waiting(Exception):
    """A check cannot be measured yet: the records it reads are not there (the message says which)."""


@dataclass(slots=True)
class Part:
    """One run of a scenario as its records stand."""

    run_id: str
    config: RunConfig
    info: RunInfo
    """What the reader knows of the run: status, lanes (status, error)."""
    steps: pd.DataFrame
    """Every step record of the run so far."""

    def lane_index(self, mode: str) -> int:
        return self.lane_info(mode).lane

    def lane_info(self, mode: str) -> LaneInfo:
        """The run's first lane of `mode` (KeyError when it has none)."""
        for lane in self.info.lanes:
            if lane.mode == mode:
                return lane
        raise KeyError(f"run {self.run_id} has no {mode} lane")

    def lane(self, mode: str, *, at_least: int = 1) -> pd.DataFrame:
        """The lane's step records by step; Waiting until it has `at_least` of them (a lane that diverged or failed
        has what it has: its early end is what a check reads)."""
        frame = self.steps[self.steps["lane"] == self.lane_index(mode)].sort_values("step").reset_index(drop=True)
        ended_early = self.lane_info(mode).status in ("diverged", "failed")
        if len(frame) < at_least and not (ended_early and len(frame)):
            raise Waiting(f"{at_least} steps of {mode}")
        return frame


@dataclass(slots=True)
class Evidence:
    """A scenario's runs read through a RunReader: each part's config, status and step records; gradient statistics
    on demand."""

    reader: RunReader
    parts: list[Part]
    expected_parts: int
    ended: bool
    """Every run of the scenario has ended (and none is still to start)."""
    device: str = "cpu"
    """The device the scenario's runs train on ('cpu' or a CUDA device): what a device-derived expectation reads."""

    def part(self, index: int) -> Part:
        if index >= len(self.parts):
            raise Waiting(f"run {index + 1} of {self.expected_parts} to start")
        return self.parts[index]

    def grad_stats(self, part: Part, mode: str) -> list[tuple[int, list]]:
        """(step, [GradStats per parameter]) of a lane's sampled steps, in step order."""
        lane = part.lane_index(mode)
        return [(step, self.reader.grad_stats(part.run_id, lane, step))
                for step in self.reader.grad_stat_steps(part.run_id, lane)]


def gather(reader: RunReader, run_ids: list[str], expected_parts: int | None = None, going: bool | None = None,
           device: str | None = None) -> Evidence:
    """The evidence of runs `run_ids` (a scenario's, in order) as the reader holds them now. `going` says whether
    more is to come (a ScenarioLaunch knows: a run still to start, or none when it was stopped); by default, whether
    any of the runs is still going or fewer than `expected_parts` exist. `device`: where the runs train (default: the
    first run's device, else this machine's)."""
    parts = []
    for run_id in run_ids:
        info = reader.run_info(run_id)
        if info is None:
            continue
        steps = reader.steps(run_id)  # after the status: a run it calls ended has every record here
        parts.append(Part(run_id, RunConfig.from_dict(info.config), info, steps))
    expected = len(run_ids) if expected_parts is None else expected_parts
    if going is None:
        going = len(parts) < expected or any(is_live(p.info) for p in parts)
    if device is None:
        device = parts[0].config.device if parts else "auto"
    return Evidence(reader, parts, expected, ended=not going, device=resolve_device(device))


# --- reading figures from records -------------------------------------------------------------------------------
def final_loss(lane: pd.DataFrame, window: int = FINAL_WINDOW) -> float:
    """Mean of the lane's last `window` finite losses (NaN when none is finite)."""
    losses = lane["loss"].to_numpy(dtype=float)
    finite = losses[np.isfinite(losses)]
    return float(finite[-window:].mean()) if finite.size else math.nan


def power_of_two(value: float) -> str:
    """65536 -> '2^16'; other values as they are."""
    if not (value > 0 and math.isfinite(value)):
        return f"{value:g}"
    exponent = math.log2(value)
    return f"2^{int(exponent)}" if exponent.is_integer() else f"{value:.3g}"


def fault_of(config: RunConfig, kind: str) -> FaultSpec:
    for fault in config.faults:
        if fault.kind == kind:
            return fault
    raise KeyError(f"the run has no {kind} fault")


def scale_at(lane: pd.DataFrame, step: int) -> float:
    row = lane[lane["step"] == step]
    if row.empty:
        raise Waiting(f"step {step}")
    return float(row["scale"].iat[0])


def first_nonfinite(lane: pd.DataFrame) -> tuple[int, float] | None:
    bad = lane[~np.isfinite(lane["loss"].to_numpy(dtype=float))]
    return None if bad.empty else (int(bad["step"].iat[0]), float(bad["loss"].iat[0]))


def diverged(part: Part, lane: pd.DataFrame, mode: str) -> bool:
    return part.lane_info(mode).status == "diverged" or first_nonfinite(lane) is not None
