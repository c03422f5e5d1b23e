"""Fault injection for demos: a lane's plan, asked by the step at fixed points; each firing becomes an event."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from amp_core.config import FaultSpec


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

    def corrupt_grads(self, step: int, model: torch.nn.Module) -> None:
        """Put inf/NaN into the first element of the named parameter's gradient."""
        for kind, value in (("grad_inf", float("inf")), ("grad_nan", float("nan"))):
            for fault in self._active(kind, step):
                param = param_by_name(model, fault.param)
                if param.grad is not None:
                    param.grad.view(-1)[0] = value

    def take_fired(self) -> list[tuple[int, FaultSpec]]:
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
