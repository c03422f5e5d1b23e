"""What this machine can run: the 16-bit formats this CPU computes natively (torch's detection, or the
AMP_LAB_CPU_NATIVE override), the device's name, and whether a recipe runs here (with a caveat when it runs slowly)."""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass

import torch

from amp_core.formats.plan import PlanOption
from amp_core.formats.recipes import BlockScaledMatmuls
from amp_core.precision.modes import MODE_SPECS, MODES, device_type, resolve_device
from amp_core.precision.options import RECIPE_OPTIONS, CompiledModel, parse_recipe

CPU_NATIVE_ENV = "AMP_LAB_CPU_NATIVE"
"""Overrides which 16-bit formats this CPU computes natively (unset: torch's detection decides)."""


CPU_NATIVE_CHOICES = ("none", "bf16", "fp16", "bf16,fp16")
"""The values CPU_NATIVE_ENV takes."""


_FORMAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True, slots=True)
class CpuMath:
    """Which 16-bit float formats this CPU computes natively: what torch detects, and what counts (the override,
    when CPU_NATIVE_ENV is set)."""

    detected: frozenset[str]
    """Formats ("bf16", "fp16") torch finds instructions for: AVX-512 bf16/fp16 or AMX."""
    native: frozenset[str]
    """Formats that count as native: `detected`, or the override's."""
    override: str = ""
    """CPU_NATIVE_ENV's value when it is set, else ""."""

    def has(self, dtype: torch.dtype) -> bool:
        return _FORMAT_NAMES.get(dtype) in self.native

    def words(self, *dtypes: torch.dtype) -> str:
        """Why `dtypes` (one or both of bf16, fp16, alike in counting as native or not) count as native or not, for
        people ("this CPU has no native bf16 or fp16 math (it converts to fp32 and back)")."""
        names = [_FORMAT_NAMES[dtype] for dtype in dtypes]
        native = self.has(dtypes[0])
        if self.override:
            said = f"has native {' and '.join(names)} math" if native else f"has no native {' or '.join(names)} math"
            seen = [name for name in names if name in self.detected]
            unseen = [name for name in names if name not in self.detected]
            detects = ", ".join(([f"{' and '.join(seen)} instructions"] if seen else [])
                                + ([f"no {' or '.join(unseen)} instructions"] if unseen else []))
            return f"{CPU_NATIVE_ENV}={self.override} says this CPU {said} (torch detects {detects} here)"
        if native:
            return f"this CPU has native {' and '.join(names)} instructions"
        return f"this CPU has no native {' or '.join(names)} math (it converts to fp32 and back)"

    def note(self) -> str:
        """One line when the override is in force (what it says, what torch detects), else ""."""
        if not self.override:
            return ""
        detected = " and ".join(sorted(self.detected)) or "neither bf16 nor fp16"
        return f"{CPU_NATIVE_ENV}={self.override} overrides what torch detects here ({detected})"


def _detected_formats() -> frozenset[str]:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    found = set()
    if caps.get("avx512_bf16") or caps.get("amx_bf16"):
        found.add("bf16")
    if caps.get("avx512_fp16") or caps.get("amx_fp16"):
        found.add("fp16")
    return frozenset(found)


def cpu_math() -> CpuMath:
    """This CPU's native 16-bit formats: detected, or as CPU_NATIVE_ENV says (read on every call, so a test or a
    launch sets it in the environment). ValueError naming the variable for a value it does not take."""
    detected = _detected_formats()
    text = os.environ.get(CPU_NATIVE_ENV)
    if text is None:
        return CpuMath(detected=detected, native=detected)
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if names == ["none"]:
        return CpuMath(detected=detected, native=frozenset(), override=text.strip())
    if not names or len(set(names)) != len(names) or not set(names) <= {"bf16", "fp16"}:
        raise ValueError(f"{CPU_NATIVE_ENV}: unknown value {text!r}; choose from {', '.join(CPU_NATIVE_CHOICES)} "
                         "(or leave it unset: torch detects)")
    return CpuMath(detected=detected, native=frozenset(names), override=text.strip())


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU counts as computing `dtype` natively (else oneDNN/ATen emulate it slowly): torch's detection,
    or CPU_NATIVE_ENV's override. ValueError for a bad override."""
    return cpu_math().has(dtype)


