"""The plan search's records: its settings, each trial's seeded race and the report the views print. Apart from
the search (amp_core.diagnostics.plan_search) so the views read a report without reaching the runner."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from amp_core.config import ConfigError

LADDER = {"nvfp4": ("mxfp8", "bf16"), "nvfp4-no-rht": ("mxfp8", "bf16"), "nvfp4-no-sr": ("mxfp8", "bf16"),
          "nvfp4-1d": ("mxfp8", "bf16"), "mxfp8": ("bf16",), "mxfp8-wgrad-hp": ("bf16",),
          "fp8-blockwise": ("bf16",), "fp8-tensorwise": ("fp8-rowwise", "bf16"), "fp8-rowwise": ("bf16",),
          "fp8-rowwise-gw-hp": ("bf16",), "bf16": ("fp32",), "fp16": ("fp32",)}
"""The formats above each target format, nearest first: where a promoted layer goes."""
LAST_K = 20
"""A lane's final loss: the mean of its last this many losses (as the advisor reads it)."""
SEEDS = 3
STEPS = 80


@dataclass(frozen=True, slots=True)
class PlanSearchConfig:
    """One search: a workload, the recipe to reach and the one to train like, and how long it may take."""

    workload: str
    target: str
    """The recipe whose format every layer starts in (e.g. bf16-mixed+nvfp4)."""
    baseline: str = "bf16-mixed"
    """The recipe the plan must train like, within seed noise."""
    size: str = "small"
    budget_s: float = 600.0
    """Seconds it may race (the CLI's `--budget-min` and the page's budget start from this: 10 minutes)."""
    device: str = "auto"
    seeds: int = SEEDS
    steps: int = STEPS
    batch_size: int = 32
    lr: float = 3e-3
    plan_path: str = ""
    """Where the plan is written (default: plan-WORKLOAD-FORMAT.toml here); trials' files beside it."""

    def __post_init__(self) -> None:
        if not (isinstance(self.budget_s, (int, float)) and self.budget_s > 0):
            raise ConfigError("budget_min", f"must be > 0, got {self.budget_s!r}")
        if self.seeds < 2:
            raise ConfigError("seeds", "seed noise needs at least 2 seeds")


@dataclass(frozen=True, slots=True)
class Figures:
    """One recipe's seeded race: final losses per seed, and its median ms/step."""

    recipe: str
    losses: tuple[float, ...]
    ms: float
    run_id: str

    @property
    def mean(self) -> float:
        finite = [x for x in self.losses if math.isfinite(x)]
        return float(np.mean(finite)) if finite else math.nan

    @property
    def sd(self) -> float:
        finite = [x for x in self.losses if math.isfinite(x)]
        return float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan

    @property
    def finite(self) -> int:
        return sum(math.isfinite(x) for x in self.losses)


@dataclass(frozen=True, slots=True)
class Trial:
    number: int
    promoted: tuple[str, ...]
    """The layers promoted in this trial (all at `rung`)."""
    rung: str
    what: str
    figures: Figures
    verdict: str
    """passes | fails: and why."""
    seconds: float

    @property
    def passed(self) -> bool:
        return self.verdict == "passes"


@dataclass(slots=True)
class PlanReport:
    config: PlanSearchConfig
    target_format: str
    candidates: list[str]
    """The Linear layers the target converts (the search's n)."""
    evidence: list[tuple[str, float, float, str]]
    """(layer, lowest operand SNR dB, flush share, why) in the search's order (most hurt first)."""
    threshold_db: float
    evidence_format: str
    baseline: Figures | None = None
    trials: list[Trial] = field(default_factory=list)
    plan: dict[str, str] = field(default_factory=dict)
    """Layer -> the format it was promoted to (the rest stay in the target's)."""
    minimal: list[str] = field(default_factory=list)
    """The 1-minimality proof: one line per promoted layer."""
    found: bool = False
    why: str = ""
    plan_file: str = ""
    plan_recipe: str = ""
    final: dict[str, Figures] = field(default_factory=dict)
    """The final race: baseline, target and the plan lane, same weights, same seeds."""
    flops: dict[str, float] = field(default_factory=dict)
    """Layer -> matmul FLOPs of one step (forward + both backward GEMMs); '(not a Linear)' for attention's etc."""
    device: str = "cpu"
    native: bool = False
    seconds: float = 0.0
    stopped: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.found else 1

    def formats(self) -> dict[str, str]:
        """Every candidate layer's format in the plan."""
        return {name: self.plan.get(name, self.target_format) for name in self.candidates}
