"""train_step(): one optimizer step of one lane. No dtype branches: the Precision object decides.

Measuring must not change what is measured (DESIGN.md):
- The timed window holds the training work only: zero_grad, forward, backward, unscale, the gradient norm where
  clipping needs it, clipping, the optimizer step, the scaler update, the scheduler. A norm measured as a figure
  only is taken after it. Sampled probes (parameter copies for lost updates, gradient statistics, the saved-tensor
  probe, the memory window's reads, forensics of a skipped step) run before or after the window and may sync;
  their host time is the step's `probe_ms`.
- On CUDA a step adds no host sync of its own. Its figures (loss, found-inf, scale, gradient norms) stay device
  tensors, copied to pinned memory behind the step; `resolve_step` reads them once the copy's event has completed
  (the runner does, at flush time). The syncs a lane step makes are the training's own: GradScaler.step reads
  found-inf unless the optimizer is fused; with a fused optimizer, a scaler and an LR schedule, found-inf is read so
  the schedule follows the steps really taken (a loop that does the same makes the same sync).
- On a CPU there is nothing to wait for: figures are read at once and `train_step` returns its result resolved.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from amp_core.measure import CudaMeter, HostMeter, InFlight, SavedTensorsProbe, held_bytes, meter_for
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
    grad_norm_every: int = 1
    """Measure the gradient norm every N steps (besides the steps that need it: see `train_step`)."""
    params: list[torch.nn.Parameter] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)
    meter: HostMeter | CudaMeter = field(default_factory=HostMeter)
    scaler_reports_skip: bool = False
    """GradScaler calls optimizer.step only when the gradients were finite (not fused): a step hook then tells the
    host whether the step was skipped, with no read of found-inf."""
    optimizer_stepped: bool = False

    def __post_init__(self) -> None:
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.meter = meter_for(self.precision.device)
        self.scaler_reports_skip = (self.scaler.is_enabled()
                                    and not getattr(self.optimizer, "_step_supports_amp_scaling", False))
        if self.scaler_reports_skip:
            self.optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, optimizer, args, kwargs) -> None:
        self.optimizer_stepped = True

    @property
    def mode(self) -> str:
        return self.precision.mode

    @property
    def has_scheduler(self) -> bool:
        return not isinstance(self.scheduler, _NoScheduler)


@dataclass(slots=True)
class StepResult:
    """What one lane step measured. On a CPU every figure is set when `train_step` returns; on CUDA the figures still
    on the device (`in_flight`) are filled in by `resolve_step`."""

    step: int
    lr: float
    t_wall_s: float
    """When the host finished the step (on CUDA: finished queuing it; the device may finish later)."""
    scaled: bool
    step_ms: float = math.nan
    loss: float = math.nan
    scale: float | None = None
    """The GradScaler scale this step's backward used (None: no scaler)."""
    scale_after: float | None = None
    skipped: bool | None = None
    """None until known: a fused optimizer decides on the device (read at resolve)."""
    grad_norm: float | None = None
    """None on steps where the norm was not measured."""
    probe_ms: float = 0.0
    activations_bytes: int | None = None
    """Set on steps where the saved-tensor probe ran."""
    held: tuple[int, int, int] | None = None
    """(parameters, gradients, optimizer state) bytes after the step, on steps that measured memory."""
    peak_above_start_bytes: int | None = None
    """Set on CUDA steps where the memory window was open."""
    lane_peak_bytes: int | None = None
    """Set on CUDA steps where the memory window was open: held at the step's start + peak_above_start_bytes."""
    # Empty tuples, not lists, by default: most steps have none, and a step should allocate little.
    bad_params: list[dict] | tuple = ()
    """Parameters with inf/NaN gradients (filled when the step skipped or the gradients were not finite)."""
    grad_stats: list[gradstats.GradStats] | tuple = ()
    fired_faults: list | tuple = ()
    """(step, FaultSpec) of the faults that fired on this step."""
    in_flight: InFlight | None = None
    norm_names: list[str] | None = None
    """The parameters whose norms are in flight, in order (None: no norms were sent)."""


