"""train_step(): one optimizer step of one lane. No dtype branches: the Precision object decides."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from amp_core.measure import SavedTensorsProbe, cuda_peak_bytes, cuda_peak_reset
from amp_core.precision import Precision
from amp_core.probes import gradstats
from amp_core.probes.faults import FaultPlan
from amp_core.records.sink import RecordSink
from amp_core.workloads import Workload


class _NoScheduler:
    """Stands in for an LR scheduler when there is none, so the step never asks."""

    def step(self) -> None:
        pass


@dataclass(slots=True)
class LaneState:
    """Everything one lane trains with."""

    index: int
    precision: Precision
    workload: Workload
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    scheduler: object = field(default_factory=_NoScheduler)
    grad_clip: float = 0.0
    faults: FaultPlan = field(default_factory=FaultPlan)
    params: list[torch.nn.Parameter] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    @property
    def mode(self) -> str:
        return self.precision.mode


@dataclass(slots=True)
class StepResult:
    loss: float
    step_ms: float
    lr: float
    scale: float | None
    scale_after: float | None
    skipped: bool
    grad_norm: float
    activations_bytes: int | None = None
    """Set on steps where the saved-tensor probe ran."""
    cuda_peak_bytes: int | None = None
    bad_params: list[dict] = field(default_factory=list)
    """Parameters with inf/NaN gradients (filled when the step skipped or the gradients were not finite)."""
    grad_stats: list[gradstats.GradStats] = field(default_factory=list)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients: the same figure as clip_grad_norm_, without its per-call grouping cost (~30 us)."""
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def to_host(tensors: list[torch.Tensor]) -> list[float]:
    """Scalars to Python floats: one stacked transfer (one sync) on an accelerator, plain .item() on the CPU,
    where there is nothing to wait for and stacking would cost more than it saves."""
    if tensors[0].device.type == "cpu":
        return [t.item() for t in tensors]
    return torch.stack([t.float() for t in tensors]).tolist()


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor | float:
    # GradScaler keeps its per-optimizer inf flags only when enabled; read before update() clears them.
    if not scaler.is_enabled():
        return 0.0
    return sum(scaler._found_inf_per_device(optimizer).values())


def forward_backward_step(lane: LaneState, inputs: torch.Tensor, targets: torch.Tensor, loss_factor: float,
                          probe: SavedTensorsProbe | None) -> torch.Tensor:
    """Forward + loss under the mode's context, scaled backward. Returns the loss (unscaled, as a tensor)."""
    with probe if probe is not None else contextlib.nullcontext():
        with lane.precision.forward_context():
            loss = lane.workload.loss(lane.model(inputs), targets)
            if loss_factor != 1.0:
                loss = loss * loss_factor
        lane.scaler.scale(loss).backward()
    return loss


