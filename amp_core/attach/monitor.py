"""Monitor: AMP Lab's records from a user's own training loop, and from every rank of a torchrun job.

    from amp_core.attach.monitor import Monitor

    with Monitor(model, optimizer, scaler=scaler, scheduler=scheduler, name="my run") as monitor:
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            monitor.step(loss)          # once per optimizer step, after scaler.update(), before the next zero_grad

The run appears in the dashboard (same store, same records as a lane of the runner: loss, step time, LR, GradScaler
scale, skipped steps with the parameters that overflowed, gradient norm and statistics, memory) and is followed live.
Closing marks it finished; a script that dies without closing shows as interrupted (the store sees its process gone).

What a step measures, and what it costs:
- step time: from one `step()` call to the next, the Monitor's own work excluded (it is the record's `probe_ms`):
  perf_counter on a CPU; on CUDA two events on the current stream (CudaMeter), read when they have completed, so the
  Monitor adds no host sync to an ordinary step.
- skipped: exact. GradScaler calls `optimizer.step()` only when the gradients were finite, so a step hook on the
  optimizer (`Optimizer.register_step_pre_hook`) that did not fire says the step was skipped; a fused optimizer (which
  skips on the device) is handed `optimizer.found_inf` by GradScaler, read with the other figures. The scale backing
  off must agree: an event says so if it does not (telemetry.recorder.record_step_events).
- LR: what the optimizer held when its step began (a step pre-hook); on a skipped step, what it held after the
  previous step.
- gradient norm (fp32) every `grad_norm_every` steps and on skipped steps, gradient statistics every
  `gradstats_every` steps and on skipped steps while they stay within their part of `probe_budget` (they
  cast every gradient element to fp16 and bf16, and sync on CUDA: a large model's sample takes a while), memory every
  `memory_every` steps
  (bytes held by parameters, gradients and optimizer state; on CUDA also the allocator's peak of the step above its
  start, which resets the allocator's peak statistics on those steps). Activations are not measured: the Monitor does
  not run the user's forward.
- layer diagnostics (amp_core.probes.layerwatch) every `layers_every` steps, after a failed step (naming the first
  module that held inf/NaN) and on request: hooks on the user's model during that step only, figures kept on the
  device and read at the next flush; the hooks' host time is the step's probe_ms, not its step_ms.
- requests from the dashboard (amp_core.records.requests: "trace the next step", "layer numerics at the next step")
  are read from the store at each flush (rank 0) and answered after the next step.

Under torchrun (a process group initialised before the Monitor is created, e.g. for DDP), every rank's Monitor
measures its own rank and the figures are gathered to rank 0 at each flush (amp_core.records.ranks): every rank must
create the Monitor, call `step` equally often, and close it. With NCCL, call `torch.cuda.set_device(local_rank)` first.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from amp_core.attach.desk import NOT_SOON, MonitorDesk
from amp_core.attach.guard import EXTRA_CALL_EVENT, MISSED_CALL_EVENT, Guard, reason, usage_error
from amp_core.attach.saved import SOURCE, attached_run_config, user_module
from amp_core.config import ConfigError, SamplingSettings
from amp_core.diagnostics.attached_replay import (
    REPLAY_SETTINGS,
    AttachedReplay,
    LossFn,
    ReplayOnFailure,
)
from amp_core.precision import MODES, mode_from_dtypes
from amp_core.records.opening import open_store
from amp_core.records.ranks import RankSink
from amp_core.records.sink import RecordSink, new_run_id
from amp_core.records.store import RunStore
from amp_core.telemetry import OptimizerWatch, SamplingSchedule, StepDriver, StepRecorder, StepResult, meter_for
from amp_core.telemetry.meters import Window
from amp_core.telemetry.sampled import GradFigures, StepProbes
from amp_core.torch_private import scale_tensor

LANE = 0
"""A Monitor's run has one lane (its mode); under torchrun, one track per rank."""
MONITOR_FLUSH_EVERY_S = 1.0
"""A Monitor's flush cadence: the dashboard redraws every second, and a flush (a few ms on the loop's own thread) twice
as often would cost a loop of a few ms per step half a percent."""


