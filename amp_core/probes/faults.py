"""Fault injection for demos: a lane's plan, asked by the step at fixed points; each firing becomes an event."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from amp_core.config import RUN_DEFAULTS, ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.probes.memory import local_tensor
from amp_core.workloads import check_launch


@dataclass(slots=True)
class FaultPlan:
    """The faults that apply to one lane. Empty plans cost nothing on the hot path (`bool(plan)` is False)."""

    faults: tuple[FaultSpec, ...] = ()
    fired: list[tuple[int, FaultSpec]] = field(default_factory=list)
    """(step, fault) for each fault on the first step it acted (read by the runner to write events)."""

    @classmethod
    def for_lane(cls, faults: tuple[FaultSpec, ...], mode: str) -> FaultPlan:
        return cls(tuple(f for f in faults if f.kind != "init_scale" and (not f.modes or mode in f.modes)))

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _active(self, kind: str, step: int):
        for fault in self.faults:
            if fault.kind == kind and fault.active(step):
                if fault.step == step:
                    self.fired.append((step, fault))
                yield fault

    def loss_factor(self, step: int) -> float:
        factor = 1.0
        for fault in self._active("loss_scale", step):
            factor *= fault.factor
        return factor

    def lr_factor(self, step: int) -> float:
        factor = 1.0
        for fault in self._active("lr_scale", step):
            factor *= fault.factor
        return factor

    def scale_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """The loss times the loss_scale faults active at `step` (the loss itself when none is)."""
        if not self.faults:
            return loss
        factor = self.loss_factor(step)
        return loss if factor == 1.0 else loss * factor

    def scale_lr(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Multiply every group's LR by the lr_scale faults active at `step`; returns the factor, for `restore_lr`."""
        factor = self.lr_factor(step) if self.faults else 1.0
        if factor != 1.0:
            for group in optimizer.param_groups:
                group["lr"] *= factor
        return factor

    @staticmethod
    def restore_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
        """Undo `scale_lr` (after the optimizer step)."""
        if factor != 1.0:
            for group in optimizer.param_groups:
                group["lr"] /= factor

    def perturb_batch(self, step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch as this step trains on it: batch_outlier multiplies its floating tensors (inputs, and targets
        where they are values, not class indices) by its factor; a new tuple, the caller's batch is left alone."""
        if not self.faults:
            return batch
        factor = 1.0
        for fault in self._active("batch_outlier", step):
            factor *= fault.factor
        if factor == 1.0:
            return batch
        return tuple(t * factor if t.is_floating_point() else t for t in batch)

    def corrupt_grads(self, step: int, model: torch.nn.Module) -> None:
        """Put inf/NaN into the first element of the named parameter's gradient (of this rank's shard, when sharded)."""
        if not self.faults:
            return
        for kind, value in (("grad_inf", float("inf")), ("grad_nan", float("nan"))):
            for fault in self._active(kind, step):
                param = param_by_name(model, fault.param)
                grad = None if param.grad is None else local_tensor(param.grad)  # sharded: this rank's shard
                if grad is not None and grad.numel():
                    grad.view(-1)[0] = value

    def take_fired(self) -> list[tuple[int, FaultSpec]] | tuple:
        """The faults that fired since the last call (an empty tuple, allocating nothing, on most steps)."""
        if not self.fired:
            return ()
        fired, self.fired = self.fired, []
        return fired


def param_by_name(model: torch.nn.Module, name: str) -> torch.nn.Parameter:
    """The named parameter ('' = the first one); ValueError listing the names if unknown."""
    params = dict(model.named_parameters())
    if not name:
        return next(iter(params.values()))
    if name not in params:
        raise ValueError(f"no parameter {name!r}; this model has {', '.join(params)}")
    return params[name]


def init_scale_override(faults: tuple[FaultSpec, ...], mode: str) -> float | None:
    """The init_scale fault's scale for this lane, if any."""
    for fault in faults:
        if fault.kind == "init_scale" and (not fault.modes or mode in fault.modes):
            return fault.factor
    return None


DEMO_GROWTH_INTERVAL = 50
"""The demo's GradScaler growth interval: short, so the scale climbs back within a few hundred steps."""
DEMO_SNAPSHOTS = 40
"""A demo keeps snapshots over its whole length up to this many per lane (40 x 25 steps: a 1000-step demo), so its
fault's step can be replayed after the run ends (a small model's snapshot is a few hundred KB)."""


def demo_config(*, workload: str, modes: tuple[str, ...], kind: str, step: int, duration: int = 1,
                factor: float = 1.0, param: str = "", steps: int = RUN_DEFAULTS.steps,
                growth_interval: int = DEMO_GROWTH_INTERVAL, gradstats_every: int = 10) -> RunConfig:
    """A RunConfig for a fault demo: one fault (acting on every lane) and a short GradScaler growth interval.

    Raises ConfigError naming the field (e.g. a fault step beyond the run).
    """
    fault = FaultSpec(kind=kind, step=step, duration=duration, factor=factor, param=param)
    if isinstance(steps, int) and kind != "init_scale" and step >= steps:
        raise ConfigError("faults.step", f"step {step} is past the run's last step ({steps - 1}); "
                                         "the fault would never fire")
    from amp_core.workloads import WORKLOADS, param_names

    if kind in ("grad_inf", "grad_nan") and param and workload in WORKLOADS:
        names = param_names(workload)
        if param not in names:
            raise ConfigError("faults.param", f"{workload} has no parameter {param!r}; it has {', '.join(names)}")
    defaults = RunConfig()
    config = RunConfig(workload=workload, modes=tuple(modes), steps=steps, faults=(fault,),
                       scaler=ScalerConfig(growth_interval=growth_interval), gradstats_every=gradstats_every,
                       snapshot_keep=max(defaults.snapshot_keep,
                                         min(DEMO_SNAPSHOTS, steps // defaults.snapshot_every + 1)),
                       name=f"demo: {fault.describe()}")
    check_launch(config)
    return config
