"""train_step(): one optimizer step of one lane, nanoGPT-shaped. No dtype or device branches: the Precision object
supplies the contexts and a scaler that is a no-op when disabled, the lane's Meter (telemetry) times and weighs.

Measuring must not change what is measured (DESIGN.md):
- The timed window holds the training work only: moving the batch, zero_grad, forward, backward, unscale, the
  gradient norm where clipping needs it, clipping, the optimizer step, the scaler update, the scheduler. A norm
  measured as a figure only is taken after it. Sampled probes (telemetry.sampled: parameter copies for lost updates,
  gradient statistics, the memory window's reads, forensics of a skipped step) and the saved-tensor probe run before
  or after the window and may sync; their host time is the step's `probe_ms`.
- The window is the lane's StepDriver's (telemetry.driver: `begin` and `end`, the one place that decides what it holds).
- A step adds no host sync of its own. Its figures (loss, scale, found-inf, gradient norms) are sent through the
  lane's meter and read by the run's StepRecorder once they are on the host (at once on a CPU). The syncs a lane step
  makes are the training's own: GradScaler.step reads found-inf unless the optimizer is fused; with a fused
  optimizer, a scaler and an LR schedule, found-inf is read so the schedule follows the steps really taken (a loop
  that does the same makes the same sync).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amp_core.config import RunConfig
from amp_core.precision import NO_CONTEXT, Precision, get_precision
from amp_core.probes.faults import FaultPlan, init_scale_override
from amp_core.probes.memory import SavedTensorsProbe
from amp_core.telemetry import Meter, OptimizerWatch, SamplingSchedule, StepDriver, StepResult, meter_for
from amp_core.telemetry.driver import PlainWork
from amp_core.telemetry.sampled import StepProbes, named_grad_norms
from amp_core.torch_private import scale_tensor
from amp_core.workloads import Workload


class _NoScheduler:
    """Stands in for an LR scheduler when there is none, so the step never asks."""

    def step(self) -> None:
        pass


@dataclass(slots=True, eq=False)
class LaneState:
    """Everything one lane trains with; what the step needs to know about it is decided once, here."""

    index: int
    precision: Precision
    workload: Workload
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    scheduler: object = field(default_factory=_NoScheduler)
    grad_clip: float = 0.0
    faults: FaultPlan = field(default_factory=FaultPlan)
    schedule: SamplingSchedule = field(default_factory=SamplingSchedule)
    """Which steps take the sampled figures (RunConfig's *_every fields)."""
    params: list[torch.nn.Parameter] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)
    meter: Meter = None
    watch: OptimizerWatch = None
    probes: StepProbes = None
    driver: StepDriver = None
    """Measures the lane's steps (telemetry.driver): its window, its plain steps, a full step's figures."""
    copies_pending: torch.cuda.Event | None = None
    """Recorded behind a snapshot's copies of this lane's state on their side stream (snapshots.PinnedCopies): the
    lane's stream waits for it, on the device, before its next optimizer step writes the state."""
    always_norm: bool = False
    """The gradient norm is measured on every step: clipping needs it, faults are planned, or the mode's gradients
    can overflow (Precision.watch_grads) where a step that took inf/NaN is not known on the host when it ends (no
    scaler, or a fused optimizer's skip decided on the device). Behind a GradScaler with an unfused optimizer a
    skipped step is known at once, and a skipped step has its norm measured anyway (StepDriver.finish)."""

    def __post_init__(self) -> None:
        self.bind_model(self.model)

    def bind_model(self, model: torch.nn.Module) -> None:
        """Train `model` (e.g. the lane's model wrapped in DDP: a run's lane-setup hook) with this lane's optimizer,
        scaler and meter."""
        self.model = model
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        if self.meter is None:
            self.meter = meter_for(self.precision.device)
        if self.watch is None:
            self.watch = OptimizerWatch(self.optimizer, self.scaler, unscaled_too=False)  # skips only
        self.probes = StepProbes(self.meter, model, self.param_names, self.params, self.optimizer, self.schedule)
        skip_known = self.watch.scaled and not self.watch.fused
        self.always_norm = bool(self.grad_clip or self.faults or (self.precision.watch_grads and not skip_known))
        driver = StepDriver(self.meter, self.probes, self.watch, self.scaler, always_norm=self.always_norm)
        if self.driver is not None:  # a model wrapped later (DDP) keeps the lane's place in the run's records
            driver.attach(self.driver.recorder, self.driver.track)
            driver.plain, driver.also_every = self.driver.plain, self.driver.also_every
        self.driver = driver

    def read_skip(self) -> bool | None:
        """Whether the step skipped: known at once (a host sync with a fused optimizer) when an LR schedule must
        follow the steps really taken, else possibly only when the figures arrive (None)."""
        return self.watch.skipped_now() if self.has_scheduler else self.watch.skipped()

    @property
    def plain(self) -> bool:
        """Whether the lane's steps that sample nothing may be plain ones (`plain_work`): a step of it needs nothing
        but the training work and its loss (no fault, clipping, LR schedule or per-step gradient norm). On a CPU
        (StepDriver.host_plain) its loss is on the host when the step ends, and it has no scaler; on CUDA
        (StepDriver.device_plain) its figures arrive later, as a full step's do, and a GradScaler may run where the
        host knows at once whether it skipped (an unfused optimizer: a skipped step then takes the full path)."""
        if self.scaler.is_enabled() and (self.meter.at_once or self.watch.fused):
            return False
        return not (self.always_norm or self.has_scheduler)

    @property
    def mode(self) -> str:
        return self.precision.mode

    @property
    def has_scheduler(self) -> bool:
        return not isinstance(self.scheduler, _NoScheduler)