def _whole(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be a whole number >= {minimum}, got {value!r}")


def _block_formats(config: MonitorConfig) -> None:
    """MonitorConfig.block_formats as a tuple of block-scaled options' names; ConfigError naming the choices."""
    from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS

    names = [option.name for option in BLOCK_SCALED_OPTIONS]
    value = (config.block_formats,) if isinstance(config.block_formats, str) else config.block_formats
    if not isinstance(value, (tuple, list)) or any(name not in names for name in value):
        raise ConfigError("block_formats", f"must name block-scaled formats from {', '.join(names)}; got "
                                           f"{config.block_formats!r}")
    object.__setattr__(config, "block_formats", tuple(dict.fromkeys(value)))


@dataclass(kw_only=True, slots=True, frozen=True)
class MonitorConfig(SamplingSettings):
    """How a Monitor records a loop; saved with the run, with what the Monitor saw of the loop (see Monitor). Its
    sampled figures' settings (grad_norm_every, gradstats_every, memory_every) are SamplingSettings', the race's."""

    name: str = ""
    """Label shown in run pickers."""
    mode: str = ""
    """Precision mode in Lightning's names (32-true, tf32, 16-mixed, bf16-mixed, 16-true, bf16-true); empty: seen from
    the loop (the autocast dtype of the model's first forward, else the parameters' dtype)."""
    workload: str = ""
    """What the runs list calls the model; empty: the model's class name."""
    total_steps: int = 0
    """Optimizer steps the loop will make (for progress); 0: the scheduler's total_steps where it has one, else
    unknown."""
    probe_budget: float = 0.0025
    """The share of the loop's own time the costly sampled probes may take together, so that watching a model does
    not slow it: gradient statistics (every element of every gradient cast to fp16 and bf16: ~20 ms for 350k
    parameters on a CPU core) on their sampled and skipped steps, and layer diagnostics on their sampled steps. Each
    gets half of it while both are on (`gradstats_every`, `layers_every`), either alone all of it (`probe_share`),
    so neither starves the other; each is taken only while what it took so far stays within its part; 0 lifts the
    limit."""
    flush_every_s: float = MONITOR_FLUSH_EVERY_S
    """The store gets the records at least this often (a kill -9 loses less than this); each flush is a SQLite
    transaction on the loop's thread (a few ms)."""
    layers_every: int = 200
    """Every N steps while within its part of `probe_budget` (and after a failed step, and on request, always) each
    module's output and output-gradient ranges are measured by hooks during the step (amp_core.probes.layerwatch): the
    race's layer amax heatmap, with the shares a cast to fp16 / bf16 / fp8 overflows, makes subnormal or flushes to
    zero; 0 samples only after failed steps and on request. The hooks' host time is the step's probe time, not its
    step time; a watched step costs a few steps' time on a CPU, so on a small model the budget spaces them further."""
    block_formats: tuple[str, ...] = ()
    """Block-scaled formats (`mxfp8`, `nvfp4`, `fp8-blockwise`, or any block-scaled option's name) each Linear's GEMM
    operands are quantised in on the steps the layer watch watches, by hooks in the step (amp_core.probes.block_watch):
    per layer and operand the SNR, the share flushed to zero in its block and the blocks whose scale saturates or
    underflows, a `block_sample` event per watched step; its time counts in the layer watch's part of the budget."""
    integration: str = ""
    """What drives the Monitor: empty for the user's own loop, else the trainer whose callback made it ("Hugging Face
    Trainer", "Lightning"): the Train page says where the run comes from."""
    replay: str | bool = "auto"
    """Replay a failed step in its mode, 32-true, 16-mixed, bf16-mixed and float64 from the state before it, to tell
    precision from data (amp_core.diagnostics.attached_replay). "auto": the steps the scaler skipped (their state is
    copied then, as the skip left it: nothing on the other steps), when the Monitor is given a `loss_fn` (the
    callbacks give theirs) and the state (weights, buffers, optimizer state) is at most 64 MiB; off otherwise with
    the reason and the bytes said. True: every failed step (skipped, a non-finite loss, a loss above the robust
    band), keeping a host copy of the state before each step (outside the timed window). False: off. A plain loop
    passes each step's batch: `monitor.step(loss, batch=...)`."""
    replay_max: int = 3
    """Replays per run at most (each runs the step in five formats); one per run of consecutive failed steps."""
    failing_step: bool = True
    """Name the first inf/NaN module of the step that failed, not the next one (amp_core.probes.nonfinite): on a CPU
    the step's forward replayed with a hook on each leaf (before the update when its output was not finite; after a
    step the scaler skipped, with nothing summed on the others); elsewhere device-side flags per leaf module, written
    on every forward without a sync and read only when a step fails."""

    def __post_init__(self) -> None:
        SamplingSettings.__post_init__(self)
        if not isinstance(self.name, str) or not isinstance(self.workload, str) \
                or not isinstance(self.integration, str):
            raise ConfigError("name", "name, workload and integration are text")
        if self.mode and self.mode not in MODES:
            raise ConfigError("mode", f"unknown mode {self.mode!r}; choose from {', '.join(MODES)} (or leave it "
                                      "empty: the Monitor sees it from the loop)")
        _whole("total_steps", self.total_steps, 0)
        _whole("layers_every", self.layers_every, 0)
        _whole("replay_max", self.replay_max, 0)
        _block_formats(self)
        if self.replay not in REPLAY_SETTINGS or (self.replay == 1 and self.replay is not True) \
                or (self.replay == 0 and self.replay is not False):
            raise ConfigError("replay", f"must be 'auto', True or False, got {self.replay!r}")
        if isinstance(self.probe_budget, bool) or not isinstance(self.probe_budget, (int, float)) \
                or not 0 <= self.probe_budget < 1:
            raise ConfigError("probe_budget", f"must be a share of the loop's time in [0, 1), got "
                                              f"{self.probe_budget!r}")
        if isinstance(self.flush_every_s, bool) or not isinstance(self.flush_every_s, (int, float)) \
                or not math.isfinite(self.flush_every_s) or self.flush_every_s <= 0:
            raise ConfigError("flush_every_s", f"must be > 0, got {self.flush_every_s!r}")

    def probe_share(self) -> float:
        """The part of `probe_budget` that gradient statistics and layer diagnostics may each take: half while both are
        sampled, all of it where one is off (its samples after failed steps take the same part)."""
        return self.probe_budget / 2 if self.gradstats_every and self.layers_every else self.probe_budget


class Monitor:
    """Records a user's training loop into the AMP Lab store (see the module's docstring).

    `Monitor(model, optimizer, scaler=None, scheduler=None, *, name="", mode="", store=None, **settings)`:
    `store` is a RunStore or a path (default: $AMP_LAB_STORE or ~/.amp_lab/runs.sqlite3; under torchrun only rank 0
    opens it); `settings` are MonitorConfig's fields; `process_group`: the group to gather ranks over (default: the
    job's default group, when one is initialised). ConfigError for a bad setting; StoreError if the store cannot
    be used.

    A Monitor is optimizer hooks (an OptimizerWatch) and a step driver (telemetry.driver: the timed window from one
    `step` to the next, plain or full steps from the SamplingSchedule, a StepRecorder writing the records), exactly as
    a lane of the race; its diagnostics hang on it as hooks (desk.py: layer watch, requests, op traces;
    diagnostics.attached_replay: replays). Extension point: `step_hooks`, callables `(monitor, result)` run at the end
    of every `step()` on the loop's thread, after the step was measured and handed to the recorder (`result`: a
    telemetry.StepResult; on CUDA its device figures may still be on their way); while there are any, every step takes
    the full path. They must not sync the device; an integration (a Trainer callback) hangs here.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None = None, scheduler=None, *, name: str = "", mode: str = "",
                 store: RunStore | str | os.PathLike | None = None, process_group=None, loss_fn: LossFn | None = None,
                 replay_without: tuple = (), **settings):
        self.config = config = MonitorConfig(name=name, mode=mode, **settings)
        self.loss_fn = loss_fn
        """The loop's loss as a function of (model, batch), for replays (or given to `step`)."""
        self.grad_clip = 0.0
        """The loop's gradient clipping (max norm; 0: none), which a replay applies too (the callbacks set it).
        `replay_without`: objects the replay's copy of the model must leave out (a Lightning module's trainer)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.inner_model = user_module(model)
        """The user's module inside a DDP wrapper (parameter and module names as the user wrote them)."""
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        # Every parameter, frozen ones too: one unfrozen mid-run (or put in a param group added then) is measured
        # from the step it gets a gradient (the gradient figures read the parameters that have one).
        named = list(self.inner_model.named_parameters())
        if not named:
            raise ConfigError("model", "the model has no parameters")
        params = [p for _, p in named]
        first = next((p for p in params if p.requires_grad), params[0])
        self.device = first.device
        self._param_dtype = first.dtype
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        if self.world_size > 1 and dist.get_backend(process_group) == "nccl" and (
                self.device.type != "cuda" or self.device.index != torch.cuda.current_device()):
            raise ConfigError("process_group", f"NCCL gathers through the current CUDA device (cuda:"
                                               f"{torch.cuda.current_device()}) but the model is on {self.device}: "
                                               "call torch.cuda.set_device(local_rank) before creating the Monitor")
        opened = None
        if self.rank == 0:
            opened = store if isinstance(store, RunStore) else open_store(store)
        self._ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self.world_size > 1:
            self._sink: RecordSink | RankSink = RankSink(new_run_id(), opened, group=process_group,
                                                         flush_every_s=config.flush_every_s, check_skips=self._ddp)
        else:
            self._sink = RecordSink(new_run_id(), opened, config.flush_every_s)
        self.run_id = self._sink.run_id
        self.mode = config.mode
        self.steps_done = 0
        self.closed = False
        self.step_hooks: list[Callable[[Monitor, StepResult], None]] = []
        """Run at the end of every `step()` (see the class docstring)."""
        self.guard = Guard(self.note, config.name or self.run_id)
        """The Monitor's own failures, kept from the loop (amp_core.attach.guard)."""
        self._unchecked = True
        """The next call of `step` takes its first look (the loss is usable) or finds the Monitor closed."""
        self._extra_calls = 0
        """`step` calls with no optimizer step since the last one (not recorded)."""
        self._missed = 0
        """Optimizer steps that `step` was not called for, told so far."""
        self._taken: GradFigures | None = None
        """The gradient figures of the step under way, taken where its gradients surely existed (`_take_grads`)."""
        self.loop_s = 0.0
        """The loop's own host time between step() calls (what probe_budget compares the probes' with: the loop's,
        not the process's, which may be doing other things)."""
        self._watch = OptimizerWatch(optimizer, self.scaler, see_update=True)
        self._watch.on_skip = self._take_grads  # a skipped step's gradients, before the loop clears them
        meter = meter_for(self.device)
        probes = StepProbes(meter, self.inner_model, [n for n, _ in named], params, optimizer,
                            SamplingSchedule.of(config, probe_budget=config.probe_share()), lost_updates=False)
        self._driver = StepDriver(meter, probes, self._watch, self.scaler)
        self._driver.contain = self.guard.failed
        self.host_reads_free = meter.at_once
        """The step's figures are on the host as soon as they exist (a CPU): reading one waits for nothing."""
        self._host_plain = meter.at_once and self.scaler is None
        """Plain steps are timed and kept inline (`step`), as StepDriver.host_plain keeps a race lane's: a CPU, no
        scaler (whose scale each step would send)."""
        self._clock = meter.clock if self._host_plain else None
        """The host meter's clock, which a host plain window is read from."""
        self._host_start: float | None = None
        """The open window's start when it is a host plain one (None: `_window` is the open window)."""
        self._recorder = StepRecorder(self._sink)
        self._replay = AttachedReplay(self.inner_model, optimizer, self.scaler, config.replay, config.replay_max,
                                      without=replay_without, has_loss_fn=loss_fn is not None)
        self._replays = ReplayOnFailure(self._replay, lambda kind, message, step, **data: self.note(
            kind, message, at_step=step, **data), self._settle)
        self._lr_next = float(optimizer.param_groups[0]["lr"])
        self._autocast_seen: tuple[bool, torch.dtype | None] | None = None
        self._forward_hook = None
        if not self.mode:
            self._forward_hook = model.register_forward_pre_hook(self._see_autocast)
        else:
            self._open()
        atexit.register(_flush_at_exit, weakref.ref(self))
        # Layer diagnostics and the dashboard's requests ride on the recorder and the driver, like any extension.
        self._desk = MonitorDesk(self, opened, self._driver)
        self._layers = self._desk.layers
        self._recorder.on_record.append(self._desk.recorded)
        if self._replay.on:  # the band of a failed step's replay: the losses as they are recorded
            self._recorder.on_record.append(self._replays.recorded)
        self._driver.watchers += (self._desk.full_at, self._hooks_watch)
        self._due = 0.0
        """A plain step that begins its bookkeeping at this time (`time.perf_counter()`, what `step` reads as `began`)
        takes the full path: a flush or a layer read is due (`_set_due`)."""
        self._begin(0)

    # --- the user's loop -----------------------------------------------------------------------------------------
    def step(self, loss: torch.Tensor | float, samples: int | None = None, *, batch: Any = None,
             loss_fn: LossFn | None = None) -> None:
        """Record one optimizer step: call once per iteration, after the optimizer's step (`scaler.update()`), before
        or after `zero_grad()` and the scheduler's step (the gradient figures are taken during the optimizer's step:
        docs/monitor.md). `loss`: the step's loss, a number or a one-element tensor on any device (a usage error
        otherwise, the only error the Monitor raises into the loop). `samples`: the batch's size, for samples/s.
        `batch` (the step's batch, as the loss closure takes it) and `loss_fn(model, batch) -> loss` (or the Monitor's
        `loss_fn`): what a replay of this step needs when it fails (MonitorConfig.replay). A call with no optimizer
        step since the last one is not recorded (an event says so, once)."""
        # A plain step (decided when its window opened) keeps its figures for the next drain, unless the scaler
        # skipped it, a flush or a layer read is due, or its loss is known not to be finite (the full path then).
        start = self._host_start
        if start is not None:  # a host plain window (`_host_plain`; none is open once closed): its end is this read
            # What `end`, `keep` and `open_plain` do, inline: the step kept as StepDriver.host_plain keeps a race
            # lane's (a plain step's Python runs with cold caches right after the loop's work: each call and each
            # attribute read counts, so `is_plain`'s own first test is made here, the deadline is on the clock read
            # already, and nothing is read that this path does not use).
            began = self._clock()
            driver, watch, step = self._driver, self._watch, self.steps_done
            if watch.stepped:
                lr = watch.lr_used
            elif watch.steps_seen:  # no optimizer step since the last call: not a step (its window goes on)
                self._extra_call()
                return
            else:  # an optimizer whose steps the hook has not seen (yet)
                lr = self._lr_next
            self.loop_s += began - start
            self._host_start = None
            if (step < driver.plain_until or driver.is_plain(step)) and began < self._due:
                try:  # a CPU: the read waits for nothing
                    value = loss.item() if isinstance(loss, torch.Tensor) else float(loss)
                except Exception:
                    self._refuse(loss)
                    value = math.nan  # a loss the checks pass that still cannot be read: the full path tells it
                if math.isfinite(value):
                    self._lr_next = float(self.optimizer.param_groups[0]["lr"])
                    self.steps_done = step = step + 1
                    # Kept (HOST_KEPT) with the Monitor's own host time on it so far; the next window opens after.
                    driver.host_kept.append((step - 1, lr, start, began, value, samples, self._clock() - began))
                    if step < driver.plain_until or driver.is_plain(step):
                        watch.stepped = False
                        self._host_start = self._window_host = self._clock()
                    else:
                        self._begin(step)
                    return
            window = Window(start, began)
        else:
            if self._unchecked:  # the first call, or one after close()
                self._first_call(loss)
            driver, watch, window = self._driver, self._watch, self._window
            if not (watch.stepped or watch.skipped_seen) and watch.steps_seen:
                self._extra_call()  # no optimizer step since the last call: not a step (its window goes on)
                return
            driver.end(window)
            began = time.perf_counter()
            self.loop_s += began - self._window_host
            step = self.steps_done
            lr = watch.lr_used if watch.stepped or watch.skipped_seen else self._lr_next
            try:
                kept = (driver.is_plain(step) and (watch.stepped or not watch.scaled) and began < self._due
                        and driver.keep(window, step, lr, loss, samples, time.perf_counter() - began))
            except Exception as exc:
                self._refuse(loss)
                self._lost(exc, step)
                return
            if kept:
                self._lr_next = float(self.optimizer.param_groups[0]["lr"])
                self.steps_done = step = step + 1
                if driver.is_plain(step):  # the next window as `_begin` opens it, with nothing sampled on it
                    watch.stepped = False
                    self._window_host = time.perf_counter()
                    self._window = driver.open_plain(scale_tensor(self.scaler) if watch.scaled else None)
                else:
                    self._begin(step)
                return
        # A watched step's layer hooks ran inside its window, and so did the gradient figures taken in the
        # optimizer's step: their host time is probe time, not step time.
        taken, self._taken = self._taken, None
        hooked_s = self._layers.hooks_so_far_s() + (taken.seconds if taken is not None else 0.0)
        window.excluded_s = hooked_s
        if driver.track is None:
            self._open()
        schedule, skipped = driver.schedule, watch.skipped()
        try:
            result = driver.finish(window, step, lr, loss, skipped=skipped, found_inf=watch.found_inf,
                                   memory=schedule.memory(step), grad_stats=schedule.grad_stats(step),
                                   loop_s=self.loop_s, taken=taken)
        except Exception as exc:
            self._refuse(loss)
            self._lost(exc, step)
            return
        self._lr_next = float(self.optimizer.param_groups[0]["lr"])
        result.probe_ms = (time.perf_counter() - began + hooked_s) * 1e3
        driver.record(result, samples)
        self.steps_done = step + 1
        guard = self.guard
        try:
            self._desk.after_step(result)
        except Exception as exc:
            self._desk.failed(exc, step)
        for hook in self.step_hooks:
            try:
                hook(self, result)
            except Exception as exc:
                if not guard.failed(f"step hook {getattr(hook, '__qualname__', hook)!s}", exc, step):
                    self.step_hooks.remove(hook)
        if self._replay.on:  # after the step was measured: its window is closed, the next one not yet open
            try:
                self._replays.after_step(run_id=self.run_id, mode=self.mode, device=str(self.device),
                                         grad_clip=self.grad_clip, step=step, loss=loss, skipped=skipped,
                                         batch=batch, loss_fn=loss_fn or self.loss_fn,
                                         loss_on_host=result.loss if result.filled else None)
            except Exception as exc:
                self._replay_failed(exc, step)
        # The flush's own time is the store's (RecordSink.write_seconds): outside this step's window and the next.
        try:
            self._sink.flush_if_due()
        except Exception as exc:
            guard.failed("the store", exc, step)
        self._begin(self.steps_done)

    def _first_call(self, loss: Any) -> None:
        """The first call of `step`: a loss it cannot record is refused here, with what to change; after close(),
        every call is refused."""
        if self.closed:
            raise RuntimeError("Monitor.step() after close(): step the Monitor inside its `with` block, or before "
                               "close()")
        self._refuse(loss)
        self._unchecked = False

    def _refuse(self, loss: Any) -> None:
        """Raise the usage error of a loss `step` cannot record (TypeError, one line); nothing when it is usable."""
        wrong = usage_error(loss)
        if wrong is not None:
            raise TypeError(f"Monitor.step(loss): {wrong}")

    def _lost(self, exc: Exception, step: int) -> None:
        """The step's record could not be made though its loss is usable (the Monitor's own failure): told (an event
        for each such step, one line on stderr), and the loop goes on to the next step."""
        self.guard.failed("the step record", exc, step)
        self.steps_done = step + 1
        self._begin(self.steps_done)

    def _extra_call(self) -> None:
        """`step` called with no optimizer step since the last call (twice for one step, or in every micro-step of
        gradient accumulation): not recorded, told once."""
        self._extra_calls += 1
        if self._extra_calls == 1:
            message = (f"Monitor.step was called at step {self.steps_done} with no optimizer step since the last "
                       "call: such calls are not recorded (call it once per optimizer step)")
            self.guard.say(EXTRA_CALL_EVENT, message)
            self.note(EXTRA_CALL_EVENT, message)

    def _missed_calls(self) -> None:
        """The optimizer took steps `step` was not called for (each call records one step, whatever the optimizer
        took since the last): told once per new count, at the next full step."""
        missed = self._watch.steps_seen - self.steps_done - self._missed
        if missed <= 0:
            return
        self._missed += missed
        message = (f"the optimizer took {self._missed} step(s) that Monitor.step was not called for (by step "
                   f"{self.steps_done}): each call records one step, with the LR of the last optimizer step")
        self.guard.say(MISSED_CALL_EVENT, message)
        self.note(MISSED_CALL_EVENT, message, missed=self._missed)

    def _take_grads(self, skipped: bool) -> None:
        """The optimizer watch's capture: the gradient figures of the step under way, taken in the optimizer's step
        (or as GradScaler's update begins on a skipped step), where the gradients surely exist."""
        step = self.steps_done
        try:
            self._taken = self._driver.probes.take_grads(self._driver.schedule.grad_stats(step), skipped, self.loop_s,
                                                         self._scale_now)
        except Exception as exc:
            if not self.guard.failed("the gradient figures", exc, step):
                self._watch.on_skip = None

    def _scale_now(self) -> float | None:
        """The scale the gradients were scaled by (a sync on CUDA: gradient-statistics steps only)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def _replay_failed(self, exc: Exception, step: int) -> None:
        if not self.guard.failed("the replay of failed steps", exc, step):
            self._replay.switch_off(f"replay is off: it failed twice (the last time: {exc})")

    def _begin(self, step: int) -> None:
        """Open step `step`: the state kept for replays (replay=True), then the driver's windows (the sampled probes',
        then the timed one, which takes the scale the step begins with)."""
        if self._replay.every_step:
            try:
                self._replays.before_window()
            except Exception as exc:
                self._replay_failed(exc, step)
        watch = self._watch
        watch.begin()
        if watch.steps_seen > step + self._missed:  # hook-counted optimizer steps beyond the calls
            self._missed_calls()
        plain = self._driver.replan(step)  # what the last step recorded (a failure) may watch this one
        schedule = self._driver.schedule
        # A step whose gradient figures are sampled takes them in the optimizer's step (OptimizerWatch.capture).
        watch.capture = None if plain or not (schedule.grad_norm(step) or schedule.grad_stats(step)) \
            or not self.guard.on("the gradient figures") else self._take_grads
        if not (self._driver.kept or self._driver.host_kept):
            self._set_due()
        if plain and self._host_plain:  # `begin(plain=True)` is the meter's open alone: its clock read, kept here
            self._host_start = self._window_host = self._clock()
        else:
            self._window_host = time.perf_counter()
            self._window = self._driver.begin(step, scale_tensor(self.scaler), plain=plain)

    def _set_due(self) -> None:
        """When a plain step must give way to the full path (`_due`): the layer watch's read or the store's flush is
        due (both on `time.monotonic()`), moved to `time.perf_counter()`, which a step has read already (the host
        meter's clock is perf_counter: HostMeter.clock)."""
        due = min(self._desk.read_at, self._sink.flush_due_at) if self._driver.plain else 0.0
        self._due = due - time.monotonic() + time.perf_counter() if due else 0.0

    def _hooks_watch(self, step: int) -> int:
        """The driver's FullStepAt for `step_hooks`: while there are any, every step is full."""
        return step if self.step_hooks else NOT_SOON

    def _settle(self) -> None:
        """Every step measured so far becomes a record (a host sync on CUDA)."""
        self._driver.drain()
        self._recorder.resolve(wait=True)

    @property
    def replay_on(self) -> bool:
        """Failed steps are replayed (MonitorConfig.replay): a caller keeps each step's batch for `step`."""
        return self._replay.on

    def flush(self) -> None:
        """Write what was recorded now (otherwise every `flush_every_s`); under torchrun every rank calls it."""
        self._driver.drain()
        self._recorder.resolve()
        self._desk.answer()
        try:
            self._sink.flush()
        except Exception as exc:
            self.guard.failed("the store", exc, self.steps_done)
        # A request taken, or a failure recorded, here watches the coming steps: they take the full path again.
        if self._driver.replan(self.steps_done):
            self._watch.capture = None  # a window opened full that turns out plain samples nothing
        self._set_due()

    def close(self, status: str = "finished", error: str = "") -> None:
        """The last records and the run's final status (finished, unless told otherwise); idempotent. Under
        torchrun every rank calls it. Nothing here raises: a part that fails is told (an event, a line on stderr)
        and the rest is still written."""
        if self.closed:
            return
        self.closed = self._unchecked = True
        self._host_start = None  # no window is open: `step` raises
        step = self.steps_done
        for what, part in (("the optimizer hooks", self._watch.remove), ("the layer watch", self._desk.close),
                           ("the last records", self._settle), ("the page's requests", self._desk.answer)):
            try:
                part()
            except Exception as exc:
                self.guard.failed(what, exc, step)
        if self._forward_hook is not None:
            self._forward_hook.remove()
        try:
            if self._driver.track is None:
                self._open()
            self._replays.say_cost()
            self._sink.event(status, f"run {status}" + (f": {error}" if error else ""))
            self._sink.close(status, [(LANE, status, error)])
        except Exception as exc:
            self.guard.failed("the store", exc, step)

    def note(self, kind: str, message: str, at_step: int | None = None, **data) -> None:
        """Record an event of the run (at `at_step`, default the step the Monitor is at): what an integration saw of
        the trainer, e.g. a precision asked and not applied."""
        self._sink.event(kind, message, LANE, self.steps_done if at_step is None else at_step, **data)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """Close: finished; a KeyboardInterrupt: interrupted; any other exception: failed, with the reason. The
        exception goes on to the caller unchanged (close itself raises nothing)."""
        if exc_type is None:
            self.close()
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("interrupted", "the script was interrupted (KeyboardInterrupt)")
        else:
            self.close("failed", f"the script raised {reason(exc)}")

    def _see_autocast(self, module, args) -> None:
        device_type = self.device.type
        enabled = torch.is_autocast_enabled(device_type)
        self._autocast_seen = (enabled, torch.get_autocast_dtype(device_type) if enabled else None)
        self._forward_hook.remove()  # once is enough: a loop keeps its precision
        self._forward_hook = None

    # --- the run in the store ---------------------------------------------------------------------------------
    def _open(self) -> None:
        """Register the run (on the first step when the mode is seen from the loop); from then on the steps that
        sample nothing may be plain (not under torchrun, where the ranks flush by counting steps; not with a fused
        optimizer, whose skips only the device knows; not with a copy of the state before each step)."""
        if not self.mode:
            enabled, dtype = self._autocast_seen or (False, None)
            self.mode = mode_from_dtypes(dtype if enabled else None, self._param_dtype, self.device.type)
        saved = attached_run_config(self.config, model=self.inner_model, optimizer=self.optimizer,
                                    scheduler=self.scheduler, scaler=self.scaler, mode=self.mode,
                                    fused=self._watch.fused, world_size=self.world_size, ddp=self._ddp,
                                    replay=self._replay.describe())
        self._sink.open(saved, str(self.device), torch.__version__,
                        [{"source": SOURCE, "ranks": self.world_size}])
        self._driver.attach(self._recorder, self._recorder.track(LANE, self.mode, self._driver.meter))
        self._driver.plain = not (self._sink.counts_calls or self._watch.fused or self._replay.every_step)
        self._replays.say_setting()

    @property
    def _opened_run(self) -> bool:
        return self._driver.track is not None


def _flush_at_exit(ref: weakref.ref) -> None:
    """A script ending without closing its Monitor: its records are written (rank 0's own under torchrun: the other
    ranks may be gone), its status left running, so the store sees the process gone and marks it interrupted."""
    monitor = ref()
    if monitor is None or monitor.closed or not monitor._opened_run:
        return
    try:
        monitor._settle()
        if isinstance(monitor._sink, RankSink):
            monitor._sink.flush_own()
        else:
            monitor._sink.flush()
    except Exception as exc:  # at exit, a message rather than a second traceback
        print(f"AMP Lab Monitor: the last records of run {monitor.run_id} could not be written: {exc}",
              file=sys.stderr)
