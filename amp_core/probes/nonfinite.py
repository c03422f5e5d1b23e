"""The failing step itself, in attach mode: per-module non-finite flags written on the device during every step
(without a host sync) and read only when the step failed, so the first inf/NaN module is named in the step that
failed, not the next one (in bf16 the failed step has already poisoned the weights, so the next one is useless).

How, and what it costs: a forward hook on each leaf module (one with no children: the modules that compute) reduces its
floating output to one fp32 sum on the device (`torch.sum(out, dtype=float32)`: a sum holding inf or NaN is not
finite) and appends the 0-d tensor to the step's list: one reduction kernel and a Python call per leaf per forward,
no sync, no copy. Nothing is read until a step is known to have failed (a loss or gradient norm that is not finite, or
a step the scaler skipped); then that step's sums are stacked and copied to the host once (a sync on CUDA, at the
moment the Monitor reads its figures anyway). The sums of the last `keep_steps` steps are kept (0-d tensors: a few
hundred bytes per leaf and step, so a CUDA run whose records resolve at a flush still finds them).
A false alarm needs a finite output whose fp32 sum overflows (|sum| > 3.4e38), which only a step that failed anyway
reads. Gradients are not hooked (that would double the cost): a module whose forward stays finite while its gradient
overflows (fp16's usual skip) is left to the layer watch and the replay of the skipped step, which keep the state.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class FirstNonFinite:
    """The first leaf module, in the order their forwards finished, whose output held inf/NaN in a step."""

    step: int
    module: str
    forward_index: int
    """Its position among the step's leaf forwards (0: the first to finish)."""
    leaves_seen: int
    """Leaf forwards recorded in that step."""
    held: str
    """What its output held, read from the sum: "nan", or "inf" (a sum is inf only when an element is, or the sum of
    finite fp32 values passed 3.4e38)."""


class NonfiniteSentinel:
    """Per-leaf non-finite flags of the last few steps of `model`. `step_of()` says which step a forward belongs to
    (a Monitor's steps_done); `close()` takes the hooks off."""

    def __init__(self, model: nn.Module, step_of: Callable[[], int], keep_steps: int = 64):
        self._step_of = step_of
        self._keep = keep_steps
        self._steps: OrderedDict[int, list[tuple[int, torch.Tensor]]] = OrderedDict()
        self._last_failed: int | None = None
        self._streak_named = False
        self.names = [name or "(root)" for name, module in model.named_modules()
                      if not any(True for _ in module.children())]
        leaves = [module for module in model.modules() if not any(True for _ in module.children())]
        self._handles = [module.register_forward_hook(self._hook(index)) for index, module in enumerate(leaves)]

    def _hook(self, index: int):
        def record(module: nn.Module, args: tuple, output) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                step = self._step_of()
                sums = self._steps.get(step)
                if sums is None:
                    sums = self._steps[step] = []
                    while len(self._steps) > self._keep:
                        self._steps.popitem(last=False)
                # Kept on the device: read only if this step fails.
                sums.append((index, torch.sum(output.detach(), dtype=torch.float32)))
        return record

    def first(self, step: int) -> FirstNonFinite | None:
        """The first leaf whose output held inf/NaN in `step` (None: none did, or the step is no longer kept). One
        host copy of the step's sums (a sync on CUDA): call it only for a step that failed."""
        sums = self._steps.get(step)
        if not sums:
            return None
        values = torch.stack([value for _, value in sums]).tolist()
        for position, ((index, _), value) in enumerate(zip(sums, values, strict=True)):
            if not math.isfinite(value):
                return FirstNonFinite(step=step, module=self.names[index], forward_index=position,
                                      leaves_seen=len(sums), held="nan" if math.isnan(value) else "inf")
        return None

    def failed(self, step: int, why: str) -> tuple[str, dict] | None:
        """Step `step` failed (`why`): (message, data) of the `first_nonfinite` event naming its first inf/NaN leaf;
        ("", {}) when it continues a run of failed steps already named (a model whose weights went NaN fails every
        step); None when its sums are not kept or no leaf's output held inf/NaN (the layer watch takes over)."""
        consecutive = self._last_failed is not None and step == self._last_failed + 1
        self._last_failed = step
        if consecutive and self._streak_named:
            return "", {}
        found = self.first(step)
        if found is None:
            self._streak_named = False
            return None
        self._streak_named = True
        message = (f"first inf/NaN: {found.module} (forward output) in the failing step itself (step {step}: {why}; "
                   f"leaf forward {found.forward_index + 1} of {found.leaves_seen}, flagged on the device during the "
                   "step)")
        return message, {"failed_step": step, "watched_step": step, "failure": why, "same_step": True,
                         "module": found.module, "phase": "forward", "source": "device flags",
                         "after_amax": found.held}

    def held(self, step: int) -> bool:
        """Whether the sums of `step` are still kept."""
        return step in self._steps

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._steps.clear()
