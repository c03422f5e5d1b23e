"""Precision recipes: the ONLY place that maps a mode name and its options to behaviour (autocast, scaler, dtypes, TF32,
FP8 matmuls, optimizer-state formats, stochastic rounding, FSDP2 mixed-precision policies). A recipe is
`MODE[+OPTION...]`, e.g. `bf16-mixed+fp8-rowwise`, `32-true+adamw-8bit`, `bf16-true+sr`, `bf16-mixed+reduce-bf16`
(under --fsdp); torchao is imported only when a recipe needs it."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import functools
import importlib.util
import os
import platform
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from amp_core.formats.linear import plain_linears
from amp_core.formats.memory import block_scale_report
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS, BlockScaledMatmuls
from amp_core.imports import compiler_ready, heavy_import
from amp_core.switches import float8_matmuls_need_onednn_off, lane_step_switches, onednn_off, tf32_enabled
from amp_core.torch_private import forward_hooks, remove_forward_hooks
from amp_core.torchao_logs import drop_expected_torchao_lines

drop_expected_torchao_lines()  # before any (lazy) torchao import below: its loader lines are expected on a CPU

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
    options: tuple[RecipeOption, ...] = ()
    """The recipe's options beyond the mode (FP8 matmuls, optimizer-state format, stochastic rounding)."""

    @property
    def recipe(self) -> str:
        """The recipe in full, as stored and shown: `MODE[+OPTION...]`."""
        return "+".join((self.mode, *(option.name for option in self.options)))

    @property
    def keep_patterns(self) -> tuple[str, ...]:
        """The recipe's `+keep:PATTERN` globs over module names (modules computed in fp32), in the order written."""
        return tuple(option.pattern for option in self.options if isinstance(option, KeepInFp32))

    @property
    def float8(self) -> Float8Matmuls | None:
        """The FP8-matmul option of the recipe, if any."""
        return next((o for o in self.options if isinstance(o, Float8Matmuls)), None)

    @property
    def block_scaled(self) -> BlockScaledMatmuls | None:
        """The block-scaled matmul option of the recipe (MXFP8, NVFP4, blockwise FP8), if any."""
        return next((o for o in self.options if isinstance(o, BlockScaledMatmuls)), None)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context for forward + loss: autocast in mixed modes, nothing otherwise."""
        if self.autocast_dtype is None:
            return NO_CONTEXT
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def step_context(self) -> contextlib.AbstractContextManager:
        """Context for a whole lane step. On CUDA: the process-wide step lock, with the TF32 flags (process-global)
        set for this lane and put back afterwards. On a CPU, nothing (TF32 is a CUDA format, and intra-op threads
        are each thread's own: see switches.pin_intra_op_threads), except for an FP8 recipe where oneDNN's float8
        matmul is its reference kernel: oneDNN off, so ATen emulates them (the cpu_context)."""
        if self.device_type != "cuda":
            return self.cpu_context()
        return lane_step_switches(self.tf32)

    def cpu_context(self) -> contextlib.AbstractContextManager:
        """What a CPU step of this recipe runs under (also where a step leaves the TF32 flags alone, e.g. an op
        trace): oneDNN off for an FP8 recipe where ATen would send its float8 matmuls to oneDNN's reference kernel
        (switches.float8_matmuls_need_onednn_off: ~250x slower than ATen's emulation of the same products), else
        nothing."""
        if self.device_type == "cpu" and self.float8 is not None and float8_matmuls_need_onednn_off():
            return onednn_off()
        return NO_CONTEXT

    def make_scaler(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                    backoff_factor: float = 0.5, growth_interval: int = 2000) -> torch.amp.GradScaler:
        """A GradScaler that is a no-op (enabled=False) when the mode has none."""
        return torch.amp.GradScaler(
            self.device_type, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=self.uses_scaler,
        )

    def prepare_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move the module to the device and cast its parameters (true modes only change dtype); an FP8 recipe then
        swaps its eligible Linear layers for torchao's Float8Linear. `+keep:` modules compute in fp32 (a copy of a
        kept lane's model prepared for another recipe loses its keep hooks)."""
        # A copy of a block-scaled lane's model (a snapshot, a replay's fork) starts plain, as a fresh model would.
        module = plain_linears(module).to(device=self.device, dtype=self.param_dtype)
        # Before FP8 conversion: a kept Linear carries the keep hooks, which Float8Matmuls.plan leaves out.
        keep_in_fp32(module, self.keep_patterns)
        for option in self.options:
            module = option.prepare_module(module, self.device)
        return module

    def build_optimizer(self, params: Iterable[torch.nn.Parameter], optimizer: str, *, lr: float, eps: float,
                        fused: bool = False) -> torch.optim.Optimizer:
        """The lane's optimizer: torch's Adam / AdamW / SGD, or, when the recipe names an optimizer-state format or
        stochastic rounding, torchao's Adam(W) with that format (the Adam flavour follows `optimizer`, so a race
        differs only by the recipe). Raises ValueError for a recipe the optimizer cannot carry."""
        why = self.refuses_optimizer(optimizer, fused)
        if why:
            raise ValueError(why)
        compiler_ready()  # torch's Optimizer imports torch._dynamo on its first build: through the gate, not here
        states = next((o for o in self.options if isinstance(o, OptimizerStates)), None)
        rounding = any(isinstance(o, StochasticRounding) for o in self.options)
        if states is not None or rounding:
            return _torchao_adam(params, optimizer == "adamw", states.state_format if states else "",
                                 rounding, lr=lr, eps=eps)
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        # fused=None leaves torch's own default (foreach on CUDA, a per-tensor loop on a CPU), as a plain loop gets.
        return cls(params, lr=lr, eps=eps, fused=True if fused else None)

    def refuses_optimizer(self, optimizer: str, fused: bool = False) -> str:
        """Why this recipe cannot train with `optimizer` (empty: it can)."""
        for option in self.options:
            if isinstance(option, (OptimizerStates, StochasticRounding)):
                if optimizer == "sgd":
                    return f"+{option.name} changes Adam/AdamW's update; optimizer=sgd has no such state: choose " \
                           "adam or adamw"
                if fused:
                    return f"+{option.name} uses torchao's own (compiled) optimizer step: turn fused_optimizer off"
        return ""

    def recipe_report(self, module: torch.nn.Module) -> dict:
        """What the recipe does to `module` (the base model, before preparation), for the run's `started` event:
        the Linear layers in FP8 and those skipped with the reason, and the recipe's notes for this device."""
        report: dict = {"recipe": self.recipe, "notes": [option.note(self.device) for option in self.options]}
        kept = kept_module_names(module, self.keep_patterns) if self.keep_patterns else []
        if kept:
            report["kept_fp32"] = kept
        if self.float8 is not None:
            converted, skipped = self.float8.plan(module, self.device, kept=kept)
            report["fp8_layers"], report["fp8_skipped"] = converted, skipped
        if self.block_scaled is not None:
            converted, skipped = self.block_scaled.plan(module, self.device, kept=kept)
            report["block_format"] = self.block_scaled.format
            report["block_layers"], report["block_skipped"] = converted, skipped
            report["block_scales"] = block_scale_report(self.block_scaled.gemm, module, converted)
        return report

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy for this recipe (the mode map under `--fsdp`):

        - mixed modes: the sharded fp32 parameters are the master weights (the optimizer steps them); FSDP2
          all-gathers them cast to the autocast dtype (param_dtype) and reduce-scatters gradients in fp32. Autocast
          stays on, as in the DDP lane: its casts of the gathered weights become no-ops (they already are 16-bit),
          and the ops it keeps in fp32 (the loss) still run in fp32, so a lane differs from its DDP twin only by what
          FSDP2 adds (sharding, the gather dtype, the reduce dtype);
        - 32-true / tf32: no casting (fp32 all the way);
        - true 16-bit modes: the shards themselves are 16-bit (no master weights, as without FSDP): nothing to cast,
          and gradients are reduced in the weights' dtype.

        `+reduce-bf16` / `+reduce-fp32` set the reduction dtype. The root's output is not cast (output_dtype None)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        reduce = next((o.reduce_dtype for o in self.options if isinstance(o, ReduceDtype)), None)
        if self.autocast_dtype is not None:
            return MixedPrecisionPolicy(param_dtype=self.autocast_dtype, reduce_dtype=reduce or torch.float32)
        return MixedPrecisionPolicy(reduce_dtype=reduce)

    def fsdp_dtypes(self) -> dict[str, str]:
        """What the FSDP2 policy makes of each tensor, by short dtype name: the sharded parameters (what the
        optimizer steps), the gathered parameters the forward computes with, the gradient reduction, the root's
        output ("as computed": not cast)."""
        policy = self.fsdp_policy()
        gathered = policy.param_dtype or self.param_dtype
        return {"shards": _DTYPE_NAMES[self.param_dtype], "param_dtype": _DTYPE_NAMES[gathered],
                "reduce_dtype": _DTYPE_NAMES[policy.reduce_dtype or gathered],
                "output_dtype": _DTYPE_NAMES[policy.output_dtype] if policy.output_dtype else "as computed"}

    def fsdp_label(self) -> str:
        """The FSDP2 policy in a few words, as Compare labels a lane: `FSDP2 param bf16 · reduce fp32`."""
        dtypes = self.fsdp_dtypes()
        return f"FSDP2 param {dtypes['param_dtype']} · reduce {dtypes['reduce_dtype']}"

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
        if device is not None and _device_type(device) == "cuda" and torch.cuda.is_available():
            capability = _cuda_capability(device)
            if capability < FP8_MIN_CAPABILITY:
                return (f"FP8 matmuls need compute capability >= 8.9 (Ada, Hopper); this GPU is "
                        f"{capability[0]}.{capability[1]}")
        return ""

    def note(self, device: str) -> str:
        if _device_type(device) == "cuda":
            return f"{self.help} Native FP8 tensor cores."
        onednn = (" This lane's steps run with oneDNN off: its float8 matmul on this CPU is oneDNN's reference kernel, "
                  "hundreds of times slower than ATen's emulation of the same products (its bf16 matmuls that are not "
                  "FP8 then run in ATen's own, slower kernel).") \
            if _device_type(device) == "cpu" and float8_matmuls_need_onednn_off() else ""
        return (f"{self.help} Emulated here: real float8 matmuls (the aten._scaled_mm op on the CPU), no speed-up "
                f"expected.{onednn}")

    def _keeps(self, layer: torch.nn.Linear, device: str) -> str:
        """Why torchao's rules skip `layer` here (empty: it is converted). Misshaped layers (a dim not a multiple of
        16) are skipped everywhere; torchao's size thresholds (measured on H100 for speed) apply where FP8 is native,
        on CUDA: on a CPU there is no speed to lose, and the lane would otherwise have no FP8 layer to show."""
        out_features, in_features = layer.weight.shape
        if out_features % FP8_DIM_MULTIPLE or in_features % FP8_DIM_MULTIPLE:
            return f"misshaped: {in_features}->{out_features} is not a multiple of {FP8_DIM_MULTIPLE}"
        if _device_type(device) == "cuda":
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
        fp32 (`kept`, or one carrying the keep hooks: `+keep:`) stays a plain nn.Linear."""
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
        if _device_type(device) == "cpu":
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
        if self.state_format == "bf16" and _SPECS[mode][0] == torch.bfloat16:
            return f"{mode} already keeps Adam's states in bf16; +{self.name} would change nothing"
        return ""

    def note(self, device: str) -> str:
        return _compiled_optimizer_note(self.help, device)


def _compiled_optimizer_note(help_text: str, device: str) -> str:
    """torchao's low-bit and stochastic-rounding optimizers compile their step: say what that costs on a CPU."""
    if _device_type(device) == "cpu":
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
    module eager, and the run compiles its lane (amp_core.compiled), so every copy a probe makes is an eager one."""

    name: str
    compile_mode: str
    """torch.compile's `mode`: default | max-autotune | reduce-overhead."""
    help: str
    needs_torchao = False

    def refusal(self, mode: str, device: str | None) -> str:
        if device is None:
            return ""
        if _device_type(device) == "cpu":
            if self.compile_mode == "reduce-overhead":
                return (f"+{self.name} replays CUDA graphs, which a CPU has none of; use +compile (or "
                        f"+compile-max-autotune) here")
            if not cpp_compiler():
                return (f"+{self.name} needs a C++ compiler on a CPU (inductor writes C++ kernels) and none was "
                        "found (set CXX or install g++)")
        elif _device_type(device) == "cuda" and not _has_triton():
            return f"+{self.name} needs triton on CUDA (inductor writes triton kernels) and it is not installed"
        return ""

    def fsdp_refusal(self) -> str:
        return "compiled lanes under FSDP2 are not raced yet"

    def note(self, device: str) -> str:
        return f"{self.help} The first step compiles (seconds to minutes), outside the timed steps."


def cpp_compiler() -> str:
    """The C++ compiler inductor would use on a CPU (its own list, inductor's `cpp.cxx` config: CXX, then g++),
    found by running `COMPILER --version` as inductor does, or "" when none answers: asked for real, never assumed.
    (inductor's own lookup may install a compiler when asked to by an environment variable; this one never does.)"""
    from amp_core.torch_private import inductor_cxx_names

    return _answering_compiler(inductor_cxx_names())


@functools.lru_cache(maxsize=8)
def _answering_compiler(names: tuple[str | None, ...]) -> str:
    import subprocess

    for name in names:
        if name is None:
            continue
        try:
            subprocess.run([name, "--version"], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        return name
    return ""


def _has_triton() -> bool:
    from amp_core.torch_private import has_triton

    return has_triton()


def compile_option(precision: Precision) -> CompiledModel | None:
    """The recipe's compile option (`+compile...`), if any."""
    return next((o for o in precision.options if isinstance(o, CompiledModel)), None)


KEEP_PREFIX = "keep:"
"""`MODE+keep:PATTERN`: modules whose name matches the glob PATTERN compute in fp32 (repeatable)."""
KEEP_HELP = ("keep:PATTERN: modules whose name (model.named_modules()) matches the glob compute in fp32: outside "
             "autocast with fp32 inputs and an fp32 output (mixed modes), fp32 weights and the output cast back to "
             "the model's dtype (true modes), left out of FP8 conversion.")


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


def parse_recipe(recipe: str) -> tuple[str, tuple[RecipeOption, ...]]:
    """`MODE[+OPTION...]` -> (mode, options). ValueError with a one-line reason for a bad string or combination
    (the device is not asked: see `availability`)."""
    if not isinstance(recipe, str) or not recipe.strip():
        raise ValueError(f"name a recipe (MODE[+OPTION...]), got {recipe!r}")
    mode, *names = (part.strip() for part in recipe.strip().split("+"))
    if mode not in _SPECS:
        raise ValueError(f"unknown mode {mode!r} in {recipe!r}; choose from {', '.join(MODES)}")
    options = []
    for name in names:
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


def recipe_mode(recipe: str) -> str:
    """The mode a recipe builds on (`bf16-mixed+fp8-rowwise` -> `bf16-mixed`)."""
    return recipe.split("+", 1)[0].strip()


def is_fp8_recipe(recipe: str) -> bool:
    """Whether the recipe runs FP8 matmuls (its ranges are then read against e4m3/e5m2)."""
    return any(isinstance(RECIPE_OPTIONS.get(part.strip()), Float8Matmuls) for part in recipe.split("+")[1:])


def uses_scaler(mode: str) -> bool:
    """Whether the mode (or the recipe built on it) trains with a GradScaler (skips steps whose gradients
    overflowed)."""
    return _SPECS[recipe_mode(mode)][2]


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


def get_precision(recipe: str, device: str = "cpu") -> Precision:
    """Recipe (`MODE[+OPTION...]`) -> Precision. Raises ValueError for an unknown or unavailable recipe."""
    device = resolve_device(device)
    ok, reason = availability(recipe, device)
    if not ok:
        raise ValueError(f"{'recipe' if '+' in recipe else 'mode'} {recipe!r} cannot run on {device}: {reason}")
    mode, options = parse_recipe(recipe)
    param_dtype, autocast_dtype, scaler, tf32 = _SPECS[mode]
    return Precision(mode=mode, device=device, param_dtype=param_dtype, autocast_dtype=autocast_dtype,
                     uses_scaler=scaler, tf32=tf32, watch_grads=torch.float16 in (param_dtype, autocast_dtype),
                     options=options)


CPU_NATIVE_ENV = "AMP_LAB_CPU_NATIVE"
"""Overrides which 16-bit formats this CPU computes natively (unset: torch's detection decides)."""
CPU_NATIVE_CHOICES = ("none", "bf16", "fp16", "bf16,fp16")
"""The values CPU_NATIVE_ENV takes."""
_FORMAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


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
    return True, "; ".join([reason, *(option.note(device) for option in options)])


def _mode_availability(mode: str, device: str) -> tuple[bool, str]:
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


def _torchao_adam(params: Iterable[torch.nn.Parameter], decoupled: bool, state_format: str, stochastic_round: bool,
                  *, lr: float, eps: float) -> torch.optim.Optimizer:
    """torchao's Adam(W) with moments in `state_format` (8bit | 4bit | fp8 | bf16 | "" = the parameter's dtype) and
    bf16 stochastic rounding on or off. Weight decay follows torch's defaults (Adam 0, AdamW 0.01) so a recipe lane
    differs from its plain twin only by the recipe."""
    heavy_import("torchao.optim")
    import torchao.optim

    weight_decay = 1e-2 if decoupled else 0.0
    if state_format in ("8bit", "4bit", "fp8"):
        name = {"8bit": "8bit", "4bit": "4bit", "fp8": "Fp8"}[state_format]
        cls: Callable = getattr(torchao.optim, f"{'AdamW' if decoupled else 'Adam'}{name}")
    elif state_format == "bf16":
        cls = _bf16_state_adamw()
    else:
        # _AdamW with weight_decay=0 is Adam: the decay is decoupled, so with none the update is Adam's.
        cls = torchao.optim._AdamW
    return cls(params, lr=lr, eps=eps, weight_decay=weight_decay, bf16_stochastic_round=stochastic_round)


@functools.cache
def _bf16_state_adamw() -> type:
    """torchao's _AdamW whose moments are bf16 tensors (its update math stays fp32; each moment is rounded to bf16
    when stored), whatever the parameter's dtype."""
    heavy_import("torchao.optim")
    import torchao.optim

    class AdamWBf16States(torchao.optim._AdamW):
        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.bfloat16)

    return AdamWBf16States


def fused_optimizer_support(device: str = "auto") -> tuple[bool, str]:
    """(ok, reason): whether torch has fused Adam/AdamW kernels for `device` (asked by building one)."""
    device = resolve_device(device)
    compiler_ready()
    try:
        torch.optim.Adam([torch.nn.Parameter(torch.zeros(1, device=device))], fused=True)
    except (RuntimeError, ValueError) as exc:
        return False, f"torch has no fused Adam/AdamW on {device}: {exc}"
    return True, "supported"


FLOAT64_REFERENCE = "float64"
"""The name of the replay's second reference: fp64 weights and math (not a training mode)."""


def float64_reference(device: str = "cpu") -> Precision | None:
    """fp64 weights and math, a replay's reference beside 32-true (amp_core.diagnostics.replay); None on a device
    without float64 math (CPUs and CUDA GPUs have it)."""
    device = resolve_device(device)
    if _device_type(device) not in ("cpu", "cuda"):
        return None
    return Precision(mode=FLOAT64_REFERENCE, device=device, param_dtype=torch.float64, autocast_dtype=None,
                     uses_scaler=False, tf32=False)
