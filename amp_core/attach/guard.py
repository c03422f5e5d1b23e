"""A Monitor's own failures kept from the user's loop: a diagnostic that fails (a probe, the layer watch, a replay, the
store, a page's request, an integration's hook) becomes an event with its reason and one line on stderr, and is
switched off for the run when it fails again; the training goes on and its step records stay complete. The only
error the Monitor raises into the loop is a usage error the user must fix (`usage_error`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

import torch

FAILED_EVENT = "monitor_failed"
"""The event of a diagnostic's failure (data: diagnostic, reason, failures, switched_off)."""
EXTRA_CALL_EVENT = "monitor_extra_call"
"""`Monitor.step` called with no optimizer step since the last call: not recorded."""
MISSED_CALL_EVENT = "monitor_missed_call"
"""Optimizer steps that `Monitor.step` was not called for."""
FAILURES_BEFORE_OFF = 2
"""A diagnostic that fails this often is switched off: once may be a passing state of the model, twice is not."""

Note = Callable[..., None]
"""`note(kind, message, at_step=..., **data)`: records an event of the run (Monitor.note)."""


def reason(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Guard:
    """The failures of one Monitor's diagnostics (see the module's docstring). `label` names the run on stderr."""

    def __init__(self, note: Note, label: str):
        self.note = note
        self.label = label
        self.failures: dict[str, int] = {}
        self.off: set[str] = set()
        self.told: set[str] = set()
        """Things said once on stderr (a diagnostic's failure, a usage warning)."""

    def on(self, diagnostic: str) -> bool:
        """Whether `diagnostic` is still on (it has not failed FAILURES_BEFORE_OFF times)."""
        return diagnostic not in self.off

    def failed(self, diagnostic: str, exc: BaseException, step: int | None = None) -> bool:
        """`diagnostic` raised `exc` (at `step`): an event with the reason, a line on stderr the first time, and the
        diagnostic switched off when it has failed FAILURES_BEFORE_OFF times. Returns whether it stays on."""
        count = self.failures[diagnostic] = self.failures.get(diagnostic, 0) + 1
        stays = count < FAILURES_BEFORE_OFF
        why = reason(exc)
        message = f"{diagnostic} failed ({why}); the training goes on" + (
            "" if stays else f"; {diagnostic} is off for the rest of the run (it failed {count} times)")
        if not stays:
            self.off.add(diagnostic)
        self.say(diagnostic, message)
        # The store's own failure must not end the loop either: the event is lost, the line above says it.
        with contextlib.suppress(Exception):
            self.note(FAILED_EVENT, message, at_step=step, diagnostic=diagnostic, reason=why, failures=count,
                      switched_off=not stays)
        return stays

    def say(self, key: str, message: str) -> None:
        """One line on stderr, once per `key` for the run."""
        if key in self.told:
            return
        self.told.add(key)
        print(f"AMP Lab Monitor ({self.label}): {message}", file=sys.stderr)


def usage_error(loss: object) -> str | None:
    """What is wrong with a loss handed to `Monitor.step`, as a one-line instruction; None: it is usable (a real
    number, or a one-element tensor with a value)."""
    if isinstance(loss, torch.Tensor):
        if loss.is_meta:
            return ("the loss is on the meta device, which holds no value: pass the loss the loop computed on its "
                    "device")
        if loss.numel() != 1:
            return (f"the loss has {loss.numel()} elements (shape {tuple(loss.shape)}): pass one value per step, "
                    "e.g. loss.mean()")
        if loss.is_complex():
            return "the loss is complex: pass a real value"
        return None
    wrong = f"the loss must be a number or a one-element tensor, got {type(loss).__name__}: pass the step's loss"
    try:  # a Python or NumPy number
        float(loss)
    except (TypeError, ValueError):
        return wrong
    return None
