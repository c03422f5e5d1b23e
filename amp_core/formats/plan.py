"""A precision plan: a format per module (`MODE[+OPTION]+plan:FILE`). FILE is TOML mapping globs over
`model.named_modules()` names to a format of the ladder (fp32, bf16, fp16, FP8 tensorwise/rowwise, MXFP8, NVFP4,
blockwise FP8); modules it does not name take the lane's own recipe.

TOML, not JSON: a plan is read and edited by people, and the search writes why it promoted each module as a comment
beside it (JSON has no comments); Python reads it with the standard library (tomllib).

A module takes the format of the first entry whose glob matches its name, else its parent's (so `"blocks.3" = "bf16"`
holds every Linear inside block 3). A module planned fp32 computes as `+keep:` keeps it (autocast off, inputs upcast);
a Linear planned bf16 or fp16 computes its matmul under autocast of that dtype; a Linear planned in a matmul format
becomes that format's layer (torchao's Float8Linear, the block-scaled Linear, or torchao's kernels where the GPU has
them). The lane's own matmul option then converts the Linear layers the plan left alone."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from amp_core.formats.recipes import BlockScaledMatmuls

PLAN_PREFIX = "plan:"
"""`MODE+plan:FILE`: the modules FILE names take its formats."""
DTYPE_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Formats that are a dtype: fp32 keeps the module (as `+keep:`), bf16 and fp16 set its matmuls' autocast dtype."""
PLAN_MODES = ("bf16-mixed", "16-mixed")
"""A plan sets formats under autocast: the mixed modes (the matmul formats need bf16-mixed, as their options do)."""


@dataclass(slots=True)
class _Precision:
    """What this module uses of amp_core.precision, handed over by precision itself when it is imported: precision
    imports this module to parse `+plan:`, so importing precision here would close an import circle."""

    matmul_options: dict = field(default_factory=dict)
    """Format name -> its matmul recipe option (Float8Matmuls, BlockScaledMatmuls), in the UI's order."""
    keep_in_fp32: Callable | None = None
    is_kept: Callable | None = None


PRECISION = _Precision()


def bind_precision(matmul_options: dict, keep_in_fp32: Callable, is_kept: Callable) -> None:
    """Called once by amp_core.precision (see _Precision)."""
    PRECISION.matmul_options, PRECISION.keep_in_fp32, PRECISION.is_kept = dict(matmul_options), keep_in_fp32, is_kept


def matmul_formats() -> tuple[str, ...]:
    """Formats that are a matmul recipe option (fp8-tensorwise, fp8-rowwise, ..., mxfp8, nvfp4, fp8-blockwise)."""
    return tuple(PRECISION.matmul_options)


def plan_formats() -> tuple[str, ...]:
    """Every format a plan may name."""
    return (*DTYPE_FORMATS, *matmul_formats())


def matmul_option(format_name: str):
    """The recipe option of a matmul format, None for a dtype format."""
    return PRECISION.matmul_options.get(format_name)


def is_float8(option) -> bool:
    """Whether a matmul option is torchao's float8 (tensorwise / rowwise), not a block-scaled format."""
    return option is not None and not isinstance(option, BlockScaledMatmuls)


@functools.lru_cache(maxsize=64)
def _read(path: str, stamp: int) -> tuple[tuple[str, str], ...]:
    """The (glob, format) entries of a plan file, in the order written (`stamp`: its mtime, so an edit is re-read)."""
    try:
        table = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"plan file {path}: not TOML ({error})") from None
    extra = sorted(set(table) - {"modules"})
    if extra or not isinstance(table.get("modules"), dict):
        raise ValueError(f"plan file {path}: needs one table [modules] of \"GLOB\" = \"FORMAT\" lines"
                         + (f" (found {', '.join(extra)})" if extra else ""))
    entries = []
    for glob, format_name in table["modules"].items():
        if format_name not in plan_formats():
            raise ValueError(f"plan file {path}: {glob!r} = {format_name!r} is not a format; choose from "
                             f"{', '.join(plan_formats())}")
        entries.append((glob, format_name))
    if not entries:
        raise ValueError(f"plan file {path}: [modules] names no module")
    return tuple(entries)


def read_plan(path: str) -> tuple[tuple[str, str], ...]:
    """The entries of the plan file at `path`; ValueError with one line for a missing or malformed file."""
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        raise ValueError(f"plan file {path}: no such file") from None
    return _read(str(path), stamp)


def write_plan(path: str | Path, formats: dict[str, str], comments: dict[str, str] | None = None,
               header: tuple[str, ...] = ()) -> Path:
    """Write `formats` ({module name or glob: format}) as a plan file, each entry with its comment; returns the
    path."""
    lines = [f"# {line}" for line in header] + ["[modules]"]
    for name, format_name in formats.items():
        note = (comments or {}).get(name, "")
        # TOML basic strings escape as JSON does for the characters module names hold.
        lines.append(f'"{name}" = "{format_name}"' + (f"  # {note}" if note else ""))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@dataclass(frozen=True, slots=True)
