"""Monitor: AMP Lab's records from a user's own training loop, and from every rank of a torchrun job.

    from amp_core.monitor import Monitor

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
  `gradstats_every` steps and on skipped steps while the probes stay within `probe_budget` of the loop's time (they
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
import socket
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from amp_core.config import ConfigError
from amp_core.diagnostics.attached_replay import (
    REPLAY_COST_EVENT,
    REPLAY_OFF_EVENT,
    REPLAY_ON_EVENT,
    REPLAY_SETTINGS,
    AttachedReplay,
    LossFn,
)
from amp_core.diagnostics.replay_modes import REPLAYED_EVENT, report_data
from amp_core.precision import MODES, mode_from_dtypes
from amp_core.probes.layerwatch import FIRST_NONFINITE_EVENT, LayerWatch
from amp_core.probes.nonfinite import NonfiniteSentinel
from amp_core.records.opening import open_store
from amp_core.records.ranks import RankSink
from amp_core.records.requests import LAYERS, TRACE, Desk
from amp_core.records.sink import RecordSink, new_run_id
from amp_core.records.store import RunStore
from amp_core.telemetry import LaneTrack, OptimizerWatch, SamplingSchedule, StepRecorder, StepResult, meter_for
from amp_core.telemetry.recorder import send_figures
from amp_core.telemetry.sampled import NOTHING_OPENED, StepProbes, named_grad_norms
from amp_core.torch_private import scale_tensor, scaler_settings

LANE = 0
"""A Monitor's run has one lane (its mode); under torchrun, one track per rank."""
MONITOR_FLUSH_EVERY_S = 1.0
"""A Monitor's flush cadence: the dashboard redraws every second, and a flush (a few ms on the loop's own thread) twice
as often would cost a loop of a few ms per step half a percent."""
SOURCE = "monitor"
"""`source` in the config a Monitor saves: how the pages tell a watched script from a run they can control."""