def grad_norms(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-parameter L2 norms and their total (clip_grad_norm_'s figure), computed in float32: an fp16 norm
    overflows once the sum of squares passes 65504 (1e5 gradients of 300 give inf), and clipping then switches off
    exactly when it is needed. One fused kernel for all the per-parameter norms, one for the total."""
    if not grads:
        zero = torch.zeros((), dtype=torch.float32)
        return zero.reshape(0), zero
    # At least float32: a replay's float64 reference keeps its own precision (amp_core.probes.replay).
    per_param = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.promote_types(grads[0].dtype, torch.float32)))
    return per_param, torch.linalg.vector_norm(per_param)


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    # GradScaler keeps its per-optimizer inf flags from unscale_ until update(); one device means one flag.
    flags = list(scaler._found_inf_per_device(optimizer).values())
    return flags[0] if len(flags) == 1 else sum(flags)


def saved_tensor_bytes(lane: LaneState, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes autograd saves for backward in this lane's forward, measured on a forward of its own (outside any timed
    step) whose graph is then dropped. The RNG and the module buffers (BatchNorm's running statistics) are put back,
    so the probe leaves training as it found it."""
    precision = lane.precision
    buffers = [b.detach().clone() for b in lane.model.buffers()]
    devices = [torch.device(precision.device)] if precision.device_type == "cuda" else []
    with torch.random.fork_rng(devices=devices), SavedTensorsProbe(lane.params) as probe:
        inputs, targets = (precision.prepare_input(t) for t in batch)
        with precision.forward_context():
            lane.workload.loss(lane.model(inputs), targets)
    with torch.no_grad():
        for buffer, saved in zip(lane.model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    return probe.bytes


def train_step(lane: LaneState, batch: tuple[torch.Tensor, torch.Tensor], step: int, *,
               measure_memory: bool = False, collect_grad_stats: bool = False) -> StepResult:
    """One optimizer step of `lane` on `batch`.

    The gradient norm (fp32) is measured where a figure needs it: when clipping, when faults are planned, when the
    mode's gradients can overflow (Precision.watch_grads), on gradient-statistics steps and every
    `lane.grad_norm_every` steps; it is not free (about 10 us on a CPU for a small model, a few kernels on CUDA).
    `measure_memory` runs the saved-tensor probe and, on CUDA after step 0 (whose first-call allocations, e.g.
    cuBLAS's workspace, belong to the process, not the lane), the lane's allocator window.
    """
    with lane.precision.step_context():
        # The step's own tensors (its batch on the device, loss, norms) die with _step's frame, inside the context:
        # on CUDA, a tensor freed after the lock is let go would lower another lane's allocator window.
        return _step(lane, batch, step, measure_memory, collect_grad_stats)


def _step(lane: LaneState, batch: tuple[torch.Tensor, torch.Tensor], step: int, measure_memory: bool,
          collect_grad_stats: bool) -> StepResult:
    precision, optimizer, scaler, meter, faults = lane.precision, lane.optimizer, lane.scaler, lane.meter, lane.faults
    scaled, has_faults = scaler.is_enabled(), bool(faults)
    probe_s = 0.0
    before: dict[str, torch.Tensor] = {}
    activations = memory_start = held_at_start = None
    if measure_memory or collect_grad_stats:
        probe_started = time.perf_counter()
        if collect_grad_stats:
            # The parameters before this step's update are the parameters now: copied before the window.
            before = {name: p.detach().clone() for name, p in zip(lane.param_names, lane.params, strict=True)}
        if measure_memory:
            activations = saved_tensor_bytes(lane, batch)
            if not meter.immediate and step > 0:
                held_at_start = sum(held_bytes(lane.params, optimizer))
                memory_start = meter.open_memory_window()
        probe_s = time.perf_counter() - probe_started
    watch = (lane.grad_clip or has_faults or precision.watch_grads or collect_grad_stats
             or step % lane.grad_norm_every == 0)
    if meter.immediate:
        scale = scaler.get_scale() if scaled else None  # a CPU tensor: nothing to wait for
        started = meter.start()
    else:
        device_scale = scaler._get_scale_async() if scaled else None
        # Before the first step the scale is not on the device yet: get_scale() answers from the host then.
        scale = scaler.get_scale() if scaled and device_scale is None else None
        started = meter.start(device_scale)

    if has_faults:
        batch = faults.perturb_batch(step, batch)
    inputs, targets = precision.prepare_input(batch[0]), precision.prepare_input(batch[1])
    optimizer.zero_grad(set_to_none=True)
    with precision.forward_context():
        loss = lane.workload.loss(lane.model(inputs), targets)
        if has_faults:
            loss_factor = faults.loss_factor(step)
            if loss_factor != 1.0:
                loss = loss * loss_factor
    scaler.scale(loss).backward()
    if has_faults:
        faults.corrupt_grads(step, lane.model)
    scaler.unscale_(optimizer)
    norms = total = None
    if lane.grad_clip:
        norms, total = grad_norms([p.grad for p in lane.params if p.grad is not None])
        # Clipping by a non-finite norm multiplies every gradient by NaN (inf/inf or 0*inf), which would hide
        # the parameter that really overflowed; such a step is skipped (or diverges) anyway, so leave them.
        finite = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
        torch.nn.utils.clip_grads_with_norm_(lane.params, lane.grad_clip, finite)
    found_inf = _found_inf(scaler, optimizer) if scaled else None  # update() forgets it
    lr_factor = faults.lr_factor(step) if has_faults else 1.0
    if lr_factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] *= lr_factor
    lr = float(optimizer.param_groups[0]["lr"])  # torchao's optimizers keep it as a CPU tensor (no device sync)
    lane.optimizer_stepped = False
    scaler.step(optimizer)
    scaler.update()
    if lr_factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] /= lr_factor
    if not scaled:
        skipped = False
    elif lane.scaler_reports_skip:
        skipped = not lane.optimizer_stepped
    elif meter.immediate or lane.has_scheduler:
        # A fused optimizer skipped (or not) on the device. On CUDA this is a sync, made only because the LR
        # schedule must follow the steps really taken.
        skipped = bool(found_inf.item())
    else:
        skipped = None  # read with the other figures
    if not skipped:
        # The scheduler follows the optimizer: stepping it on a skipped step would shift the schedule.
        lane.scheduler.step()
    if meter.immediate:
        step_ms = meter.elapsed_ms(started)
    else:
        meter.stop(started)
    if watch and norms is None:
        # A figure only, so after the window: the optimizer leaves the gradients as they were.
        norms, total = grad_norms([p.grad for p in lane.params if p.grad is not None])

    result = StepResult(step=step, lr=lr, t_wall_s=time.time(), scaled=scaled, scale=scale, skipped=skipped,
                        activations_bytes=activations, fired_faults=faults.take_fired() if has_faults else ())
    if meter.immediate:
        result.step_ms = step_ms
        result.loss = loss.item()
        if scaled:
            result.scale_after = scaler.get_scale()
        if total is not None:
            result.grad_norm = total.item()
    else:
        values = [loss]
        if scaled:
            values += (found_inf, scaler._get_scale_async())
        if norms is not None:
            values += (total, norms)
            result.norm_names = lane.param_names if len(norms) == len(lane.params) else \
                [name for name, p in zip(lane.param_names, lane.params, strict=True) if p.grad is not None]
        meter.send(started, values)
        result.in_flight = started

    # After the window: the memory window's reads, forensics, sampled statistics (these may sync).
    nonfinite_norm = result.grad_norm is not None and not math.isfinite(result.grad_norm)
    if measure_memory or skipped or nonfinite_norm or collect_grad_stats:
        probe_started = time.perf_counter()
        if memory_start is not None:
            result.peak_above_start_bytes = meter.close_memory_window(memory_start)
            result.lane_peak_bytes = held_at_start + result.peak_above_start_bytes
        if measure_memory:
            result.held = held_bytes(lane.params, optimizer)
        if skipped or nonfinite_norm:
            result.bad_params = gradstats.nonfinite_params(lane.model)
        if collect_grad_stats or skipped:
            _grad_statistics(lane, result, before)
        probe_s += time.perf_counter() - probe_started
    result.probe_ms = probe_s * 1e3
    return result


def _grad_statistics(lane: LaneState, result: StepResult, before: dict[str, torch.Tensor]) -> None:
    """Gradient statistics of this step (a sampled probe: it syncs, outside the timed window)."""
    scale = result.scale
    if result.scaled and (scale is None or result.skipped is None):
        # The scale as the step began and found-inf are in pinned memory once the step is done.
        flight = result.in_flight
        lane.meter.wait(flight)
        if scale is None:
            scale = float(flight.scale_before[0])
        if result.skipped is None:
            result.skipped = float(flight.values[1]) > 0
    result.grad_stats = gradstats.model_grad_stats(lane.model, scale or 1.0)
    params = dict(zip(lane.param_names, lane.params, strict=True))
    for stats in result.grad_stats:
        # A skipped step moves no parameter on purpose: that is not an update lost to rounding.
        if stats.param in before and not result.skipped:
            param = params[stats.param]
            stats.lost_update_fraction = gradstats.lost_update_fraction(before[stats.param], param.detach(),
                                                                        param.grad)


def resolve_step(meter: HostMeter | CudaMeter, result: StepResult, *, wait: bool = False) -> StepResult:
    """Fill in the figures of a step whose copy to the host has landed (`wait`: wait for it, a host sync).

    A step that skipped or whose gradient norm is not finite names the parameters whose norm was inf/NaN when its
    gradients were long gone (counts of inf and NaN elements need the gradients themselves).
    """
    flight = result.in_flight
    if flight is None:
        return result
    if wait:
        meter.wait(flight)
    result.step_ms, scale_before, values = meter.receive(flight)
    result.in_flight = None
    result.loss = values[0]
    at = 1
    if result.scaled:
        if scale_before is not None:
            result.scale = scale_before
        found_inf, result.scale_after = values[1], values[2]
        if result.skipped is None:
            result.skipped = found_inf > 0
        at = 3
    if result.norm_names is not None:
        result.grad_norm = values[at]
        if (result.skipped or not math.isfinite(result.grad_norm)) and not result.bad_params:
            result.bad_params = [{"param": name, "grad_norm": str(norm)}
                                 for name, norm in zip(result.norm_names, values[at + 1:], strict=True)
                                 if not math.isfinite(norm)]
    return result


def record_step_events(sink: RecordSink, lane: int, result: StepResult) -> None:
    """What one lane step leaves beside its StepRecord: faults that fired, sampled gradient statistics, a skipped step
    with the parameters that overflowed, scale growth or backoff, inf/NaN gradients applied, a non-finite loss."""
    step = result.step
    for fired_step, fault in result.fired_faults:
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
    if (not result.skipped and result.grad_norm is not None and not math.isfinite(result.grad_norm)
            and result.bad_params):
        sink.event("nonfinite_grads", "the optimizer stepped with inf/NaN gradients (no scaler to catch them)",
                   lane, step, params=result.bad_params)
    if not math.isfinite(result.loss):
        sink.event("nonfinite_loss", f"loss is {result.loss}", lane, step)
