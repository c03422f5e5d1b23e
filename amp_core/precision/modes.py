"""The precision modes (Lightning's vocabulary) and what each one is: the table every other part of the recipe
machinery reads (param dtype, autocast dtype, GradScaler, TF32), and the questions asked of a mode by name."""

from __future__ import annotations

import contextlib
import functools

import torch

from amp_core.precision.switches import tf32_enabled

NO_CONTEXT = contextlib.nullcontext()  # reusable; one less object per step


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


MODE_SPECS: dict[str, tuple[torch.dtype, torch.dtype | None, bool, bool]] = {
    # mode: (param dtype, autocast dtype, GradScaler, TF32)
    "32-true": (torch.float32, None, False, False),
    "tf32": (torch.float32, None, False, True),
    "16-mixed": (torch.float32, torch.float16, True, False),
    "bf16-mixed": (torch.float32, torch.bfloat16, False, False),
    "16-true": (torch.float16, None, False, False),
    "bf16-true": (torch.bfloat16, None, False, False),
}


@functools.lru_cache(maxsize=16)
def device_type(device: str) -> str:
    return torch.device(device).type  # parsing a device string costs microseconds, on every step


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when there is a GPU, else 'cpu'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def recipe_mode(recipe: str) -> str:
    """The mode a recipe builds on (`bf16-mixed+fp8-rowwise` -> `bf16-mixed`)."""
    return recipe.split("+", 1)[0].strip()


def uses_scaler(mode: str) -> bool:
    """Whether the mode (or the recipe built on it) trains with a GradScaler (skips steps whose gradients
    overflowed)."""
    return MODE_SPECS[recipe_mode(mode)][2]


def is_mixed(mode: str) -> bool:
    """Whether the mode keeps fp32 weights and autocasts its math to 16 bits (16-mixed, bf16-mixed)."""
    return MODE_SPECS[mode][1] is not None


def low_precision_dtype(mode: str) -> torch.dtype | None:
    """The 16-bit dtype the mode computes in (its autocast dtype, or its weights' in a true mode); None for fp32
    modes (32-true, tf32)."""
    param_dtype, autocast_dtype, _, _ = MODE_SPECS[mode]
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


FLOAT64_REFERENCE = "float64"
"""The name of the replay's second reference: fp64 weights and math (not a training mode)."""