def cpu_line() -> str:
    """One line for a log: the CPU model, its cores, the instructions torch sees that matter to 16-bit math, and what
    counts as native here."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    name = caps.get("cpu_name") or platform.processor() or platform.machine()
    flags = [flag for flag in ("avx2", "fma3", "f16c", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_bf16",
                               "amx_fp16") if caps.get(flag)]
    try:
        math = cpu_math()
        native = ", ".join(sorted(math.native)) or "none"
        counted = f"native 16-bit math: {native} ({math.note() or 'detected'})"
    except ValueError as error:
        counted = str(error)
    return (f"CPU: {name} · {os.cpu_count()} cores · torch {torch.__version__} sees {' '.join(flags) or 'no SIMD'}, "
            f"kernels for {torch.backends.cpu.get_cpu_capability()} · {counted}")


def torch_version() -> str:
    return torch.__version__


def device_name(device: str = "auto") -> str:
    """What the device is, for people: the GPU's name, or the CPU model and its intra-op threads."""
    device = resolve_device(device)
    if device_type(device) == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    name = caps.get("cpu_name") or platform.processor() or platform.machine()
    return f"CPU: {name} ({torch.get_num_threads()} threads)"


def availability(recipe: str, device: str = "cpu") -> tuple[bool, str]:
    """(ok, reason): whether `recipe` (a mode, or `MODE+OPTION...`) can run on `device`, and a note (why not, or a
    caveat: emulated, slow, compiled)."""
    if "+" not in recipe:
        return _mode_availability(recipe, device)
    try:
        mode, options = parse_recipe(recipe)
    except ValueError as error:
        return False, str(error)
    ok, reason = _mode_availability(mode, device)
    if not ok:
        return ok, reason
    if any(option.needs_torchao for option in options) and importlib.util.find_spec("torchao") is None:
        # find_spec asks the path and imports nothing
        return False, "recipe options need torchao: pip install 'amp-lab[recipes]' (torchao==0.18.0)"
    device = resolve_device(device)
    for option in options:
        why = option.refusal(mode, device)
        if why:
            return False, why
    block = next((option for option in options if isinstance(option, BlockScaledMatmuls)), None)
    compiled = next((option for option in options if isinstance(option, CompiledModel)), None)
    if block is not None and compiled is not None and block.compile_refusal(compiled.name, device):
        return False, block.compile_refusal(compiled.name, device)
    plan = next((option for option in options if isinstance(option, PlanOption)), None)
    if plan is not None and compiled is not None and plan.compile_refusal(compiled.name, device):
        return False, plan.compile_refusal(compiled.name, device)
    return True, "; ".join([reason, *(option.note(device) for option in options)])


def _mode_availability(mode: str, device: str) -> tuple[bool, str]:
    if mode not in MODE_SPECS:
        return False, f"unknown mode; choose from {', '.join(MODES)}"
    device = resolve_device(device)
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device on this machine"
        major, _ = torch.cuda.get_device_capability()
        if mode == "tf32" and major < 8:
            return False, f"TF32 needs compute capability >= 8.0 (this GPU: {major}.x)"
        if "bf16" in mode and not torch.cuda.is_bf16_supported():
            return False, "this GPU does not support bf16"
        return True, "supported"
    if kind != "cpu":
        return False, f"device {device!r} is not supported (use cpu or cuda)"
    if mode == "tf32":
        return False, "TF32 is a CUDA tensor-core format (needs a GPU with compute capability >= 8.0)"
    dtype = MODE_SPECS[mode][1] or MODE_SPECS[mode][0]
    if dtype == torch.float32:
        return True, "supported"
    try:
        math = cpu_math()
    except ValueError as error:
        return False, str(error)
    if math.has(dtype):
        return True, f"supported ({math.words(dtype)})"
    return True, f"runs, but {math.words(dtype)}: expect it to be slower than fp32"


def recipe_candidates(device: str = "auto") -> list[tuple[str, bool, str]]:
    """(recipe, runs here, note: why not, or a caveat) of every mode and of every mode with one recipe option that
    makes sense on it (RECIPE_OPTIONS, in the UI's order): what `amp-lab advise` chooses from. Options that need
    --fsdp or take an argument are left out (neither is a choice one lane makes alone); a new option in
    RECIPE_OPTIONS joins here by itself."""
    recipes = list(MODES)
    for option in RECIPE_OPTIONS.values():
        if option.fsdp_only or getattr(option, "takes_argument", False):
            continue
        recipes += [f"{mode}+{option.name}" for mode in MODES if not option.refusal(mode, None)]
    return [(recipe, *availability(recipe, device)) for recipe in recipes]


def runnable_modes(device: str = "auto") -> list[str]:
    """The modes `device` can run, in the order the UI lists them."""
    return [mode for mode in MODES if availability(mode, device)[0]]


def default_modes(device: str = "cpu") -> list[str]:
    """32-true plus the mixed mode that best suits the device (bf16 where native, else fp16)."""
    device = resolve_device(device)
    if device.startswith("cuda"):
        return ["32-true", "bf16-mixed" if availability("bf16-mixed", device)[0] else "16-mixed"]
    try:
        bf16 = cpu_has_native(torch.bfloat16)
    except ValueError:
        return ["32-true"]  # the 16-bit modes are refused until the override is mended (availability says why)
    return ["32-true", "bf16-mixed" if bf16 else "16-mixed"]
