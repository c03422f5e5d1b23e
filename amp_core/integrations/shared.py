"""What the trainer callbacks (amp_core.integrations.transformers, .lightning) share: which precision the model's ops
really ran in, told apart from the one the trainer was asked for, and how a callback's own failure is kept from the
trainer (`callback_failed`). No trainer is imported here."""

from __future__ import annotations

import sys

import torch

from amp_core.attach.guard import reason
from amp_core.attach.monitor import Monitor
from amp_core.config import ConfigError
from amp_core.precision import mode_from_dtypes
from amp_core.records.schema import FP16_WITHOUT_SCALING, PRECISION_NOT_APPLIED
from amp_core.records.store import StoreError

USAGE_ERRORS = (ConfigError, StoreError)
"""What a callback raises into the trainer as it starts (a setting or a store the user must fix); any other failure of
its own is kept from the trainer (`callback_failed`)."""
REDUCED = (torch.float16, torch.bfloat16)
"""Compute dtypes a mixed-precision mode runs its matrix products in."""


class OpDtypes:
    """The dtypes the model's weighted layers (a 2-D+ weight: linear, conv, GPT-2's Conv1D; not embeddings, whose
    output is their table's dtype) really produced under grad until `remove()` (an integration removes them at the
    first optimizer step): forward hooks that read each output's dtype (metadata: no sync)."""

    def __init__(self, model: torch.nn.Module):
        self.seen: set[torch.dtype] = set()
        self._handles = [module.register_forward_hook(self._see) for module in model.modules()
                         if not isinstance(module, torch.nn.Embedding) and not list(module.children())
                         and getattr(module, "weight", None) is not None and module.weight.dim() >= 2]

    def _see(self, module, args, output) -> None:
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.is_floating_point():
            self.seen.add(output.dtype)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The reduced dtype the products ran in (fp16 before bf16 when a model mixed them), else the parameters'."""
        return next((dtype for dtype in REDUCED if dtype in self.seen), param_dtype)


def mode_that_ran(compute_dtype: torch.dtype, param_dtype: torch.dtype, device_type: str) -> str:
    """The mode, in Lightning's names, of a model whose parameters are `param_dtype` and whose products ran in
    `compute_dtype` (a reduced dtype other than the parameters' is autocast's)."""
    autocast = compute_dtype if compute_dtype in REDUCED and compute_dtype != param_dtype else None
    return mode_from_dtypes(autocast, param_dtype, device_type)


DTYPE_WORDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def note_what_ran(monitor: Monitor, asked: str, op_dtypes: OpDtypes, scaled: bool) -> str:
    """Set the Monitor's mode from what ran (before its first step opens the run) and record an event when it is not
    what the trainer was asked for, or when fp16 runs without loss scaling. Returns the mode."""
    param_dtype = next(p.dtype for p in monitor.model.parameters() if p.requires_grad)
    ran = op_dtypes.compute_dtype(param_dtype)
    mode = mode_that_ran(ran, param_dtype, monitor.device.type)
    monitor.mode = mode
    asked_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16-true": torch.float16,
                   "bf16-true": torch.bfloat16}.get(asked)
    if asked_dtype is not None and asked_dtype != ran:
        monitor.note(PRECISION_NOT_APPLIED, f"{DTYPE_WORDS[asked_dtype]} asked ({asked}), not applied: the ops ran in "
                                     f"{DTYPE_WORDS.get(ran, str(ran))} (the run is recorded as {mode})",
                     asked=asked, ran=mode)
    if ran == torch.float16 and not scaled:
        monitor.note(FP16_WITHOUT_SCALING, "fp16 runs without loss scaling (no GradScaler): gradients that underflow "
                                       "fp16 become zero and are not protected", mode=mode)
    return mode


def callback_failed(callback, exc: Exception, trainer: str) -> None:
    """A failure of a callback's own code (not the trainer's): told through its Monitor's guard (an event, one line on
    stderr); a second one switches the callback off (`callback.off`), its run closing as failed with the reason, and
    the training goes on. Before a Monitor exists (it could not be made): one line on stderr, the callback off."""
    monitor = callback.monitor
    if monitor is None:
        callback.off = True
        print(f"AMP Lab {trainer} callback: could not start ({reason(exc)}); it is off for this run, the training goes "
              "on", file=sys.stderr)
        return
    if not monitor.guard.failed(f"the {trainer} callback", exc, monitor.steps_done):
        callback.off = True
        monitor.close("failed", f"the AMP Lab {trainer} callback failed twice, the last time with {reason(exc)}")