def build_optimizer(config: RunConfig, model: torch.nn.Module, precision: Precision):
    """The lane's optimizer: the recipe decides (torch's, or torchao's low-bit / stochastic-rounding Adam(W))."""
    return precision.build_optimizer(model.parameters(), config.optimizer, lr=config.lr, eps=config.eps,
                                     fused=config.fused_optimizer)


def sampling_schedule(config: RunConfig) -> SamplingSchedule:
    """The run's sampled figures, as the telemetry schedules them."""
    return SamplingSchedule.of(config, amax_every=config.amax_every)


def build_lane_state(config: RunConfig, index: int, mode: str, base_model: torch.nn.Module, workload: Workload,
                     device: str, shard: Callable[[torch.nn.Module, Precision], None] | None = None) -> LaneState:
    """A lane's model (a copy of the shared initial model), optimizer, scheduler and scaler. `shard(model,
    precision)`: shards the prepared model in place (FSDP2's fully_shard) before the optimizer is built on the
    parameters that sharding puts in place of the model's own."""
    precision = get_precision(mode, device)
    model = precision.prepare_module(copy.deepcopy(base_model))
    if shard is not None:
        shard(model, precision)
    optimizer = build_optimizer(config, model, precision)
    s = config.scaler
    scaler = precision.make_scaler(init_scale_override(config.faults, mode) or s.init_scale, s.growth_factor,
                                   s.backoff_factor, s.growth_interval)
    state = LaneState(index=index, precision=precision, workload=workload, model=model, optimizer=optimizer,
                      scaler=scaler, grad_clip=config.grad_clip, faults=FaultPlan.for_lane(config.faults, mode),
                      schedule=sampling_schedule(config))
    if config.scheduler == "onecycle":
        state.scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=config.steps,
                                                              cycle_momentum=config.optimizer == "sgd")
    return state


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
    """One optimizer step of `lane` on `batch`; its figures are on their way (`telemetry.resolve_step` or a
    StepRecorder fills them in: at once on a CPU).

    The gradient norm (fp32) is measured where a figure needs it: when clipping, when faults are planned, when the
    mode's gradients can overflow, on gradient-statistics steps and on the schedule's grad-norm steps; it is not free
    (about 10 us on a CPU for a small model, a few kernels on CUDA). `measure_memory` runs the saved-tensor probe,
    reads the bytes held and, from step 1, the lane's allocator window (on a device that has one).
    """
    with lane.precision.step_context():
        # The step's own tensors (its batch on the device, loss, norms) die with _step's frame, inside the context:
        # on CUDA, a tensor freed after the lock is let go would lower another lane's allocator window.
        return _step(lane, batch, step, measure_memory, collect_grad_stats)


