"""Precision: how one lane computes, built once from a recipe (`get_precision`). The training step asks this object
(forward context, step context, scaler, optimizer, module and input preparation, FSDP2 policy) and never branches on
dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from amp_core.formats.linear import plain_linears
from amp_core.formats.memory import block_scale_report
from amp_core.formats.recipes import BlockScaledMatmuls
from amp_core.imports import compiler_ready
from amp_core.precision.device import availability
from amp_core.precision.keep import keep_in_fp32, kept_module_names
from amp_core.precision.modes import FLOAT64_REFERENCE, MODE_SPECS, NO_CONTEXT, device_type, resolve_device
from amp_core.precision.optimizers import torchao_adam
from amp_core.precision.options import (
    CompiledModel,
    Float8Matmuls,
    KeepInFp32,
    OptimizerStates,
    RecipeOption,
    ReduceDtype,
    StochasticRounding,
    parse_recipe,
)
from amp_core.precision.switches import float8_matmuls_need_onednn_off, lane_step_switches, onednn_off

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


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
        float8 = self.float8 is not None or any(getattr(o, "runs_float8", False) for o in self.options)
        if self.device_type == "cpu" and float8 and float8_matmuls_need_onednn_off():
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
        kept lane's model prepared for another recipe loses its keeps)."""
        # A copy of a block-scaled lane's model (a snapshot, a replay's fork) starts plain, as a fresh model would.
        module = plain_linears(module).to(device=self.device, dtype=self.param_dtype)
        # Before FP8 conversion: a kept Linear is one Float8Matmuls.plan leaves out.
        keep_in_fp32(module, self.keep_patterns)
        # A precision plan (+plan:) converts its own layers first; the matmul option then takes the rest.
        for option in sorted(self.options, key=lambda o: not getattr(o, "prepares_first", False)):
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
            return torchao_adam(params, optimizer == "adamw", states.state_format if states else "",
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
        planned: dict = {}
        for option in self.options:  # a precision plan (+plan:): the layers it names take its formats instead
            if hasattr(option, "report"):
                report.update(option.report(module, self.device))
                planned = report["plan"]
        if self.float8 is not None:
            converted, skipped = self.float8.plan(module, self.device, kept=kept)
            report["fp8_layers"] = [name for name in converted if name not in planned]
            report["fp8_skipped"] = skipped
        if self.block_scaled is not None:
            converted, skipped = self.block_scaled.plan(module, self.device, kept=kept)
            converted = [name for name in converted if name not in planned]
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
        return device_type(self.device)


def get_precision(recipe: str, device: str = "cpu") -> Precision:
    """Recipe (`MODE[+OPTION...]`) -> Precision. Raises ValueError for an unknown or unavailable recipe."""
    device = resolve_device(device)
    ok, reason = availability(recipe, device)
    if not ok:
        raise ValueError(f"{'recipe' if '+' in recipe else 'mode'} {recipe!r} cannot run on {device}: {reason}")
    mode, options = parse_recipe(recipe)
    param_dtype, autocast_dtype, scaler, tf32 = MODE_SPECS[mode]
    return Precision(mode=mode, device=device, param_dtype=param_dtype, autocast_dtype=autocast_dtype,
                     uses_scaler=scaler, tf32=tf32, watch_grads=torch.float16 in (param_dtype, autocast_dtype),
                     options=options)


def compile_option(precision: Precision) -> CompiledModel | None:
    """The recipe's compile option (`+compile...`), if any."""
    return next((o for o in precision.options if isinstance(o, CompiledModel)), None)


def float64_reference(device: str = "cpu") -> Precision | None:
    """fp64 weights and math, a replay's reference beside 32-true (amp_core.diagnostics.replay); None on a device
    without float64 math (CPUs and CUDA GPUs have it)."""
    device = resolve_device(device)
    if device_type(device) not in ("cpu", "cuda"):
        return None
    return Precision(mode=FLOAT64_REFERENCE, device=device, param_dtype=torch.float64, autocast_dtype=None,
                     uses_scaler=False, tf32=False)
