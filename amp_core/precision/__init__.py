"""Precision recipes: the ONLY place that maps a mode name and its options to behaviour (autocast, scaler, dtypes, TF32,
FP8 matmuls, optimizer-state formats, stochastic rounding, FSDP2 mixed-precision policies). A recipe is
`MODE[+OPTION...]`, e.g. `bf16-mixed+fp8-rowwise`, `32-true+adamw-8bit`, `bf16-true+sr`, `bf16-mixed+reduce-bf16`
(under --fsdp); torchao is imported only when a recipe needs it.

Owns, one concern a module, lowest first: modes.py (the mode table and the questions asked of a mode), compiler.py
(which compiler inductor finds), keep.py (modules kept in fp32), options.py (the recipe options and the recipe
grammar), device.py (what this machine computes natively, whether a recipe runs here), optimizers.py (torchao's
optimizers, fused Adam), lane.py (Precision: how one lane computes), switches.py (process-global torch switches a lane
step depends on) and torchao_logs.py (torchao's expected import noise, dropped). This `__init__` re-exports their
public names: `from amp_core.precision import X` is the engine's way in.

May import: torch, formats/ (the block-scaled options), and the utilities at amp_core's top (imports, torch_private).
Nothing above: no config, workload, race, attach, probe or record (they all read this package).
"""

from __future__ import annotations

from amp_core.precision.compiler import (
    cpp_compiler,
    triton_installed,
)
from amp_core.precision.device import (
    CPU_NATIVE_CHOICES,
    CPU_NATIVE_ENV,
    CpuMath,
    availability,
    cpu_has_native,
    cpu_line,
    cpu_math,
    default_modes,
    device_name,
    recipe_candidates,
    runnable_modes,
    torch_version,
)
from amp_core.precision.keep import (
    KEEP_HELP,
    KEEP_PREFIX,
    is_kept,
    keep_in_fp32,
    keep_output_dtype,
    keep_output_note,
    kept_module_names,
)
from amp_core.precision.lane import (
    Precision,
    compile_option,
    float64_reference,
    get_precision,
)
from amp_core.precision.modes import (
    BASELINE_MODE,
    FLOAT64_REFERENCE,
    MODE_HELP,
    MODE_SPECS,
    MODES,
    NO_CONTEXT,
    device_type,
    is_mixed,
    low_precision_dtype,
    mode_from_dtypes,
    parse_modes,
    recipe_mode,
    resolve_device,
    uses_scaler,
)
from amp_core.precision.optimizers import (
    fused_optimizer_support,
    torchao_adam,
)
from amp_core.precision.options import (
    FP8_DIM_MULTIPLE,
    FP8_MIN_CAPABILITY,
    RECIPE_OPTION_HELP,
    RECIPE_OPTIONS,
    RECIPE_PRESETS,
    CompiledModel,
    Float8Matmuls,
    KeepInFp32,
    OptimizerStates,
    RecipeOption,
    ReduceDtype,
    StochasticRounding,
    fsdp_refusal,
    is_fp8_recipe,
    parse_recipe,
)
from amp_core.precision.torchao_logs import drop_expected_torchao_lines

drop_expected_torchao_lines()  # before any (lazy) torchao import: its loader lines are expected on a CPU

__all__ = [
    "BASELINE_MODE", "CPU_NATIVE_CHOICES", "CPU_NATIVE_ENV", "FLOAT64_REFERENCE", "FP8_DIM_MULTIPLE",
    "FP8_MIN_CAPABILITY", "KEEP_HELP", "KEEP_PREFIX", "MODES", "MODE_HELP", "MODE_SPECS", "NO_CONTEXT",
    "RECIPE_OPTIONS", "RECIPE_OPTION_HELP", "RECIPE_PRESETS", "CompiledModel", "CpuMath", "Float8Matmuls",
    "KeepInFp32", "OptimizerStates", "Precision", "RecipeOption", "ReduceDtype", "StochasticRounding",
    "availability", "compile_option", "cpp_compiler", "cpu_has_native", "cpu_line", "cpu_math", "default_modes",
    "device_name", "device_type", "float64_reference", "fsdp_refusal", "fused_optimizer_support", "get_precision",
    "is_fp8_recipe", "is_kept", "is_mixed", "keep_in_fp32", "keep_output_dtype", "keep_output_note",
    "kept_module_names", "low_precision_dtype", "mode_from_dtypes", "parse_modes", "parse_recipe",
    "recipe_candidates", "recipe_mode", "resolve_device", "runnable_modes", "torch_version", "torchao_adam",
    "triton_installed", "uses_scaler"
]
