"""Op trace of a user's own next step (an attached run's "trace the next step" request): probes.optrace's dispatch-
mode recorder and module tracker, put on the user's model from the end of one `Monitor.step()` to the next, so every
aten op the loop runs in between (forward, backward, the optimizer's step) is recorded with its module and dtypes.

The trace is plain data (optrace.OpTrace) and travels as JSON in the request's answer; `from_answer` rebuilds it for
the Op inspector page.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from amp_core.probes.module_formats import module_formats, plain_format
from amp_core.probes.optrace import (
    BACKWARD,
    FORWARD,
    OUTSIDE,
    ROOT,
    OpRecord,
    OpTrace,
    _OpRecorder,
    _ScopedModuleTracker,
)


class _PhasedRecorder(_OpRecorder):
    """The op recorder with its phase from the tracker (the user's loop runs its own backward)."""

    def _record(self, func, args, kwargs, out) -> None:
        self.phase = BACKWARD if self.tracker.is_bw else FORWARD
        super()._record(func, args, kwargs, out)


class StepTrace:
    """Records every op of the user's loop between `start()` and `stop()` (one step); thread-local, like any
    TorchDispatchMode: start and stop on the loop's thread."""

    def __init__(self, model: nn.Module, label: str, mode: str, device: str):
        self.label, self.mode, self.device = label, mode, device
        self.names = {module: name or ROOT for name, module in model.named_modules()}
        try:  # a plain Linear computes in the mode's dtype; a mode the Monitor could not name leaves it unknown
            plain = plain_format(mode)
        except (KeyError, ValueError):
            plain = ""
        self.formats = {name or ROOT: fmt for name, fmt in module_formats(model, plain).items() if fmt}
        self.tracker = _ScopedModuleTracker(self.names)
        self.recorder = _PhasedRecorder(self.tracker)

    def start(self) -> None:
        self.tracker.__enter__()
        self.recorder.__enter__()

    def stop(self) -> OpTrace:
        self.recorder.__exit__(None, None, None)
        self.tracker.__exit__()
        return OpTrace(label=self.label, mode=self.mode, device=self.device, records=self.recorder.records,
                       modules=[*dict.fromkeys(self.names.values()), OUTSIDE], formats=self.formats)


def to_answer(trace: OpTrace) -> dict[str, Any]:
    """A trace as JSON-able data (a request's answer)."""
    return dataclasses.asdict(trace)


def from_answer(answer: dict[str, Any]) -> OpTrace:
    """What `to_answer` made, as an OpTrace again (shapes and dtype lists back to tuples)."""
    records = []
    for fields in answer["records"]:
        fields = dict(fields)
        for name in ("in_dtypes", "out_dtypes"):
            fields[name] = tuple(fields[name])
        for name in ("in_shapes", "out_shapes"):
            fields[name] = tuple(tuple(shape) for shape in fields[name])
        records.append(OpRecord(**fields))
    return OpTrace(label=answer["label"], mode=answer["mode"], device=answer["device"], records=records,
                   modules=list(answer["modules"]), formats=dict(answer.get("formats", {})))