def _whole(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be a whole number >= {minimum}, got {value!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class MonitorConfig:
    """How a Monitor records a loop; saved with the run, with what the Monitor saw of the loop (see Monitor)."""

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
    grad_norm_every: int = 25
    """Measure the gradient norm (fp32) every N steps (and on every skipped step)."""
    gradstats_every: int = 50
    """Gradient range histograms every N steps (and on every skipped step); 0 turns them off."""
    memory_every: int = 25
    """Measure memory on steps 0, 1 and every N steps; other steps carry the figures."""
    probe_budget: float = 0.0025
    """Gradient statistics (every element of every gradient cast to fp16 and bf16: ~20 ms for 350k parameters on a
    CPU core) are taken on their sampled and skipped steps, and layer diagnostics on their sampled steps, each only
    while they have taken at most this share of the loop's own time so far, so that watching a model does not slow
    it; 0 lifts the limit."""
    flush_every_s: float = MONITOR_FLUSH_EVERY_S
    """The store gets the records at least this often (a kill -9 loses less than this); each flush is a SQLite
    transaction on the loop's thread (a few ms)."""
    layers_every: int = 200
    """Every N steps while within `probe_budget` (and after a failed step, and on request, always) each module's
    output and output-gradient ranges are measured by hooks during the step (amp_core.probes.layerwatch): the race's
    layer amax heatmap, with the shares a cast to fp16 / bf16 / fp8 overflows, makes subnormal or flushes to zero; 0
    samples only after failed steps and on request. The hooks' host time is the step's probe time, not its step
    time; a watched step costs a few steps' time on a CPU, so on a small model the budget spaces them further."""
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
    """Name the first inf/NaN module of the step that failed, not the next one: device-side flags per leaf module,
    written on every forward without a sync and read only when a step fails (amp_core.probes.nonfinite)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not isinstance(self.workload, str) \
                or not isinstance(self.integration, str):
            raise ConfigError("name", "name, workload and integration are text")
        if self.mode and self.mode not in MODES:
            raise ConfigError("mode", f"unknown mode {self.mode!r}; choose from {', '.join(MODES)} (or leave it "
                                      "empty: the Monitor sees it from the loop)")
        _whole("total_steps", self.total_steps, 0)
        _whole("grad_norm_every", self.grad_norm_every, 1)
        _whole("gradstats_every", self.gradstats_every, 0)
        _whole("memory_every", self.memory_every, 1)
        _whole("layers_every", self.layers_every, 0)
        _whole("replay_max", self.replay_max, 0)
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


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP (or DataParallel) wrapper: parameter names as the user wrote them."""
    return model.module if isinstance(model, (torch.nn.parallel.DistributedDataParallel,
                                              torch.nn.DataParallel)) else model


def _scheduler_name(scheduler) -> str:
    if scheduler is None:
        return "none"
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        return "onecycle"
    return type(scheduler).__name__


class Monitor:
    """Records a user's training loop into the AMP Lab store (see the module's docstring).

    `Monitor(model, optimizer, scaler=None, scheduler=None, *, name="", mode="", store=None, **settings)`:
    `store` is a RunStore or a path (default: $AMP_LAB_STORE or ~/.amp_lab/runs.sqlite3; under torchrun only rank 0
    opens it); `settings` are MonitorConfig's fields; `process_group`: the group to gather ranks over (default: the
    job's default group, when one is initialised). ConfigError for a bad setting; StoreError if the store cannot
    be used.

    A Monitor is a driver of the telemetry layer: an OptimizerWatch on the optimizer, a Meter window from one `step`
    to the next, the sampled probes on the SamplingSchedule, and a StepRecorder writing the records, exactly as a
    lane of the race. Extension point: `step_hooks`, callables `(monitor, result)` run at the end of every `step()`
    on the loop's thread, after the step was measured and handed to the recorder (`result`: a telemetry.StepResult;
    on CUDA its device figures may still be on their way). They must not sync the device; an integration (a
    Trainer callback) or a request from the dashboard answered at the next step hangs here.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None = None, scheduler=None, *, name: str = "", mode: str = "",
                 store: RunStore | str | os.PathLike | None = None, process_group=None, loss_fn: LossFn | None = None,
                 replay_without: tuple = (), **settings):
        self.config = MonitorConfig(name=name, mode=mode, **settings)
        self.loss_fn = loss_fn
        """The loop's loss as a function of (model, batch), for replays (or given to `step`)."""
        self.grad_clip = 0.0
        """The loop's gradient clipping (max norm; 0: none), which a replay applies too (the callbacks set it).
        `replay_without`: objects the replay's copy of the model must leave out (a Lightning module's trainer)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        named = [(n, p) for n, p in _inner(model).named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("model", "the model has no parameters that require gradients")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.device = self._params[0].device
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
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self.world_size > 1:
            self._sink: RecordSink | RankSink = RankSink(new_run_id(), opened, group=process_group,
                                                         flush_every_s=self.config.flush_every_s, check_skips=ddp)
        else:
            self._sink = RecordSink(new_run_id(), opened, self.config.flush_every_s)
        self.run_id = self._sink.run_id
        self._ddp = ddp
        self.mode = self.config.mode
        self.steps_done = 0
        self.closed = False
        self.step_hooks: list[Callable[[Monitor, StepResult], None]] = []
        """Run at the end of every `step()` (see the class docstring)."""
        self._meter = meter_for(self.device)
        self._replay = AttachedReplay(_inner(model), optimizer, self.scaler, self.config.replay, self.config.replay_max,
                                      without=replay_without, has_loss_fn=loss_fn is not None)
        self._watch = OptimizerWatch(optimizer, self.scaler)
        self._schedule = SamplingSchedule(grad_norm_every=self.config.grad_norm_every,
                                          gradstats_every=self.config.gradstats_every,
                                          memory_every=self.config.memory_every, probe_budget=self.config.probe_budget)
        self._probes = StepProbes(self._meter, _inner(model), self._names, self._params, optimizer, self._schedule,
                                  lost_updates=False)
        self._recorder = StepRecorder(self._sink)
        self._track: LaneTrack | None = None
        """The run's records (from the first step when the mode is seen from the loop)."""
        self._lr_next = float(optimizer.param_groups[0]["lr"])
        self._loop_s = 0.0
        """The loop's own host time between step() calls (what probe_budget compares the probes' with: the loop's,
        not the process's, which may be doing other things)."""
        self._autocast_seen: tuple[bool, torch.dtype | None] | None = None
        self._forward_hook = None
        if not self.mode:
            self._forward_hook = model.register_forward_pre_hook(self._see_autocast)
        else:
            self._open()
        atexit.register(_flush_at_exit, weakref.ref(self))
        # Layer diagnostics and the dashboard's requests ride on the recorder and the step hooks, like any extension.
        self._layers = LayerWatch(_inner(model), self.config.layers_every, self.config.probe_budget)
        self._layers.between_steps(-1, 0)
        self._desk = Desk(opened, self.run_id)  # a page's requests, rank 0 only
        self._trace_asked: list[int] = []
        self._trace = None
        self._push_at = time.monotonic() + self.config.flush_every_s / 2
        self._sentinel = NonfiniteSentinel(_inner(model), lambda: self.steps_done) if self.config.failing_step \
            else None
        self._recorder.on_record.append(self._layer_failure)
        if self._replay.on:  # the band of a failed step's replay: the losses as they are recorded
            self._recorder.on_record.append(lambda track, result: self._replay.recorded(result.step, result.loss))
        self.step_hooks += (self._answer_trace, self._between_steps)
        self._plain: list[tuple] = []
        """Plain steps kept for the next drain: (step, lr, t_wall_s, window, samples, host seconds)."""
        self._plain_until = 0
        """Steps before this one may be plain (`_plain_step`)."""
        self._plain_sink = not isinstance(self._sink, RankSink)
        """Under torchrun every step goes the full way: the ranks flush together by counting steps."""
        self._due = 0.0
        """A plain step meeting this time (`time.monotonic()`) takes the full path: a flush or a layer read is due."""
        self._start_window()

    # --- the user's loop -----------------------------------------------------------------------------------------
    def step(self, loss: torch.Tensor | float, samples: int | None = None, *, batch: Any = None,
             loss_fn: LossFn | None = None) -> None:
        """Record one optimizer step: call once per iteration after `scaler.update()` (and the scheduler's step),
        before the next `zero_grad()` (its gradient figures read the gradients). `samples`: the batch's size, for
        samples/s. `batch` (the step's batch, as the loss closure takes it) and `loss_fn(model, batch) -> loss` (or
        the Monitor's `loss_fn`): what a replay of this step needs when it fails (MonitorConfig.replay)."""
        if self.closed:
            raise RuntimeError("Monitor.step() after close()")
        window = self._window
        self._meter.close(window)
        began = time.perf_counter()
        self._loop_s += began - self._window_host
        step = self.steps_done
        if step < self._plain_until and self._plain_step(loss, samples, began, window, step):
            return
        # A watched step's layer hooks ran inside its window: their host time is probe time, not step time.
        hooked_s = self._layers.hooks_so_far_s()
        window.excluded_s = hooked_s
        meter, watch, schedule = self._meter, self._watch, self._schedule
        if self._track is None:
            self._open()
        self._drain()  # the plain steps before this one are recorded first: records and events stay in step order
        skipped = watch.skipped()
        result = StepResult(step=step, lr=watch.lr_used if watch.stepped else self._lr_next, t_wall_s=time.time(),
                            scaled=watch.scaled, skipped=skipped)
        self._lr_next = float(self.optimizer.param_groups[0]["lr"])
        norms = names = None
        if schedule.grad_norm(step) or skipped:
            norms, names = named_grad_norms(self._names, self._params)
        send_figures(meter, window, result, loss, self.scaler, watch.found_inf, norms, names)
        self._probes.close(result, self._opened, schedule.memory(step), schedule.grad_stats(step), self._loop_s)
        result.probe_ms = (time.perf_counter() - began + hooked_s) * 1e3
        self._recorder.add(self._track, result, samples)
        self.steps_done = step + 1
        for hook in self.step_hooks:
            hook(self, result)
        if self._replay.on:  # after the step was measured: its window is closed, the next one not yet open
            self._replay_if_failed(step, loss, skipped, batch, loss_fn or self.loss_fn, result)
        # The flush's own time is the store's (RecordSink.write_seconds): outside this step's window and the next.
        self._sink.flush_if_due()
        self._start_window()

    def _plain_step(self, loss: torch.Tensor | float, samples: int | None, began: float, window, step: int) -> bool:
        """Most steps sample nothing, fail nothing and meet no flush (`step < _plain_until`, decided when a full
        step opened the window): such a step sends its figures and keeps them; its record is made with the others
        at the next drain (a flush, or the next full step), in one batch. Right after the user's step the host's
        caches hold the model, not this code: each call made here costs microseconds, so this path makes few.
        False (nothing kept) when the step is not plain after all: the full path takes it."""
        watch = self._watch
        if (watch.scaled and not watch.stepped) or len(self.step_hooks) != 2 or time.monotonic() >= self._due:
            return False  # skipped by the scaler, a hook added since, or a flush (or a layer read) is due
        meter, scaler = self._meter, self.scaler
        meter.send(window, [loss, scale_tensor(scaler)] if watch.scaled else [loss])
        there = meter.on_host(window)
        if there is not None and not math.isfinite(there[1][0]):
            return False  # a loss that is not finite (known at once on a CPU) arms the layer watch now
        self._plain.append((step, watch.lr_used if watch.stepped else self._lr_next, time.time(), window, samples,
                            time.perf_counter() - began))
        self._lr_next = float(self.optimizer.param_groups[0]["lr"])
        self.steps_done = step = step + 1
        if step < self._plain_until:  # the next step's window as _start_window opens it, nothing sampled on it
            watch.stepped = False
            self._window_host = time.perf_counter()
            self._window = meter.open(scale_tensor(scaler))
        else:
            self._start_window()
        return True

    def _drain(self) -> None:
        """The plain steps kept so far become StepResults for the recorder, oldest first."""
        if not self._plain:
            return
        plain, self._plain = self._plain, []
        self._recorder.add_plain(self._track, plain, self._watch.scaled)

    @property
    def replay_on(self) -> bool:
        """Failed steps are replayed (MonitorConfig.replay): a caller keeps each step's batch for `step`."""
        return self._replay.on

    def flush(self) -> None:
        """Write what was recorded now (otherwise every `flush_every_s`); under torchrun every rank calls it."""
        self._drain()
        self._recorder.resolve()
        self._answer_layers_and_requests()
        self._sink.flush()
        # A request taken, or a failure recorded, here watches the coming steps: they take the full path again.
        self._plain_until = self._next_full_step(self.steps_done)
        self._due = self._due_at()

    def close(self, status: str = "finished", error: str = "") -> None:
        """The last records and the run's final status (finished, unless told otherwise); idempotent. Under
        torchrun every rank calls it."""
        if self.closed:
            return
        self.closed = True
        self._watch.remove()
        if self._forward_hook is not None:
            self._forward_hook.remove()
        self._layers.close()
        if self._sentinel is not None:
            self._sentinel.close()
        if self._trace is not None:
            self._trace.stop()
            self._trace = None
        self._drain()
        self._recorder.resolve(wait=True)
        self._answer_layers_and_requests()
        if self._track is None:
            self._open()
        kept = self._replay.kept
        if kept is not None and kept.copies:
            self.note(REPLAY_COST_EVENT, f"replay kept the state before each step: {kept.copies} host copies of "
                                         f"{kept.nbytes() / 2**20:.3g} MiB, {kept.copy_s / kept.copies * 1e3:.3g} ms "
                                         "each, outside the timed window", copies=kept.copies, kept_bytes=kept.nbytes(),
                      copy_ms=kept.copy_s / kept.copies * 1e3, replays=self._replay.replays)
        self._sink.event(status, f"run {status}" + (f": {error}" if error else ""))
        self._sink.close(status, [(LANE, status, error)])

    def note(self, kind: str, message: str, **data) -> None:
        """Record an event of the run (at the step the Monitor is at): what an integration saw of the trainer, e.g.
        a precision asked and not applied."""
        self._sink.event(kind, message, LANE, self.steps_done, **data)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:  # a crash: the run did not finish, and says why
            self.close("interrupted", f"the script raised {exc_type.__name__}: {exc}")

    # --- layer diagnostics and requests from the dashboard (step hooks and the recorder's on_record) -------------
    def _layer_failure(self, track: LaneTrack, result: StepResult) -> None:
        """A recorded step that failed (skipped, or a loss or gradient norm not finite): the layer watch names the
        first module that held inf/NaN (from this step's figures when it was watched, else the next step's)."""
        failure = ("skipped by the scaler" if result.skipped else "loss not finite" if not math.isfinite(result.loss)
                   else "gradient norm not finite" if result.grad_norm is not None
                   and not math.isfinite(result.grad_norm) else "")
        # A step the layer watch watched names its first inf/NaN with its ranges; any other, by the device flags.
        named = self._sentinel.failed(result.step, failure) if failure and self._sentinel is not None \
            and not self._layers.watches(result.step) else None
        if named is not None:
            if named[0]:
                self._sink.event(FIRST_NONFINITE_EVENT, named[0], LANE, result.step, **named[1])
        elif failure:
            self._layers.failed(result.step, failure)

    @staticmethod
    def _between_steps(monitor: Monitor, result: StepResult) -> None:
        """Step hook: the layer hooks come off the step that ended (on for the next when it is watched); every half
        flush interval, the watched steps' figures become events and the page's requests are answered and taken;
        an op trace a page asked for starts here, before the next step's window opens."""
        monitor._layers.between_steps(result.step, result.step + 1, monitor._loop_s)
        if time.monotonic() >= monitor._push_at:
            monitor._answer_layers_and_requests()
        if monitor._trace_asked and monitor._trace is None:
            monitor._start_trace()

    def _answer_layers_and_requests(self) -> None:
        """The watched steps' figures as events (one host transfer each: it waits for those steps on CUDA, which a
        flush may); answer what the layer watch read; take the page's new requests: a layer pass or an op trace of
        the next step."""
        self._push_at = time.monotonic() + self.config.flush_every_s / 2
        for kind, message, step, data in self._layers.read():
            self._sink.event(kind, message, LANE, step, **data)
        for request_id, answer in self._layers.answers:
            self._desk.answer(request_id, f"layer numerics of step {answer['step']}", answer)
        self._layers.answers = []
        for request_id, kind in self._desk.take():
            if kind == LAYERS:
                self._layers.requests.append(request_id)
            elif kind == TRACE:
                self._trace_asked.append(request_id)
            else:
                self._desk.answer(request_id, f"this process does not know the request {kind!r}", status="refused")

    def _start_trace(self) -> None:
        from amp_core.probes.steptrace import StepTrace  # the op tracer only when a page asks for it

        label = f"{self.config.name or self.run_id} · step {self.steps_done}"
        self._trace = StepTrace(_inner(self.model), label, self.mode or "?", str(self.device))
        self._trace.start()

    @staticmethod
    def _answer_trace(monitor: Monitor, result: StepResult) -> None:
        """Step hook: the op trace of the step that ended (started before its window: the step's time includes the
        tracer's), to the pages that asked."""
        if monitor._trace is None:
            return
        from amp_core.probes.steptrace import to_answer

        trace, monitor._trace = monitor._trace.stop(), None
        asked, monitor._trace_asked = monitor._trace_asked, []
        step = result.step
        monitor._sink.event("traced", f"step {step} was traced on request: its step time includes the tracer's",
                            LANE, step)
        for request_id in asked:
            monitor._desk.answer(request_id, f"every op of step {step} ({len(trace.records)} ops)", to_answer(trace))

    # --- replays of failed steps (amp_core.diagnostics.attached_replay) -----------------------------------------------
    def _replay_if_failed(self, step: int, loss, skipped: bool | None, batch: Any, loss_fn: LossFn | None,
                          result: StepResult) -> None:
        """A failed step (skipped, a non-finite loss, a loss above the band) is replayed from the state kept before
        it, here, on the loop's thread between two windows; its report becomes a `replayed` event."""
        replay = self._replay
        if not replay.every_step and not skipped:
            # replay="auto": only a skipped step (known on the host) can be replayed without a copy before each step.
            if result.filled and not math.isfinite(result.loss) and not replay.missing_said:
                replay.missing_said = True
                self._sink.event(REPLAY_OFF_EVENT, f"step {step}'s loss is {result.loss} after the optimizer "
                                                   "stepped: replaying it needs the state from before the step, "
                                                   "which replay='auto' does not keep (replay=True: a copy before "
                                                   "each step)", LANE, step)
            return
        # The loss on the host: free on a CPU; on CUDA a host sync, made only with replay=True (its one cost beyond
        # the copy: a failure must be seen before the kept state is overwritten by the next step's) or on a skip.
        value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
        failure = replay.failure(step, value, bool(skipped))
        if not failure or not replay.due(step):
            return
        if batch is None or loss_fn is None:
            if not replay.missing_said:
                replay.missing_said = True
                self._sink.event(REPLAY_OFF_EVENT, f"step {step} failed ({failure}) and was not replayed: pass the "
                                                   "step's batch and a loss closure (monitor.step(loss, batch=..., "
                                                   "loss_fn=...))", LANE, step)
            return
        try:
            if not replay.every_step:
                # The band is the recorded losses before this step: on CUDA the records still on their way are
                # waited for (a sync, on this skipped step only). The skip left the state as it was before the step.
                self._drain()
                self._recorder.resolve(wait=True)
                replay.keep_skipped()
            report = replay.replay(run_id=self.run_id, mode=self.mode, step=step, loss=value, batch=batch,
                                         loss_fn=loss_fn, device=str(self.device), grad_clip=self.grad_clip)
        except Exception as exc:  # a diagnostic never stops the user's training: the event says what went wrong
            self._sink.event(REPLAY_OFF_EVENT, f"step {step} failed ({failure}) and its replay failed: "
                                               f"{type(exc).__name__}: {exc}", LANE, step)
            return
        self._sink.event(REPLAYED_EVENT, f"step {step} failed ({failure}), replayed in every mode: "
                                         f"{report.verdict.line()}", LANE, step, report=report_data(report))

    # --- what the model tells ------------------------------------------------------------------------------------
    def _see_autocast(self, module, args) -> None:
        device_type = self.device.type
        enabled = torch.is_autocast_enabled(device_type)
        self._autocast_seen = (enabled, torch.get_autocast_dtype(device_type) if enabled else None)
        self._forward_hook.remove()  # once is enough: a loop keeps its precision
        self._forward_hook = None

    # --- measuring ---------------------------------------------------------------------------------------------
    def _start_window(self) -> None:
        """Open the next step's windows: the sampled probes' (the allocator's, on its memory steps), then the timed
        one, which takes the scale the step begins with; and up to which step the steps may be plain ones."""
        step = self.steps_done
        self._replay.keep()  # the state before the next step (replay=True): before its window opens
        self._watch.begin()
        self._opened = self._probes.open(step, memory=False, grad_stats=False)
        self._plain_until = self._next_full_step(step)
        if not self._plain:
            self._due = self._due_at()
        self._window_host = time.perf_counter()
        self._window = self._meter.open(scale_tensor(self.scaler))

    def _due_at(self) -> float:
        """When a plain step must give way to the full path: the layer watch's read or the store's flush is due."""
        return min(self._push_at, self._sink.flush_due_at) if self._plain_sink else 0.0

    def _next_full_step(self, step: int) -> int:
        """The first step from `step` on that takes the full path whatever happens: one that samples a figure, or
        is watched by the layer watch, or arms it for the next. `step` itself when anything else watches the steps
        (a trace, a layer request or failure, a hook that is not the Monitor's own, a fused optimizer, ranks, a copy
        of the state before each step for replays)."""
        layers = self._layers
        if (self._track is None or not self._plain_sink or len(self.step_hooks) != 2 or self._watch.fused
                or self._replay.every_step
                or self._opened is not NOTHING_OPENED or not layers.idle(step, self._loop_s) or self._trace_asked
                or self._trace is not None):
            return step
        if step <= 1:
            return step  # memory on steps 0 and 1
        schedule = self._schedule
        everies = [schedule.grad_norm_every, schedule.memory_every, schedule.gradstats_every]
        full = min(-(-step // every) * every for every in everies if every)
        if layers.every:
            watched = -(-(step + 1) // layers.every) * layers.every
            full = min(full, watched - 1)  # the step before a watched one arms it
        return full

    # --- the run in the store ---------------------------------------------------------------------------------
    def _open(self) -> None:
        """Register the run (on the first step when the mode is seen from the loop)."""
        if not self.mode:
            enabled, dtype = self._autocast_seen or (False, None)
            self.mode = mode_from_dtypes(dtype if enabled else None, self._params[0].dtype, self.device.type)
        self._sink.open(self._saved_config(), str(self.device), torch.__version__,
                        [{"source": SOURCE, "ranks": self.world_size}])
        self._track = self._recorder.track(LANE, self.mode, self._meter)
        replay = self._replay
        data = replay.describe()
        kept = replay.kept
        if kept is not None:
            data |= {"copy_ms": kept.copy_s / max(kept.copies, 1) * 1e3, "kept_bytes": kept.nbytes()}
        self.note(REPLAY_ON_EVENT if replay.on else REPLAY_OFF_EVENT, replay.why, **data)

    @property
    def _opened_run(self) -> bool:
        return self._track is not None

    def _saved_config(self) -> dict[str, Any]:
        config, optimizer, scaler = self.config, self.optimizer, self.scaler
        total = config.total_steps or int(getattr(self.scheduler, "total_steps", 0) or 0)
        workload = config.workload or type(_inner(self.model)).__name__
        saved = {"source": SOURCE, "name": config.name, "workload": workload,
                 "modes": [self.mode], "steps": total, "optimizer": type(optimizer).__name__.lower(),
                 "lr": float(optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"])),
                 "scheduler": _scheduler_name(self.scheduler), "fused_optimizer": self._watch.fused,
                 "grad_norm_every": config.grad_norm_every, "gradstats_every": config.gradstats_every,
                 "memory_every": config.memory_every, "probe_budget": config.probe_budget,
                 "world_size": self.world_size, "ddp": self._ddp, "integration": config.integration,
                 "layers_every": config.layers_every, "replay": self._replay.describe(),
                 "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "", "host": socket.gethostname(),
                 "pid": os.getpid(), "faults": []}
        if scaler is not None:
            saved["scaler"] = scaler_settings(scaler)
        return saved


def _flush_at_exit(ref: weakref.ref) -> None:
    """A script ending without closing its Monitor: its records are written (rank 0's own under torchrun: the other
    ranks may be gone), its status left running, so the store sees the process gone and marks it interrupted."""
    monitor = ref()
    if monitor is None or monitor.closed or not monitor._opened_run:
        return
    try:
        monitor._drain()
        monitor._recorder.resolve(wait=True)
        if isinstance(monitor._sink, RankSink):
            monitor._sink.flush_own()
        else:
            monitor._sink.flush()
    except Exception as exc:  # at exit, a message rather than a second traceback
        print(f"AMP Lab Monitor: the last records of run {monitor.run_id} could not be written: {exc}",
              file=sys.stderr)