class Assignment:
    """What a plan makes of one model: each Linear's format, the modules kept in fp32, what could not take its
    format (and why), and the format of the Linear layers it leaves to the lane."""

    linear: dict[str, str]
    """Linear layer -> the format the plan gives it (fp32 ones inside a kept module are listed as fp32)."""
    fp32: list[str]
    """The outermost modules the plan keeps in fp32."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Linear layer -> why it cannot take its planned format (it stays at the lane's autocast dtype)."""


class PlannedLinear(nn.Linear):
    """An nn.Linear a plan holds at bf16 or fp16 (its matmul under autocast of that dtype, whatever the lane's) or at
    fp32 (autocast off, its input upcast: what `+keep:` does to a module, as a with-block torch.compile traces, where
    a Linear planned fp32 needs no keep of its own); its own class, so the lane's matmul option leaves it alone. It
    holds the original layer's Parameters."""

    def __init__(self, layer: nn.Linear, format_name: str) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.format = format_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if self.format == "fp32":
            with torch.autocast(device_type, enabled=False):
                return super().forward(x.float())
        with torch.autocast(device_type, dtype=DTYPE_FORMATS[self.format]):
            return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.format} (plan)"


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@dataclass(frozen=True, slots=True)
class PlanOption:
    """`+plan:FILE`: the modules FILE names take its formats (see the module's docstring). The file is read when
    the lane is checked or built, not when a stored run's recipe is parsed (a run stays readable without it)."""

    path: str
    """The plan file, as written after `plan:`."""
    fsdp_only = False
    takes_argument = True
    """Not a candidate of its own (`recipe_candidates`): it needs a file."""
    prepares_first = True
    """Built before the lane's matmul option, which then converts only the Linear layers the plan left alone."""

    @property
    def name(self) -> str:
        return f"{PLAN_PREFIX}{self.path}"

    @property
    def help(self) -> str:
        return f"each module named in {self.path} takes its format there"

    @property
    def entries(self) -> tuple[tuple[str, str], ...]:
        return read_plan(self.path)

    @property
    def needs_torchao(self) -> bool:
        """Whether a layer's format is torchao's float8 (the block formats' emulation is torch alone)."""
        try:
            return self.runs_float8
        except ValueError:  # no file to read: refusal() says so
            return False

    @property
    def runs_float8(self) -> bool:
        """Whether the plan puts a Linear in torchao's float8 (a CPU step then runs with oneDNN off)."""
        return any(is_float8(matmul_option(f)) for _, f in self.entries)

    def refusal(self, mode: str, device: str | None) -> str:
        if mode not in PLAN_MODES:
            return f"+{PLAN_PREFIX}FILE sets formats under autocast: use it on {' or '.join(PLAN_MODES)}, not {mode}"
        if device is None:
            return ""
        try:
            entries = self.entries
        except ValueError as error:
            return str(error)
        for glob, format_name in entries:
            option = matmul_option(format_name)
            why = option.refusal(mode, device) if option is not None else self._dtype_refusal(format_name, device)
            if why:
                return f"plan file {self.path}: {glob!r} = {format_name!r} cannot run here: {why}"
        return ""

    @staticmethod
    def _dtype_refusal(format_name: str, device: str) -> str:
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            return f"{device} is not a device AMP Lab runs (use cpu or cuda)"
        if format_name == "bf16" and kind == "cuda" and torch.cuda.is_available() and \
                not torch.cuda.is_bf16_supported():
            return "this GPU does not support bf16"
        return ""

    def fsdp_refusal(self) -> str:
        return "plans under FSDP2 are not raced yet"

    def compile_refusal(self, compile_option: str, device: str) -> str:
        """Why `+compile...` is refused beside this plan on `device` (empty: every format it names compiles as it
        runs here — bf16, fp16, fp32, torchao's float8, a block format with torchao's kernels). A block format it
        names that is emulated here is refused as `+OPTION+compile` is (BlockScaledMatmuls.compile_refusal); a file
        that cannot be read says so."""
        try:
            entries = self.entries
        except ValueError as error:
            return str(error)
        for glob, format_name in entries:
            option = matmul_option(format_name)
            why = option.compile_refusal(compile_option, device) if isinstance(option, BlockScaledMatmuls) else ""
            if why:
                return (f"+{compile_option} with +{self.name} is refused: its {glob!r} = {format_name!r} is emulated "
                        f"here ({device}), and inductor would compile the emulation, not the format's kernels; race "
                        "the plan eager here, or name only bf16, fp16, fp32 and FP8 formats")
        return ""

    def note(self, device: str) -> str:
        counts: dict[str, int] = {}
        try:
            entries = self.entries
        except ValueError as error:  # a stored run's plan file gone: say so, never raise while describing it
            return str(error)
        for _, format_name in entries:
            counts[format_name] = counts.get(format_name, 0) + 1
        return f"plan {self.path}: " + ", ".join(f"{n} entr{'y' if n == 1 else 'ies'} {f}" for f, n in counts.items())

    def assign(self, model: nn.Module, device: str) -> Assignment:
        """What this plan makes of `model`: ValueError for an entry that matches no module (naming the closest)."""
        return assign(model, self.entries, device)

    def prepare_module(self, module: nn.Module, device: str) -> nn.Module:
        plan = self.assign(module, device)
        whole = kept_whole(module, plan)
        if whole:
            already = [name for name, layer in module.named_modules() if PRECISION.is_kept(layer)]
            PRECISION.keep_in_fp32(module, [*already, *whole])  # keep_in_fp32 replaces keeps: keep +keep:'s
        blocks: dict[str, set[str]] = {}
        for name, format_name in plan.linear.items():
            if name in plan.skipped or (format_name == "fp32" and name not in plan.fp32):
                continue  # inside a module kept whole (keep_in_fp32)
            layer = module.get_submodule(name)
            if format_name in DTYPE_FORMATS:
                set_module(module, name, PlannedLinear(layer, format_name))
            elif isinstance(matmul_option(format_name), BlockScaledMatmuls):
                blocks.setdefault(format_name, set()).add(name)
            else:  # torchao's float8 swaps a lone Linear and hands back the new layer
                set_module(module, name, matmul_option(format_name).prepare_module(layer, device))
        for format_name, names in blocks.items():
            module = matmul_option(format_name).convert(module, device, names)
        return module

    def report(self, module: nn.Module, device: str) -> dict:
        """The plan as the run's `started` event records it: file, each Linear's format, fp32 modules, skipped."""
        plan = self.assign(module, device)
        return {"plan_file": self.path, "plan": plan.linear, "plan_fp32": plan.fp32, "plan_skipped": plan.skipped}


