"""The diagnostics' settings (the advisor's, the bisect's) as light dataclasses: the CLI builds its flags' defaults from
them at start-up without importing the tools themselves (the advisor alone costs half a second of imports).

May import: config only. advise.py and bisect.py re-export their class, so `amp_core.diagnostics.advise.AdviseConfig`
still names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from amp_core.config import ADVISE_BUDGET_S, RUN_DEFAULTS, ConfigError

RACE_SEEDS = 3
"""Seed replicates per recipe in the race: the spread across them is the seed noise every verdict is held against."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AdviseConfig:
    """One advice: the workload to advise on and how long it may measure."""

    workload: str
    """A registered workload (built-in or plugin)."""
    size: str = RUN_DEFAULTS.size
    """The workload's size."""
    budget_s: float = ADVISE_BUDGET_S
    """Seconds it may spend measuring (cost probes, race, replays, largest batches); a phase that would overrun it
    is cut short or left out, and the advice says so."""
    device: str = RUN_DEFAULTS.device
    """auto | cpu | cuda."""
    batch_size: int = RUN_DEFAULTS.batch_size
    """Samples per step of every run it makes."""
    candidates: tuple[str, ...] = ()
    """Only these recipes (32-true is always among them); empty: every recipe this device can run."""
    seeds: int = RACE_SEEDS
    """Seed replicates per recipe in the race (2 or more: the seed noise)."""
    plan_dir: str = ""
    """Where the plan search writes a plan for a failing matmul-format candidate (empty: the current directory)."""

    def __post_init__(self) -> None:
        if not isinstance(self.budget_s, (int, float)) or not math.isfinite(self.budget_s) or self.budget_s <= 0:
            raise ConfigError("budget", f"must be a number of minutes > 0, got {self.budget_s / 60!r}")
        if not isinstance(self.seeds, int) or self.seeds < 2:
            raise ConfigError("seeds", f"the race needs at least 2 seeds per recipe (seed noise), got {self.seeds!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class BisectConfig:
    """How a bisect searches and judges."""

    budget: int = 40
    """At most this many trials (the lane as it is, every module kept, and the search's own), not counting the fp32
    reference and the price race; spent before the set is minimal, the best set found is returned and said to be
    possibly not minimal."""
    band_rel: float = 0.1
    """A step's loss is above the fp32 reference's band when it exceeds the reference's loss by more than this share
    of it (bf16 and fp16 noise stays well inside 10 % on the built-ins)."""
    over_band_steps: int = 3
    """This many steps in a row above the band fail a trial (fewer when the window is shorter); also how a slow
    divergence is found in the records when no step is named."""
    price_steps: int = 8
    """Steps of the price race (original lane, fixed lane, 32-true) from the same state."""

    def __post_init__(self) -> None:
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 3:
            raise ConfigError("budget", f"must be a whole number >= 3 (the lane, every module kept, one search trial), "
                                        f"got {self.budget!r}")
        if not self.band_rel > 0:
            raise ConfigError("band_rel", f"must be > 0, got {self.band_rel!r}")
        if self.over_band_steps < 1 or self.price_steps < 1:
            raise ConfigError("over_band_steps", "over_band_steps and price_steps must be >= 1")