def train_step(lane: LaneState, batch: tuple[torch.Tensor, torch.Tensor], step: int, *,
               measure_activations: bool = False, collect_grad_stats: bool = False) -> StepResult:
    """One optimizer step. Syncs the device once, where the figures are read."""
    device_type = lane.precision.device_type
    faults = lane.faults
    with lane.precision.math_context():
        cuda_peak_reset(device_type)
        if device_type == "cuda":
            torch.cuda.synchronize()  # the timing starts from an idle device
        start = time.perf_counter()
        inputs, targets = (lane.precision.prepare_input(t) for t in batch)
        lane.optimizer.zero_grad(set_to_none=True)
        probe = SavedTensorsProbe(lane.params) if measure_activations else None
        loss = forward_backward_step(lane, inputs, targets, faults.loss_factor(step) if faults else 1.0, probe)
        if faults:
            faults.corrupt_grads(step, lane.model)
        lane.scaler.unscale_(lane.optimizer)
        grad_norm = total_norm([p.grad for p in lane.params if p.grad is not None])
        if lane.grad_clip:
            # Clipping by a non-finite norm multiplies every gradient by NaN (inf/inf or 0*inf), which would hide
            # the parameter that really overflowed; such a step is skipped (or diverges) anyway, so leave them.
            finite_norm = torch.where(torch.isfinite(grad_norm), grad_norm, torch.zeros_like(grad_norm))
            torch.nn.utils.clip_grads_with_norm_(lane.params, lane.grad_clip, finite_norm)
        scale = lane.scaler.get_scale() if lane.scaler.is_enabled() else None
        found_inf = _found_inf(lane.scaler, lane.optimizer)
        lr_factor = faults.lr_factor(step) if faults else 1.0
        if lr_factor != 1.0:
            for group in lane.optimizer.param_groups:
                group["lr"] *= lr_factor
        lr = lane.optimizer.param_groups[0]["lr"]
        before = {name: p.detach().clone() for name, p in lane.model.named_parameters()} if collect_grad_stats else {}
        lane.scaler.step(lane.optimizer)
        lane.scaler.update()
        if lr_factor != 1.0:
            for group in lane.optimizer.param_groups:
                group["lr"] /= lr_factor
        # The figures come to the host here: the step's only sync point.
        figures = [loss.detach(), grad_norm.detach().to(loss.device)]
        if isinstance(found_inf, torch.Tensor):
            figures.append(found_inf.to(loss.device))
        loss_value, norm_value, *inf_value = to_host(figures)
        skipped = bool(inf_value) and inf_value[0] > 0
        if not skipped:
            # The scheduler follows the optimizer: stepping it on a skipped step would shift the schedule.
            lane.scheduler.step()
        step_ms = (time.perf_counter() - start) * 1e3
    result = StepResult(loss=loss_value, step_ms=step_ms, lr=lr, scale=scale,
                        scale_after=lane.scaler.get_scale() if scale is not None else None, skipped=skipped,
                        grad_norm=norm_value, activations_bytes=probe.bytes if probe else None,
                        cuda_peak_bytes=cuda_peak_bytes(device_type))
    if skipped or not math.isfinite(norm_value):
        result.bad_params = gradstats.nonfinite_params(lane.model)
    if collect_grad_stats or skipped:
        result.grad_stats = gradstats.model_grad_stats(lane.model, scale or 1.0)
        params = dict(lane.model.named_parameters())
        for stats in result.grad_stats:
            # A skipped step moves no parameter on purpose: that is not an update lost to rounding.
            if stats.param in before and not skipped:
                param = params[stats.param]
                stats.lost_update_fraction = gradstats.lost_update_fraction(before[stats.param], param.detach(),
                                                                            param.grad)
    return result


def record_step_events(sink: RecordSink, lane: int, step: int, result: StepResult, faults: FaultPlan) -> None:
    """What one lane step leaves beside its StepRecord: faults that fired, sampled gradient statistics, a skipped step
    with the parameters that overflowed, scale growth or backoff, inf/NaN gradients applied, a non-finite loss."""
    for fired_step, fault in faults.take_fired() if faults else ():
        sink.event("fault", f"fault injected: {fault.describe()}", lane, fired_step, fault=fault.kind)
    if result.grad_stats:
        sink.add_grad_stats(lane, step, result.grad_stats)
    if result.skipped:
        sink.event("skipped_step", f"optimizer step skipped: inf/NaN gradients in "
                   f"{', '.join(p['param'] for p in result.bad_params) or 'the gradients'}",
                   lane, step, params=result.bad_params, scale_before=result.scale, scale_after=result.scale_after)
    if result.scale is not None and result.scale_after != result.scale:
        grew = result.scale_after > result.scale
        if grew == result.skipped:
            sink.event("warning", "scale change disagrees with the skip flag", lane, step)
        sink.event("scale_growth" if grew else "scale_backoff", f"scale {result.scale:g} -> {result.scale_after:g}",
                   lane, step, scale_before=result.scale, scale_after=result.scale_after)
    elif result.skipped:
        sink.event("warning", "step skipped but the scale did not back off", lane, step)
    if not result.skipped and not math.isfinite(result.grad_norm) and result.bad_params:
        sink.event("nonfinite_grads", "the optimizer stepped with inf/NaN gradients (no scaler to catch them)",
                   lane, step, params=result.bad_params)
    if not math.isfinite(result.loss):
        sink.event("nonfinite_loss", f"loss is {result.loss}", lane, step)