def assign(model: nn.Module, entries: tuple[tuple[str, str], ...] | list[tuple[str, str]],
           device: str = "cpu") -> Assignment:
    """The formats `entries` ((glob, format), first match wins, else the parent's) give `model`'s modules."""
    names = [name for name, _ in model.named_modules() if name]
    for glob, _ in entries:
        if not any(fnmatch.fnmatchcase(name, glob) for name in names):
            close = difflib.get_close_matches(glob, names, n=3, cutoff=0.3) or names[:3]
            raise ValueError(f"plan: {glob!r} matches no module of {type(model).__name__}; closest: "
                             f"{', '.join(close) or '(it has no submodules)'}")
    formats: dict[str, str] = {}
    for name in names:
        hit = next((f for glob, f in entries if fnmatch.fnmatchcase(name, glob)), None)
        parent = name.rpartition(".")[0]
        if hit is None and parent in formats:
            hit = formats[parent]
        if hit is not None:
            formats[name] = hit
    fp32 = [name for name, f in formats.items() if f == "fp32" and formats.get(name.rpartition(".")[0]) != "fp32"]
    linear, skipped = {}, {}
    for name, layer in model.named_modules():
        if name not in formats or type(layer) is not nn.Linear:
            continue
        inside_fp32 = any(name == k or name.startswith(f"{k}.") for k in fp32)
        linear[name] = "fp32" if inside_fp32 else formats[name]
        option = matmul_option(linear[name])
        if option is not None:
            _, why = option.plan(layer, device)
            if why:
                skipped[name] = f"{linear[name]}: {why['']}"
    return Assignment(linear=linear, fp32=fp32, skipped=skipped)


def kept_whole(model: nn.Module, plan: Assignment) -> list[str]:
    """The outermost modules `plan` keeps in fp32 that are not a plain Linear: keep_in_fp32 keeps them (a Linear
    planned fp32 is a PlannedLinear)."""
    return [name for name in plan.fp32 if type(model.get_submodule(name)) is not nn.Linear]


def parse_plan_option(name: str, recipe: str) -> PlanOption:
    """`plan:FILE` (one part of `recipe`) -> its option; ValueError for a missing path or one a recipe string cannot
    hold (a `+` or `,` would split it)."""
    path = name[len(PLAN_PREFIX):].strip()
    if not path:
        raise ValueError(f"+{PLAN_PREFIX} in {recipe!r} needs a plan file (TOML: [modules] \"GLOB\" = \"FORMAT\")")
    if "," in path:
        raise ValueError(f"+{PLAN_PREFIX}{path}: a plan file's path cannot hold ',' (modes are comma-separated)")
    return PlanOption(path=path)


def gemm_format(format_name: str) -> str:
    """What `formats_of` reads for a layer planned `format_name` (a matmul option: its element format)."""
    option = matmul_option(format_name)
    if option is None:
        return format_name
    return option.format if isinstance(option, BlockScaledMatmuls) else "fp8"