def plain_work(lane: LaneState) -> PlainWork:
    """The training work of a `LaneState.plain` lane's steps that sample nothing, for the driver's `host_plain` (a
    CPU) or `device_plain` (CUDA, which holds the lane's step context around it): `_step`'s work without the calls
    that do nothing on such a lane (faults, scaler, clipping, schedule, probes) and with what does not change from
    step to step decided once: the forward's context (one autocast object, entered and left each step: a new one is
    three Python calls more), the model, the loss and the optimizer; an input a CPU lane already holds in its dtype
    is not passed through `prepare_input` (a call with cold caches). On CUDA the optimizer's update waits, on the
    device, for a snapshot's copies of the state (`copies_pending`), as `_step`'s does; a GradScaler (CUDA only)
    scales the loss, steps and updates as in `_step` (it unscales inside `step`: the same numbers). Returns
    work(batch) -> (lr, loss); the records are those of `train_step` (tests/test_runner.py, test_honest_figures.py
    and, on CUDA, test_cuda.py hold them equal). Made when the loop begins, after every lane-setup hook has bound
    the model it trains (`bind_model`)."""
    precision, model, optimizer, loss_of = lane.precision, lane.model, lane.optimizer, lane.workload.loss
    prepare, dtype, here = precision.prepare_input, precision.param_dtype, precision.device == "cpu"
    forward = precision.forward_context()
    autocast = None if forward is NO_CONTEXT else forward
    scaler = lane.scaler if lane.scaler.is_enabled() else None  # CUDA only (LaneState.plain)
    watch = lane.watch

    def work(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, torch.Tensor]:
        inputs, targets = batch
        if not (here and inputs.is_cpu and inputs.dtype is dtype):
            inputs = prepare(inputs)
        if not (here and targets.is_cpu and not targets.is_floating_point()):
            targets = prepare(targets)
        optimizer.zero_grad(set_to_none=True)
        if autocast is None:
            loss = loss_of(model(inputs), targets)
        else:
            with autocast:
                loss = loss_of(model(inputs), targets)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
        lr = float(optimizer.param_groups[0]["lr"])
        if lane.copies_pending is not None:  # CUDA only: see _step (a wait on the device, no host sync)
            torch.cuda.current_stream(precision.device).wait_event(lane.copies_pending)
            lane.copies_pending = None
        if scaler is None:
            optimizer.step()
        else:  # whether it stepped: the watch's pre-hook (the host knows at once with an unfused optimizer)
            watch.begin()
            scaler.step(optimizer)
            scaler.update()
        return lr, loss

    if here and precision.cpu_context() is not NO_CONTEXT:  # an FP8 lane with oneDNN off for its steps
        return _under(precision.cpu_context, work)
    return work


def _under(context: Callable[[], contextlib.AbstractContextManager], work: PlainWork) -> PlainWork:
    """`work` with each call inside a fresh `context()`."""
    def switched(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, torch.Tensor]:
        with context():
            return work(batch)

    return switched


def _step(lane: LaneState, batch: tuple[torch.Tensor, torch.Tensor], step: int, measure_memory: bool,
          collect_grad_stats: bool) -> StepResult:
    precision, model, optimizer, scaler, faults = lane.precision, lane.model, lane.optimizer, lane.scaler, lane.faults
    driver = lane.driver
    window = driver.begin(step, scale_tensor(scaler), memory=measure_memory, grad_stats=collect_grad_stats,
                          saved_bytes=lambda: saved_tensor_bytes(lane, batch))
    batch = faults.perturb_batch(step, batch)
    inputs, targets = precision.prepare_input(batch[0]), precision.prepare_input(batch[1])
    optimizer.zero_grad(set_to_none=True)
    with precision.forward_context():
        loss = faults.scale_loss(lane.workload.loss(model(inputs), targets), step)
    scaler.scale(loss).backward()
    faults.corrupt_grads(step, model)
    scaler.unscale_(optimizer)
    norms = None
    if lane.grad_clip:
        norms = named_grad_norms(lane.param_names, lane.params)
        # Clipping by a non-finite norm multiplies every gradient by NaN (inf/inf or 0*inf), which would hide the
        # parameter that really overflowed; such a step is skipped (or diverges) anyway, so leave them.
        total = norms[0][1]
        torch.nn.utils.clip_grads_with_norm_(lane.params, lane.grad_clip,
                                             torch.where(torch.isfinite(total), total, torch.zeros_like(total)))
    lr_factor = faults.scale_lr(optimizer, step)
    lr = float(optimizer.param_groups[0]["lr"])  # torchao's optimizers keep it as a CPU tensor (no device sync)
    lane.watch.begin()
    if lane.copies_pending is not None:
        # A snapshot's copies read the state on a side stream: the update waits for them on the device (no host
        # sync); on a device that has no such copies this is never set.
        torch.cuda.current_stream(precision.device).wait_event(lane.copies_pending)
        lane.copies_pending = None
    scaler.step(optimizer)
    scaler.update()
    faults.restore_lr(optimizer, lr_factor)
    skipped = lane.read_skip()
    if not skipped:
        # The scheduler follows the optimizer: stepping it on a skipped step would shift the schedule.
        lane.scheduler.step()
    driver.end(window)
    return driver.finish(window, step, lr, loss, skipped=skipped, found_inf=lane.watch.found_inf, norms=norms,
                         memory=measure_memory, grad_stats=collect_grad_stats, fired_faults=faults.take_fired())
