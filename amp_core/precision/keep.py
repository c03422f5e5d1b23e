"""Keeping modules in fp32 (`+keep:PATTERN`, and `amp_core.fixes.keep_in_fp32` for the user's own loop): the
forward hooks that turn autocast off around a kept module and cast its inputs and outputs, PyTorch's way."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from amp_core.precision.modes import is_mixed, low_precision_dtype, recipe_mode
from amp_core.torch_private import forward_hooks, remove_forward_hooks

KEEP_PREFIX = "keep:"
"""`MODE+keep:PATTERN`: modules whose name matches the glob PATTERN compute in fp32 (repeatable)."""


KEEP_HELP = ("keep:PATTERN: modules whose name (model.named_modules()) matches the glob compute in fp32: outside "
             "autocast with fp32 inputs and an fp32 output (mixed modes), fp32 weights and the output cast back to "
             "the model's dtype (true modes), left out of FP8 conversion.")


class _KeepState(threading.local):
    """Per thread (a replay steps beside the training thread): the autocast exits and output dtypes (None: left
    fp32) of the kept modules whose forward is under way, innermost last."""

    def __init__(self) -> None:
        self.open: list[tuple[contextlib.AbstractContextManager, torch.dtype | None]] = []


_KEEP_STATE = _KeepState()


def _float_dtype(value: Any) -> torch.dtype | None:
    if isinstance(value, torch.Tensor):
        return value.dtype if value.is_floating_point() else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((dtype for dtype in map(_float_dtype, items) if dtype is not None), None)


def _device_of(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return value.device.type
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((kind for kind in map(_device_of, items) if kind is not None), None)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, dict):
        for key in value:  # in place: a model's output class (a dict subclass) stays what it is
            value[key] = _cast_floats(value[key], dtype)
        return value
    if isinstance(value, (list, tuple)):
        cast = [_cast_floats(item, dtype) for item in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    return value


@dataclass(frozen=True, slots=True)
class _KeepEnter:
    """Forward pre-hook of a kept module: autocast off, floating inputs upcast to fp32."""

    restore_dtype: torch.dtype | None
    """The dtype its outputs are cast back to (the rest of a true-mode model's: its next layer's weights are 16-bit);
    None: left fp32, as PyTorch's `autocast(enabled=False)` idiom leaves them (mixed modes: autocast casts them for
    the next op on its list, and an fp32 result beyond the 16-bit range is not turned into inf at the boundary)."""

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        device_type = _device_of((args, kwargs)) or next((p.device.type for p in module.parameters()), "cpu")
        off = torch.autocast(device_type=device_type, enabled=False)
        off.__enter__()
        _KEEP_STATE.open.append((off, self.restore_dtype))
        return _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)


@dataclass(frozen=True, slots=True)
class _KeepExit:
    """Forward hook of a kept module (always called, so autocast comes back on after an exception too): autocast back
    on, outputs cast back only in a true 16-bit model (`_KeepEnter.restore_dtype`)."""

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        off, restore = _KEEP_STATE.open.pop()
        off.__exit__(None, None, None)
        return _cast_floats(output, restore) if restore is not None and output is not None else None


def is_kept(module: torch.nn.Module) -> bool:
    """Whether `module` carries the keep-in-fp32 hooks (`keep_in_fp32`)."""
    return any(isinstance(hook, _KeepEnter) for hook in forward_hooks(module))


def kept_module_names(model: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """The names (`named_modules()`) that `patterns` (fnmatch globs) match, in the model's order. ValueError for a
    pattern that matches nothing, naming the closest module names."""
    names = [name for name, _ in model.named_modules() if name]
    matched: dict[str, None] = {}
    for pattern in patterns:
        hits = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3) or names[:3]
            raise ValueError(f"+{KEEP_PREFIX}{pattern} matches no module of {type(model).__name__}; closest: "
                             f"{', '.join(close) or '(it has no submodules)'}")
        matched.update(dict.fromkeys(hits))
    return [name for name in names if name in matched]


def keep_output_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype kept modules' outputs are cast back to in `model`: the 16-bit dtype its parameters (or buffers) are
    held in (a true 16-bit model, whose next layer computes in that dtype; modules kept already are fp32 and not
    asked), else None (fp32 weights: a mixed mode or fp32; a kept module's output stays fp32)."""
    return next((t.dtype for t in (*model.parameters(), *model.buffers())
                 if t.dtype in (torch.float16, torch.bfloat16)), None)


def keep_output_note(recipe: str) -> str:
    """What a kept module hands on in `recipe`, in words (the bisect's report and the printed fix say it): its fp32
    output as it is (mixed modes), or cast back to the model's 16-bit dtype (true modes) — where an output that is
    itself out of that range needs its consumer kept too."""
    mode = recipe_mode(recipe)
    low = low_precision_dtype(mode)
    if low is None:
        return f"{mode} computes in fp32: nothing is kept"
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[low]
    if is_mixed(mode):
        return (f"in {mode} a kept module's output stays fp32: autocast casts it to {name} only for the next op on "
                "its list, so an fp32 result beyond the 16-bit range reaches the code after it intact")
    return (f"in {mode} a kept module's output is cast back to {name} (the next layer's weights are {name}): an "
            f"output that is itself out of {name}'s range needs the module that consumes it kept too")


def keep_in_fp32(model: torch.nn.Module, patterns: Iterable[str], *,
                 restore_dtype: torch.dtype | None = None) -> list[str]:
    """Make the modules of `model` matching `patterns` compute in fp32, PyTorch's way (`autocast(enabled=False)`
    around them, inputs upcast): their parameters and buffers become fp32, their floating inputs are upcast and
    autocast is off inside them. In a model with fp32 weights (mixed modes) their outputs stay fp32 and autocast
    decides the dtype of what follows; in a model cast to 16 bits (true modes) they are cast back to that dtype
    (`keep_output_dtype`), since the next layer's weights are 16-bit there. `restore_dtype` casts the outputs to that
    dtype instead, whatever the weights. Keep hooks already on the model are replaced. Returns the names kept;
    ValueError for a pattern that matches nothing (with the closest names)."""
    names = kept_module_names(model, tuple(patterns))
    for module in model.modules():
        remove_forward_hooks(module, (_KeepEnter, _KeepExit))
    restore = restore_dtype or keep_output_dtype(model)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if any(name.startswith(f"{other}.") for other in names):
            continue  # inside a kept module: fp32 already
        module.float()
        module.register_forward_pre_hook(_KeepEnter(restore), with_kwargs=True)
        module.register_forward_hook(_KeepExit(), with_kwargs=True, always_call=True)
    return names
