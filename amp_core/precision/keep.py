"""Keeping modules in fp32 (`+keep:PATTERN`, and `amp_core.fixes.keep_in_fp32` for the user's own loop): a kept
module's forward runs inside `autocast(enabled=False)` with its inputs upcast and its outputs cast back, PyTorch's
way, as one with-block that torch.compile traces."""

from __future__ import annotations

import difflib
import fnmatch
import types
from collections.abc import Iterable
from typing import Any

import torch

from amp_core.precision.modes import is_mixed, low_precision_dtype, recipe_mode

KEEP_PREFIX = "keep:"
"""`MODE+keep:PATTERN`: modules whose name matches the glob PATTERN compute in fp32 (repeatable)."""


KEEP_HELP = ("keep:PATTERN: modules whose name (model.named_modules()) matches the glob compute in fp32: outside "
             "autocast with fp32 inputs and an fp32 output (mixed modes), fp32 weights and the output cast back to "
             "the model's dtype (true modes), left out of FP8 conversion.")


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


KEEP_ATTRIBUTE = "_amp_lab_keep"
"""A kept module's attribute: (its forward before it was kept, or None for its class's; the dtype its outputs are
cast back to, or None). Its presence is what `is_kept` asks (formats.recipes asks it by this name)."""


def _kept_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a kept module (bound to it as its `forward`): autocast off and the floating inputs upcast to
    fp32 around its own forward, in one with-block (torch.compile traces it into the graph; autocast comes back on
    after an exception too); the outputs cast back only in a true 16-bit model."""
    inner, restore = getattr(self, KEEP_ATTRIBUTE)
    device_type = _device_of((args, kwargs)) or next((p.device.type for p in self.parameters()), "cpu")
    with torch.autocast(device_type=device_type, enabled=False):
        args, kwargs = _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)
        output = type(self).forward(self, *args, **kwargs) if inner is None else inner(*args, **kwargs)
    return _cast_floats(output, restore) if restore is not None and output is not None else output


def is_kept(module: torch.nn.Module) -> bool:
    """Whether `module` is kept in fp32 (`keep_in_fp32`)."""
    return KEEP_ATTRIBUTE in vars(module)


def _unkeep(module: torch.nn.Module) -> None:
    """`module`'s forward as it was before it was kept."""
    inner, _ = vars(module).pop(KEEP_ATTRIBUTE)
    if inner is None:
        vars(module).pop("forward", None)
    else:
        module.forward = inner


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
        if is_kept(module):
            _unkeep(module)
    restore = restore_dtype or keep_output_dtype(model)
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        if any(name.startswith(f"{other}.") for other in names):
            continue  # inside a kept module: fp32 already
        module.float()
        # Its forward, not hooks: a with-block around it is one autocast switch torch.compile traces, and a copy of
        # the model (copy.deepcopy) keeps it, bound to the copy.
        setattr(module, KEEP_ATTRIBUTE, (vars(module).get("forward"), restore))
        module.forward = types.MethodType(_kept_forward, module)
    return names
