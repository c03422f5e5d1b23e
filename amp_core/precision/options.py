"""Recipe options (`MODE+OPTION`): one object per option, each knowing one precision thing (FP8 matmuls,
optimizer-state formats, stochastic rounding, FSDP2's reduce dtype, compiled models, modules kept in fp32), and the
recipe grammar that makes `MODE[+OPTION...]` into a mode and its options. torchao is imported only when an option
needs it."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from amp_core.formats.plan import PLAN_PREFIX, bind_precision, parse_plan_option
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS, BlockScaledMatmuls
from amp_core.imports import heavy_import
from amp_core.precision.compiler import cpp_compiler, triton_installed
from amp_core.precision.keep import KEEP_PREFIX, is_kept, keep_in_fp32
from amp_core.precision.modes import MODE_SPECS, MODES, device_type, low_precision_dtype
from amp_core.precision.switches import float8_matmuls_need_onednn_off

RECIPE_OPTION_HELP: dict[str, str] = {
    "fp8-tensorwise": "FP8 matmuls, one scale per tensor (torchao: fastest; +25% tokens/s on Llama3-8B, 8xH100).",
    "fp8-rowwise": "FP8 matmuls, one scale per row (torchao: more accurate than tensorwise, a little slower).",
    "fp8-rowwise-gw-hp": "FP8 rowwise, but the weight-gradient matmul stays in bf16 (more accurate, slower).",
    "adamw-8bit": "Adam(W) moments in 8 bits with a scale per 256 values (torchao AdamW8bit).",
    "adamw-4bit": "Adam(W) moments in 4 bits with a scale per 128 values (torchao AdamW4bit).",
    "adamw-fp8": "Adam(W) moments in float8 e4m3 with a scale per 256 values (torchao AdamWFp8).",
    "states-bf16": "Adam(W) moments in bf16 (round to nearest): the torchtune#2254 trap, raced on purpose.",
    "sr": "bf16 weights updated with stochastic rounding (torchao _AdamW); use with bf16-true.",
    "reduce-bf16": "FSDP2 reduce-scatters gradients in bf16 (half the traffic of fp32); --fsdp only (torchrun).",
    "reduce-fp32": "FSDP2 reduce-scatters gradients in fp32 (the mixed modes' default, named to race it); --fsdp only.",
    "compile": "the lane's model compiled with torch.compile (inductor); compile time is an event, never step time.",
    "compile-max-autotune": "torch.compile mode='max-autotune': inductor benchmarks kernel choices (a longer compile).",
    "compile-reduce-overhead": "torch.compile mode='reduce-overhead': CUDA graphs replay the step's kernels (CUDA).",
}
"""One line per recipe option (`MODE+OPTION`), in the order the UI lists them (then BLOCK_SCALED_HELP's). FP8 options
go on bf16-mixed."""


RECIPE_PRESETS: dict[str, tuple[str, ...]] = {
    "FP8 rowwise vs bf16": ("bf16-mixed", "bf16-mixed+fp8-rowwise"),
    "8-bit Adam vs fp32 states": ("32-true", "32-true+adamw-8bit"),
    "bf16 weights: plain vs stochastic rounding": ("bf16-true", "bf16-true+sr"),
}
"""Named races of recipes the Train page offers in one click."""


FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with float8 tensor cores (Ada sm89, Hopper sm90 and later)."""


FP8_DIM_MULTIPLE = 16
"""Float8 matmuls need both dims of a Linear's weight divisible by this (torchao's and the hardware's rule)."""


class RecipeOption:
    """One option of a recipe (after the `+`): an object beside Precision that knows one precision thing."""

    name: str
    help: str
    needs_torchao = True
    """Whether the option is built on torchao (the `recipes` extra)."""
    fsdp_only = False
    """Whether the option means something only when each lane's model is sharded with FSDP2 (RunConfig.fsdp)."""

    def refusal(self, mode: str, device: str | None) -> str:
        """Why the option cannot run with `mode` on `device` (empty: it can); `device` None asks only whether the
        combination makes sense."""
        return ""

    def fsdp_refusal(self) -> str:
        """Why the option cannot run on a model sharded with FSDP2 (empty: it can)."""
        return ""

    def note(self, device: str) -> str:
        """What the option does here, for people (a caveat where it runs emulated or slowly)."""
        return self.help

    def prepare_module(self, module: torch.nn.Module, device: str) -> torch.nn.Module:
        return module


def _cuda_capability(device: str) -> tuple[int, int]:
    return torch.cuda.get_device_capability(torch.device(device))


@dataclass(frozen=True, slots=True)
class Float8Matmuls(RecipeOption):
    """`+fp8-*`: torchao's float8 training (`convert_to_float8_training`) on the model's Linear layers, under bf16
    autocast. The weights stay in fp32; each matmul casts its operands to e4m3 (forward) / e5m2 (gradients) with
    dynamic scales, so FP8 saves no memory: it buys speed on FP8 tensor cores."""

    name: str
    torchao_recipe: str
    """torchao's Float8LinearRecipeName value: tensorwise | rowwise | rowwise_with_gw_hp."""
    help: str

    def refusal(self, mode: str, device: str | None) -> str:
        if mode != "bf16-mixed":
            return f"+{self.name} runs on top of bf16-mixed (torchao's float8 training); use bf16-mixed+{self.name}"
        if device is not None and device_type(device) == "cuda" and torch.cuda.is_available():
            capability = _cuda_capability(device)
            if capability < FP8_MIN_CAPABILITY:
                return (f"FP8 matmuls need compute capability >= 8.9 (Ada, Hopper); this GPU is "
                        f"{capability[0]}.{capability[1]}")
        return ""

    def note(self, device: str) -> str:
        if device_type(device) == "cuda":
            return f"{self.help} Native FP8 tensor cores."
        onednn = (" This lane's steps run with oneDNN off: its float8 matmul on this CPU is oneDNN's reference kernel, "
                  "hundreds of times slower than ATen's emulation of the same products (its bf16 matmuls that are not "
                  "FP8 then run in ATen's own, slower kernel).") \
            if device_type(device) == "cpu" and float8_matmuls_need_onednn_off() else ""
        return (f"{self.help} Emulated here: real float8 matmuls (the aten._scaled_mm op on the CPU), no speed-up "
                f"expected.{onednn}")

    def _keeps(self, layer: torch.nn.Linear, device: str) -> str:
        """Why torchao's rules skip `layer` here (empty: it is converted). Misshaped layers (a dim not a multiple of
        16) are skipped everywhere; torchao's size thresholds (measured on H100 for speed) apply where FP8 is native,
        on CUDA: on a CPU there is no speed to lose, and the lane would otherwise have no FP8 layer to show."""
        out_features, in_features = layer.weight.shape
        if out_features % FP8_DIM_MULTIPLE or in_features % FP8_DIM_MULTIPLE:
            return f"misshaped: {in_features}->{out_features} is not a multiple of {FP8_DIM_MULTIPLE}"
        if device_type(device) == "cuda":
            heavy_import("torchao.float8.float8_linear_utils")
            from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

            # torchao 0.18 has thresholds for tensorwise and rowwise only (rowwise_with_gw_hp raises
            # NotImplementedError there, seen on an H100): gw_hp's forward and grad-input matmuls are rowwise's.
            thresholds = "rowwise" if self.torchao_recipe == "rowwise_with_gw_hp" else self.torchao_recipe
            if not _auto_filter_for_recipe(thresholds, [])(layer, ""):
                return f"too small for an FP8 speed-up by torchao's {self.torchao_recipe} thresholds " \
                       f"({in_features}->{out_features})"
        return ""

    def plan(self, module: torch.nn.Module, device: str, kept: Iterable[str] = ()) -> tuple[list[str], dict[str, str]]:
        """(Linear layers converted, {layer: why skipped}) for `module` on `device`; a layer inside a module kept in
        fp32 (`kept`, or one kept by `+keep:`) stays a plain nn.Linear."""
        converted, skipped = [], {}
        kept = {*kept, *(name for name, layer in module.named_modules() if is_kept(layer))}
        for name, layer in module.named_modules():
            if type(layer) is torch.nn.Linear:
                holder = next((k for k in kept if name == k or name.startswith(f"{k}.") or not k), None)
                why = f"kept in fp32 (+keep: {holder or '(the model)'})" if holder is not None else \
                    self._keeps(layer, device)
                if why:
                    skipped[name] = why
                else:
                    converted.append(name)
            elif type(layer).__name__ == "Conv1D":
                skipped[name] = ("transformers' Conv1D (GPT-2's projections: a Linear with its weight stored "
                                 "transposed), not an nn.Linear, which is all torchao converts")
        return converted, skipped

    def cast_config(self, role: str):
        """torchao's CastConfig of a Float8Linear's `role` ("input": its forward matmul's activation; "grad_output":
        the gradient reaching its output, in the grad-input matmul) under this recipe."""
        config = _float8_config(self.torchao_recipe)
        return config.cast_config_input if role == "input" else config.cast_config_grad_output

    def cast_scale(self, tensor: torch.Tensor, role: str, dtype: torch.dtype) -> torch.Tensor:
        """The scale torchao's own code gives `tensor` cast to `dtype` as this recipe casts `role` (tensorwise: one
        for the tensor; rowwise: one per row of the last dim, rounded down to a power of 2); broadcastable to it."""
        heavy_import("torchao.float8")
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import tensor_to_scale

        cast = self.cast_config(role)
        rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
        return tensor_to_scale(tensor, dtype, scaling_granularity=cast.scaling_granularity,
                               axiswise_dim=-1 if rowwise else None,
                               round_scales_to_power_of_2=_float8_config(self.torchao_recipe).round_scales_to_power_of_2)

    def scaling(self) -> str:
        """How this recipe scales a tensor before its cast, for people."""
        heavy_import("torchao.float8")
        from torchao.float8.config import ScalingGranularity

        rowwise = self.cast_config("input").scaling_granularity is ScalingGranularity.AXISWISE
        rounded = ", rounded down to a power of 2" if _float8_config(self.torchao_recipe).round_scales_to_power_of_2 \
            else ""
        return ("one scale per row (last dim)" if rowwise else "one scale per tensor") + rounded

    def prepare_module(self, module: torch.nn.Module, device: str) -> torch.nn.Module:
        heavy_import("torchao.float8")
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        converted, _ = self.plan(module, device)
        keep = set(converted)
        module = convert_to_float8_training(module, config=_float8_config(self.torchao_recipe),
                                            module_filter_fn=lambda layer, fqn: fqn in keep)
        if device_type(device) == "cpu":
            for layer in module.modules():
                if isinstance(layer, Float8Linear):
                    layer.register_forward_pre_hook(_cast_to_cpu_autocast_dtype)
        return module


@functools.lru_cache(maxsize=4)
def _float8_config(torchao_recipe: str):
    heavy_import("torchao.float8")
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(torchao_recipe)


def _cast_to_cpu_autocast_dtype(layer: torch.nn.Module, args: tuple) -> tuple | None:
    """Float8Linear casts its input to the autocast dtype reading CUDA's autocast state only; under CPU autocast the
    input stayed fp32 while the gradient came back in bf16, and rowwise_with_gw_hp's high-precision grad-weight
    matmul failed ('expected m1 and m2 to have the same dtype'). This makes the CPU do what torchao does on CUDA."""
    if torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


@dataclass(frozen=True, slots=True)
class OptimizerStates(RecipeOption):
    """`+adamw-8bit` / `+adamw-4bit` / `+adamw-fp8` / `+states-bf16`: Adam(W)'s two moments kept in a smaller format
    (torchao's low-bit optimizers: block-wise codes plus a scale per block; only tensors of >= 4096 values whose size
    divides into blocks are quantized, the rest stay in the parameter's dtype)."""

    name: str
    state_format: str
    """8bit | 4bit | fp8 | bf16."""
    help: str

    def refusal(self, mode: str, device: str | None) -> str:
        if self.state_format == "bf16" and MODE_SPECS[mode][0] == torch.bfloat16:
            return f"{mode} already keeps Adam's states in bf16; +{self.name} would change nothing"
        return ""

    def note(self, device: str) -> str:
        return _compiled_optimizer_note(self.help, device)


def _compiled_optimizer_note(help_text: str, device: str) -> str:
    """torchao's low-bit and stochastic-rounding optimizers compile their step: say what that costs on a CPU."""
    if device_type(device) == "cpu":
        return f"{help_text} torchao compiles its optimizer step (torch.compile): the first step takes seconds to a " \
               "minute here."
    return help_text


@dataclass(frozen=True, slots=True)
class StochasticRounding(RecipeOption):
    """`+sr`: bf16 weights without fp32 master weights, updated with stochastic rounding (torchao's _AdamW with
    bf16_stochastic_round=True): small updates survive on average instead of rounding away."""

    name: str
    help: str

    def refusal(self, mode: str, device: str | None) -> str:
        if mode != "bf16-true":
            return f"+{self.name} rounds bf16 weights stochastically; use it with bf16-true (bf16-true+{self.name})"
        return ""

    def note(self, device: str) -> str:
        return _compiled_optimizer_note(self.help, device)


@dataclass(frozen=True, slots=True)
class ReduceDtype(RecipeOption):
    """`+reduce-bf16` / `+reduce-fp32`: the dtype FSDP2 reduce-scatters gradients in (MixedPrecisionPolicy's
    reduce_dtype), whatever the mode's default (fp32 for the mixed and fp32 modes, the weights' dtype for the true
    16-bit ones). Only under FSDP2 (`--fsdp`): DDP all-reduces gradients in their own dtype."""

    name: str
    reduce_dtype: torch.dtype
    help: str
    needs_torchao = False
    fsdp_only = True


@dataclass(frozen=True, slots=True)
class CompiledModel(RecipeOption):
    """`+compile` / `+compile-max-autotune` / `+compile-reduce-overhead`: the lane's model compiled with
    torch.compile's inductor backend (`nn.Module.compile`, in place, so parameter names and the optimizer's parameters
    stay the lane's own); the step is otherwise the same. The weights are not changed: `prepare_module` leaves the
    module eager, and the run compiles its lane (amp_core.race.compiled), so every copy a probe makes is an eager
    one."""

    name: str
    compile_mode: str
    """torch.compile's `mode`: default | max-autotune | reduce-overhead."""
    help: str
    needs_torchao = False

    def refusal(self, mode: str, device: str | None) -> str:
        if device is None:
            return ""
        if device_type(device) == "cpu":
            if self.compile_mode == "reduce-overhead":
                return (f"+{self.name} replays CUDA graphs, which a CPU has none of; use +compile (or "
                        f"+compile-max-autotune) here")
            if not cpp_compiler():
                return (f"+{self.name} needs a C++ compiler on a CPU (inductor writes C++ kernels) and none was "
                        "found (set CXX or install g++)")
        elif device_type(device) == "cuda" and not triton_installed():
            return f"+{self.name} needs triton on CUDA (inductor writes triton kernels) and it is not installed"
        return ""

    def fsdp_refusal(self) -> str:
        return "compiled lanes under FSDP2 are not raced yet"

    def note(self, device: str) -> str:
        return f"{self.help} The first step compiles (seconds to minutes), outside the timed steps."


@dataclass(frozen=True, slots=True)
class KeepInFp32(RecipeOption):
    """`+keep:PATTERN`: the modules matching a glob over `named_modules()` names compute in fp32 (`keep_in_fp32`).
    Mixed modes: outside autocast, their floating inputs upcast, their output left fp32 (autocast decides what follows);
    true modes: their parameters stay fp32 too and their output is cast back to the model's dtype; FP8 recipes: left
    out of torchao's conversion."""

    pattern: str
    """The glob (fnmatch) over module names, as written after `keep:`."""
    needs_torchao = False

    @property
    def name(self) -> str:
        return f"{KEEP_PREFIX}{self.pattern}"

    @property
    def help(self) -> str:
        return f"modules matching {self.pattern!r} compute in fp32"

    def refusal(self, mode: str, device: str | None) -> str:
        if low_precision_dtype(mode) is None:
            return f"+{self.name} changes nothing in {mode}: it computes in fp32 already"
        return ""


RECIPE_OPTIONS: dict[str, RecipeOption] = {option.name: option for option in (
    Float8Matmuls(name="fp8-tensorwise", torchao_recipe="tensorwise",
                  help=RECIPE_OPTION_HELP["fp8-tensorwise"]),
    Float8Matmuls(name="fp8-rowwise", torchao_recipe="rowwise",
                  help=RECIPE_OPTION_HELP["fp8-rowwise"]),
    Float8Matmuls(name="fp8-rowwise-gw-hp", torchao_recipe="rowwise_with_gw_hp",
                  help=RECIPE_OPTION_HELP["fp8-rowwise-gw-hp"]),
    OptimizerStates(name="adamw-8bit", state_format="8bit",
                    help=RECIPE_OPTION_HELP["adamw-8bit"]),
    OptimizerStates(name="adamw-4bit", state_format="4bit",
                    help=RECIPE_OPTION_HELP["adamw-4bit"]),
    OptimizerStates(name="adamw-fp8", state_format="fp8",
                    help=RECIPE_OPTION_HELP["adamw-fp8"]),
    OptimizerStates(name="states-bf16", state_format="bf16",
                    help=RECIPE_OPTION_HELP["states-bf16"]),
    StochasticRounding(name="sr", help=RECIPE_OPTION_HELP["sr"]),
    ReduceDtype(name="reduce-bf16", reduce_dtype=torch.bfloat16, help=RECIPE_OPTION_HELP["reduce-bf16"]),
    ReduceDtype(name="reduce-fp32", reduce_dtype=torch.float32, help=RECIPE_OPTION_HELP["reduce-fp32"]),
    CompiledModel(name="compile", compile_mode="default", help=RECIPE_OPTION_HELP["compile"]),
    CompiledModel(name="compile-max-autotune", compile_mode="max-autotune",
                  help=RECIPE_OPTION_HELP["compile-max-autotune"]),
    CompiledModel(name="compile-reduce-overhead", compile_mode="reduce-overhead",
                  help=RECIPE_OPTION_HELP["compile-reduce-overhead"]),
    *BLOCK_SCALED_OPTIONS,
)}
"""Every recipe option by name, in the order the UI lists them."""
bind_precision({name: option for name, option in RECIPE_OPTIONS.items()
                if isinstance(option, (Float8Matmuls, BlockScaledMatmuls))}, keep_in_fp32, is_kept)


def parse_recipe(recipe: str) -> tuple[str, tuple[RecipeOption, ...]]:
    """`MODE[+OPTION...]` -> (mode, options). ValueError with a one-line reason for a bad string or combination
    (the device is not asked: see `availability`)."""
    if not isinstance(recipe, str) or not recipe.strip():
        raise ValueError(f"name a recipe (MODE[+OPTION...]), got {recipe!r}")
    mode, *names = (part.strip() for part in recipe.strip().split("+"))
    if mode not in MODE_SPECS:
        raise ValueError(f"unknown mode {mode!r} in {recipe!r}; choose from {', '.join(MODES)}")
    options = []
    for name in names:
        if name.startswith(PLAN_PREFIX):
            options.append(parse_plan_option(name, recipe))
            continue
        if name.startswith(KEEP_PREFIX):
            pattern = name[len(KEEP_PREFIX):].strip()
            if not pattern:
                raise ValueError(f"+{KEEP_PREFIX} in {recipe!r} needs a pattern (a glob over module names, e.g. "
                                 f"{KEEP_PREFIX}*.attn)")
            options.append(KeepInFp32(pattern=pattern))
            continue
        if name not in RECIPE_OPTIONS:
            raise ValueError(f"unknown recipe option {name!r} in {recipe!r}; choose from "
                             f"{', '.join(RECIPE_OPTIONS)}")
        options.append(RECIPE_OPTIONS[name])
    for kind, what in (((Float8Matmuls, BlockScaledMatmuls), "matmul-format option"),
                       (OptimizerStates, "optimizer-state option"),
                       (ReduceDtype, "reduction option"), (CompiledModel, "compile option")):
        chosen = [option.name for option in options if isinstance(option, kind)]
        if len(chosen) > 1:
            raise ValueError(f"{recipe!r} names {len(chosen)} {what}s ({', '.join(chosen)}); choose one")
    if len(set(names)) != len(names):
        raise ValueError(f"{recipe!r} names an option twice")
    for option in options:
        why = option.refusal(mode, None)
        if why:
            raise ValueError(why)
    return mode, tuple(options)


def fsdp_refusal(recipe: str, fsdp: bool) -> str:
    """Why `recipe` (a valid one) cannot train with each lane's model sharded by FSDP2 (`fsdp`) or without it (empty:
    it can)."""
    _, options = parse_recipe(recipe)
    for option in options:
        if option.fsdp_only and not fsdp:
            return (f"+{option.name} sets the dtype FSDP2 reduces gradients in: it needs --fsdp (amp-lab run --nproc "
                    "N --fsdp)")
        why = option.fsdp_refusal() if fsdp else ""
        if why:
            return f"+{option.name} is not offered with --fsdp: {why}"
    return ""


def is_fp8_recipe(recipe: str) -> bool:
    """Whether the recipe runs FP8 matmuls (its ranges are then read against e4m3/e5m2)."""
    return any(isinstance(RECIPE_OPTIONS.get(part.strip()), Float8Matmuls) for part in recipe.split("+")[1:])
