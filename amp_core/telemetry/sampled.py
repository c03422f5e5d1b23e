"""The sampled figures around a step, outside its timed window (they may sync on CUDA; their host time is the step's
`probe_ms`): the allocator's memory window, bytes held, the parameters that overflowed, gradient statistics and the
share of each update lost to rounding. One implementation for a lane step and a Monitor."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amp_core.probes import gradstats
from amp_core.probes.memory import held_bytes, local_tensor
from amp_core.telemetry.meters import Meter
from amp_core.telemetry.recorder import StepResult, peek_scale_and_skip
from amp_core.telemetry.schedule import SamplingSchedule
from amp_core.torch_private import foreach_norm


def grad_norms(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-parameter L2 norms and their total (clip_grad_norm_'s figure), computed in float32: an fp16 norm
    overflows once the sum of squares passes 65504 (1e5 gradients of 300 give inf), and clipping then switches off
    exactly when it is needed. One fused kernel for all the per-parameter norms, one for the total."""
    if not grads:  # no parameter has a gradient: no norms, and a total of 0 (clip_grad_norm_'s answer)
        return torch.zeros(0, dtype=torch.float32), torch.zeros((), dtype=torch.float32)
    # At least float32: a replay's float64 reference keeps its own precision (amp_core.diagnostics.replay).
    per_param = torch.stack(foreach_norm(grads, torch.promote_types(grads[0].dtype, torch.float32)))
    return per_param, torch.linalg.vector_norm(per_param)


def named_grad_norms(names: list[str], params: list[torch.nn.Parameter]
                     ) -> tuple[tuple[torch.Tensor, torch.Tensor], list[str]]:
    """The gradient norms (per parameter, total) of the parameters that have gradients, and their names."""
    # A sharded gradient (FSDP2): this rank's shard, so the figure needs no collective (the norm is the rank's own).
    named = [(name, local_tensor(p.grad)) for name, p in zip(names, params, strict=True) if p.grad is not None]
    return grad_norms([g for _, g in named]), [name for name, _ in named]


@dataclass(slots=True)
class GradFigures:
    """What a step's gradients said, taken where they surely exist: in the optimizer's step pre-hook (after
    `unscale_`, before the update), or as GradScaler's `update` begins on a step it skipped (StepProbes.take_grads).
    Taken there, a loop may clear its gradients (`zero_grad`, either way) before or after `Monitor.step`."""

    norms: tuple[tuple[torch.Tensor, torch.Tensor], list[str]] | None = None
    """(per-parameter norms, total) and the names of the parameters that had a gradient; None: none had one."""
    bad_params: list[dict] | None = None
    """The parameters whose gradient held inf/NaN, on a skipped step (None: not taken)."""
    grad_stats: list | None = None
    """Gradient statistics (None: not taken)."""
    seconds: float = 0.0
    """Host time it took (inside the step's window: excluded from its step time, counted in its probe time)."""


@dataclass(slots=True)
class Opened:
    """What the probes took before a step (for `StepProbes.close`)."""

    memory_opened: int | None = None
    """The meter's memory window (None: not opened, or the device has none)."""
    held_at_start: int = 0
    params_before: dict[str, torch.Tensor] = field(default_factory=dict)
    """Copies of the parameters before the step (gradient-statistics steps that measure lost updates)."""
    activations_bytes: int | None = None
    """Bytes saved for backward, on memory steps of a driver that can measure them."""
    seconds: float = 0.0
    """Host time the probes took before the step."""


NOTHING_OPENED = Opened()


