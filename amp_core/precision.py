"""Precision modes: the ONLY place that maps a mode name to behaviour (autocast, scaler, dtypes, TF32)."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass

import torch

from amp_core.switches import lane_step_switches, tf32_enabled

_NO_CONTEXT = contextlib.nullcontext()  # reusable; one less object per step

# Lightning's vocabulary, in the order the UI lists them.
MODES: tuple[str, ...] = ("32-true", "tf32", "16-mixed", "bf16-mixed", "16-true", "bf16-true")

BASELINE_MODE = "32-true"
"""The lane every other lane is compared with (speedup, memory ratio, loss delta) when a run has one."""

MODE_HELP: dict[str, str] = {
    "32-true": "fp32 weights and math (the baseline).",
    "tf32": "fp32 weights; matmuls/convs on TF32 tensor cores (CUDA, compute capability >= 8.0).",
    "16-mixed": "fp32 weights; autocast to fp16; GradScaler scales the loss and skips overflowed steps.",
    "bf16-mixed": "fp32 weights; autocast to bf16; no scaler (bf16 has fp32's range).",
    "16-true": "model, gradients and optimizer state all in fp16; no autocast, no scaler.",
    "bf16-true": "model, gradients and optimizer state all in bf16; no autocast, no scaler.",
}


@dataclass(frozen=True, slots=True)
class Precision:
    """How one lane computes: the training step asks this object and never branches on dtype."""

    mode: str
    device: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    uses_scaler: bool
    tf32: bool
    watch_grads: bool = False
    """Gradients can hold inf/NaN in ordinary training (fp16 math): their norm is measured on every step, so a step
    the scaler skipped, or one that applied inf/NaN with no scaler to catch it, names its parameters."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context for forward + loss: autocast in mixed modes, nothing otherwise."""
        if self.autocast_dtype is None:
            return _NO_CONTEXT
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def step_context(self) -> contextlib.AbstractContextManager:
        """Context for a whole lane step. On CUDA: the process-wide step lock, with the TF32 flags (process-global)
        set for this lane and put back afterwards. On a CPU, nothing: TF32 is a CUDA format, and intra-op threads
        are each thread's own (see switches.pin_intra_op_threads)."""
        if self.device_type != "cuda":
            return _NO_CONTEXT
        return lane_step_switches(self.tf32)

    def make_scaler(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                    backoff_factor: float = 0.5, growth_interval: int = 2000) -> torch.amp.GradScaler:
        """A GradScaler that is a no-op (enabled=False) when the mode has none."""
        return torch.amp.GradScaler(
            self.device_type, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=self.uses_scaler,
        )

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move the module to the device and cast its parameters (true modes only change dtype)."""
        return module.to(device=self.device, dtype=self.param_dtype)

    def prepare_input(self, tensor: torch.Tensor) -> torch.Tensor:
        """Move a batch tensor to the device; floating inputs take the parameter dtype."""
        if self.device == "cpu" and tensor.is_cpu and (tensor.dtype is self.param_dtype
                                                       or not tensor.is_floating_point()):
            return tensor  # already where and what it must be: the dispatcher's no-op .to() costs a microsecond
        if tensor.is_floating_point():
            return tensor.to(device=self.device, dtype=self.param_dtype, non_blocking=True)
        return tensor.to(device=self.device, non_blocking=True)

    @property
    def device_type(self) -> str:
        return _device_type(self.device)



@functools.lru_cache(maxsize=16)
def _device_type(device: str) -> str:
    return torch.device(device).type  # parsing a device string costs microseconds, on every step


_SPECS: dict[str, tuple[torch.dtype, torch.dtype | None, bool, bool]] = {
    # mode: (param dtype, autocast dtype, GradScaler, TF32)
    "32-true": (torch.float32, None, False, False),
    "tf32": (torch.float32, None, False, True),
    "16-mixed": (torch.float32, torch.float16, True, False),
    "bf16-mixed": (torch.float32, torch.bfloat16, False, False),
    "16-true": (torch.float16, None, False, False),
    "bf16-true": (torch.bfloat16, None, False, False),
}


def uses_scaler(mode: str) -> bool:
    """Whether the mode trains with a GradScaler (skips steps whose gradients overflowed)."""
    return _SPECS[mode][2]


def is_mixed(mode: str) -> bool:
    """Whether the mode keeps fp32 weights and autocasts its math to 16 bits (16-mixed, bf16-mixed)."""
    return _SPECS[mode][1] is not None


def low_precision_dtype(mode: str) -> torch.dtype | None:
    """The 16-bit dtype the mode computes in (its autocast dtype, or its weights' in a true mode); None for fp32
    modes (32-true, tf32)."""
    param_dtype, autocast_dtype, _, _ = _SPECS[mode]
    dtype = autocast_dtype or param_dtype
    return None if dtype == torch.float32 else dtype


def parse_modes(text: str) -> tuple[str, ...]:
    """'32-true, bf16-mixed' -> ('32-true', 'bf16-mixed'): comma-separated names, blanks dropped. Names are checked
    where a run is configured (RunConfig names the bad one)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def mode_from_dtypes(autocast_dtype: torch.dtype | None, param_dtype: torch.dtype, device_type: str) -> str:
    """The mode a loop trains in, read back from what it uses: its autocast dtype (None: no autocast), its
    parameters' dtype, and on CUDA whether TF32 matmuls are on now."""
    if autocast_dtype is not None:
        return "bf16-mixed" if autocast_dtype == torch.bfloat16 else "16-mixed"
    if param_dtype == torch.float16:
        return "16-true"
    if param_dtype == torch.bfloat16:
        return "bf16-true"
    return "tf32" if device_type == "cuda" and tf32_enabled() else "32-true"


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when there is a GPU, else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def get_precision(mode: str, device: str = "cpu") -> Precision:
    """Mode name -> Precision. Raises ValueError for an unknown or unavailable mode."""
    device = resolve_device(device)
    ok, reason = availability(mode, device)
    if not ok:
        raise ValueError(f"mode {mode!r} cannot run on {device}: {reason}")
    param_dtype, autocast_dtype, scaler, tf32 = _SPECS[mode]
    return Precision(mode=mode, device=device, param_dtype=param_dtype, autocast_dtype=autocast_dtype,
                     uses_scaler=scaler, tf32=tf32, watch_grads=torch.float16 in (param_dtype, autocast_dtype))


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
    if _device_type(device) == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    name = caps.get("cpu_name") or platform.processor() or platform.machine()
    return f"CPU: {name} ({torch.get_num_threads()} threads)"


def availability(mode: str, device: str = "cpu") -> tuple[bool, str]:
    """(ok, reason): whether `mode` can run on `device`, and a note (why not, or a caveat)."""
    if mode not in _SPECS:
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
    dtype = _SPECS[mode][1] or _SPECS[mode][0]
    if dtype == torch.float32:
        return True, "supported"
    try:
        math = cpu_math()
    except ValueError as error:
        return False, str(error)
    if math.has(dtype):
        return True, f"supported ({math.words(dtype)})"
    return True, f"runs, but {math.words(dtype)}: expect it to be slower than fp32"


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


def fused_optimizer_support(device: str = "auto") -> tuple[bool, str]:
    """(ok, reason): whether torch has fused Adam/AdamW kernels for `device` (asked by building one)."""
    device = resolve_device(device)
    try:
        torch.optim.Adam([torch.nn.Parameter(torch.zeros(1, device=device))], fused=True)
    except (RuntimeError, ValueError) as exc:
        return False, f"torch has no fused Adam/AdamW on {device}: {exc}"
    return True, "supported"


FLOAT64_REFERENCE = "float64"
"""The name of the replay's second reference: fp64 weights and math (not a training mode)."""


def float64_reference(device: str = "cpu") -> Precision | None:
    """fp64 weights and math, a replay's reference beside 32-true (amp_core.probes.replay); None on a device without
    float64 math (CPUs and CUDA GPUs have it)."""
    device = resolve_device(device)
    if _device_type(device) not in ("cpu", "cuda"):
        return None
    return Precision(mode=FLOAT64_REFERENCE, device=device, param_dtype=torch.float64, autocast_dtype=None,
                     uses_scaler=False, tf32=False)