@dataclass(slots=True, eq=False)
class StepProbes:
    """The sampled probes of one model and optimizer, on the schedule's steps."""

    meter: Meter
    model: torch.nn.Module
    names: list[str]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: SamplingSchedule
    lost_updates: bool = True
    """Copy the parameters before gradient-statistics steps to measure updates lost to rounding (a driver that does
    not see the step begin, a Monitor, cannot)."""
    stats_s: float = 0.0
    """Host time gradient statistics have taken so far (against SamplingSchedule.probe_budget)."""
    last_stats_s: float = 0.0
    """What the last gradient statistics took (the next one is expected to take as much)."""

    def open(self, step: int, memory: bool, grad_stats: bool,
             saved_bytes: Callable[[], int] | None = None) -> Opened:
        """Before the step's window: measure the bytes saved for backward (`saved_bytes`, on memory steps), copy the
        parameters (gradient statistics), open the memory window. Costs nothing on a step that samples nothing."""
        memory_window = self.schedule.memory_window(step)
        copies = grad_stats and self.lost_updates
        saved = memory and saved_bytes is not None
        if not (memory_window or copies or saved):
            return NOTHING_OPENED
        started = time.perf_counter()
        opened = Opened()
        if saved:
            opened.activations_bytes = saved_bytes()
        if copies:
            opened.params_before = {name: p.detach().clone() for name, p in zip(self.names, self.params, strict=True)}
        if memory_window:
            opened.memory_opened = self.meter.open_memory_window()
            if opened.memory_opened is not None:  # the peak is read above it (a device with an allocator window)
                opened.held_at_start = sum(held_bytes(self.params, self.optimizer))  # tensor metadata: no sync
        opened.seconds = time.perf_counter() - started
        return opened

    def take_grads(self, stats: bool, skipped: bool, loop_s: float, scale: Callable[[], float | None]) -> GradFigures:
        """The gradient figures of a step, where its gradients surely exist (GradFigures): the norms (fp32, kept on the
        device: no sync); on a skipped step the parameters that overflowed; gradient statistics when `stats` or
        skipped, while within the budget (`scale()`: the scale the gradients were scaled by, read only then)."""
        started = time.perf_counter()
        norms = named_grad_norms(self.names, self.params)
        taken = GradFigures(norms if norms[1] else None)
        if skipped:
            taken.bad_params = gradstats.nonfinite_params(self.model)
        if (stats or skipped) and self.schedule.within_budget(self.stats_s, loop_s, self.last_stats_s):
            stats_started = time.perf_counter()
            taken.grad_stats = gradstats.model_grad_stats(self.model, scale() or 1.0)
            self.last_stats_s = time.perf_counter() - stats_started
            self.stats_s += self.last_stats_s
        taken.seconds = time.perf_counter() - started
        return taken

    def close(self, result: StepResult, opened: Opened, memory: bool, grad_stats: bool, loop_s: float = 0.0,
              taken: GradFigures | None = None) -> float:
        """After the step's window: the memory figures, the parameters that overflowed on a skipped step (or one whose
        norm is not finite), gradient statistics on sampled and skipped steps while within the budget (`loop_s`: the
        loop's own time so far); `taken`: the gradient figures taken during the step (`take_grads`), used instead of
        the gradients as they are now. Returns the host time it took (0 on a step that samples nothing)."""
        skipped = result.skipped
        nonfinite = result.grad_norm is not None and not math.isfinite(result.grad_norm)
        if taken is not None:
            if taken.bad_params is not None and (skipped or nonfinite):
                result.bad_params = taken.bad_params
            if taken.grad_stats is not None:
                result.grad_stats = taken.grad_stats
            grad_stats = skipped = nonfinite = False  # what they would read of the gradients is taken
        if opened is NOTHING_OPENED and not (memory or grad_stats or skipped or nonfinite):
            return 0.0
        started = time.perf_counter()
        result.activations_bytes = opened.activations_bytes
        peak = self.meter.close_memory_window(opened.memory_opened)
        if peak is not None:
            result.peak_above_start_bytes = peak
            result.lane_peak_bytes = opened.held_at_start + peak
        if memory:
            result.held = held_bytes(self.params, self.optimizer)
        if skipped or nonfinite:
            result.bad_params = gradstats.nonfinite_params(self.model)
        if (grad_stats or skipped) and self.schedule.within_budget(self.stats_s, loop_s, self.last_stats_s):
            stats_started = time.perf_counter()
            peek_scale_and_skip(self.meter, result)  # the scale the gradients were scaled by (a sync on CUDA)
            result.grad_stats = gradstats.model_grad_stats(self.model, result.scale or 1.0)
            if not result.skipped:  # a skipped step moves no parameter on purpose: no update lost to rounding
                params = dict(zip(self.names, self.params, strict=True))
                watched = [stats for stats in result.grad_stats if stats.param in opened.params_before]
                lost = gradstats.lost_update_fractions(
                    [(opened.params_before[stats.param], params[stats.param].detach(), params[stats.param].grad)
                     for stats in watched])
                for stats, fraction in zip(watched, lost, strict=True):
                    stats.lost_update_fraction = fraction
            self.last_stats_s = time.perf_counter() - stats_started
            self.stats_s += self.last_stats_s
        return opened.seconds + time.perf_counter() - started
