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
  optimizer (`Optimizer.register_step_post_hook`) that did not fire says the step was skipped; a fused optimizer (which
  skips on the device) is handed `optimizer.found_inf` by GradScaler, read with the other figures. The scale backing
  off must agree: an event says so if it does not (step.record_step_events).
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
import uuid
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from amp_core.config import ConfigError
from amp_core.measure import CudaMeter, HostMeter, InFlight, held_bytes, meter_for
from amp_core.precision import MODES, mode_from_dtypes
from amp_core.probes import gradstats
from amp_core.probes.layerwatch import LayerWatch
from amp_core.records.ranks import RankSink
from amp_core.records.requests import LAYERS, TRACE, Desk
from amp_core.records.schema import STEP_COLUMNS, typed
from amp_core.records.sink import RecordSink
from amp_core.records.store import RunStore, open_store
from amp_core.step import StepResult, grad_norms, record_step_events, resolve_step

LANE = 0
"""A Monitor's run has one lane (its mode); under torchrun, one track per rank."""
MAX_IN_FLIGHT = 256
"""CUDA: at this many steps whose figures are still on their way, the oldest is waited for (the host is then that far
ahead of the device, so the wait costs the device nothing)."""
MONITOR_FLUSH_EVERY_S = 1.0
"""A Monitor's flush cadence: the dashboard redraws every second, and a flush (a few ms on the loop's own thread) twice
as often would cost a loop of a few ms per step half a percent."""
SOURCE = "monitor"
ROW_FIELDS = ("step", "t_wall_s", "loss", "step_ms", "samples_per_s", "lr", "scale", "skipped", "grad_norm",
              "params_bytes", "grads_bytes", "optim_bytes", "activations_bytes", "peak_above_start_bytes",
              "lane_peak_bytes", "probe_ms")
"""The StepRecord columns a Monitor's row holds, in this order."""
PUSH_ROWS = 256
"""Rows go to the sink at this many, or at half the flush interval, whichever comes first."""
if set(ROW_FIELDS) - set(STEP_COLUMNS):
    raise ImportError(f"Monitor rows name columns StepRecord does not have: {set(ROW_FIELDS) - set(STEP_COLUMNS)}")
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
    probe_budget: float = 0.005
    """Gradient statistics (every element of every gradient cast to fp16 and bf16: ~20 ms for 350k parameters on a
    CPU core) are taken on their sampled and skipped steps only while they have taken at most this share of the
    loop's own time so far, so that watching a large model does not slow it; 0 lifts the limit."""
    flush_every_s: float = MONITOR_FLUSH_EVERY_S
    """The store gets the records at least this often (a kill -9 loses less than this); each flush is a SQLite
    transaction on the loop's thread (a few ms)."""
    layers_every: int = 200
    """Every N steps (and after a failed step, and on request) each module's output and output-gradient ranges are
    measured by hooks during the step (amp_core.probes.layerwatch): the race's layer amax heatmap, with the shares a
    cast to fp16 / bf16 / fp8 overflows, makes subnormal or flushes to zero; 0 samples only after failed steps and on
    request. The hooks' host time is the step's probe time, not its step time."""
    integration: str = ""
    """What drives the Monitor: empty for the user's own loop, else the trainer whose callback made it ("Hugging Face
    Trainer", "Lightning"): the Train page says where the run comes from."""

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
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None = None, scheduler=None, *, name: str = "", mode: str = "",
                 store: RunStore | str | os.PathLike | None = None, process_group=None, **settings):
        self.config = MonitorConfig(name=name, mode=mode, **settings)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        named = [(n, p) for n, p in _inner(model).named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("model", "the model has no parameters that require gradients")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.device = self._params[0].device
        self._meter: HostMeter | CudaMeter = meter_for(str(self.device))
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and self.scaler is not None
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        if self.world_size > 1 and dist.get_backend(process_group) == "nccl" and (
                self.device.type != "cuda" or self.device.index != torch.cuda.current_device()):
            raise ConfigError("process_group", f"NCCL gathers through the current CUDA device (cuda:"
                                               f"{torch.cuda.current_device()}) but the model is on {self.device}: "
                                               "call torch.cuda.set_device(local_rank) before creating the Monitor")
        # 48 random bits: run ids written from many hosts into one store never meet
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:12]
        opened = None
        if self.rank == 0:
            opened = store if isinstance(store, RunStore) else open_store(store)
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self.world_size > 1:
            self._sink: RecordSink | RankSink = RankSink(run_id, opened, group=process_group,
                                                         flush_every_s=self.config.flush_every_s, check_skips=ddp)
        else:
            self._sink = RecordSink(run_id, opened, self.config.flush_every_s)
        self.run_id = self._sink.run_id
        self._ddp = ddp
        self.mode = self.config.mode
        self.steps_done = 0
        self.closed = False
        self._opened = False
        self._in_flight: deque[tuple[StepResult, float | None]] = deque()
        self._rows: list[tuple] = []
        """Records not yet handed to the sink, each a tuple in ROW_FIELDS order."""
        self._push_at = time.monotonic() + self.config.flush_every_s / 2
        self._stepped = False
        self._lr_used = math.nan
        self._lr_next = float(optimizer.param_groups[0]["lr"])
        self._found_inf: torch.Tensor | None = None
        self._no_flag = torch.zeros((), device=self.device)
        """CUDA, non-fused: the found-inf slot resolve_step reads (the skip is known on the host)."""
        self._held = (0, 0, 0)
        self._peak_above_start: int | None = None
        self._lane_peak: int | None = None
        self._memory: tuple[int, int] | None = None
        """CUDA: (allocation at the window's start, bytes held then) of an open memory window."""
        self._hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                       optimizer.register_step_post_hook(self._after_optimizer_step)]
        self._autocast_seen: tuple[bool, torch.dtype | None] | None = None
        self._scale_before: float | None = None
        self._stats_s = self._loop_s = 0.0
        """Host time gradient statistics have taken so far, and the loop's own host time between step() calls (what
        probe_budget compares them with: the loop's, not the process's, which may be doing other things)."""
        self._window_host = time.perf_counter()
        if not self.mode:
            self._forward_hook = model.register_forward_pre_hook(self._see_autocast)
            self._hooks.append(self._forward_hook)
        else:
            self._open()
        atexit.register(_flush_at_exit, weakref.ref(self))
        self._layers = LayerWatch(_inner(model), self.config.layers_every)  # layer diagnostics touch point (1/5)
        self._layers.between_steps(-1, 0)
        self._desk = Desk(opened, self.run_id)  # requests touch point (1/3): a page's requests, rank 0 only
        self._trace_asked: list[int] = []
        self._trace = None
        self._window = self._start_window()

    # --- the user's loop -----------------------------------------------------------------------------------------
    def step(self, loss: torch.Tensor | float, samples: int | None = None) -> None:
        """Record one optimizer step: call once per iteration after `scaler.update()` (and the scheduler's step),
        before the next `zero_grad()` (its gradient figures read the gradients). `samples`: the batch's size, for
        samples/s."""
        if self.closed:
            raise RuntimeError("Monitor.step() after close()")
        meter, window = self._meter, self._window
        hooked_ms = self._layers.hooks_so_far_s() * 1e3  # layer diagnostics touch point (2/5)
        if self._trace is not None:
            self._answer_trace()  # requests touch point (2/3)
        if meter.immediate:
            step_ms = meter.elapsed_ms(window) - hooked_ms  # a watched step's hooks are probe time (host time only)
        else:
            meter.stop(window)
        began = time.perf_counter()
        self._loop_s += began - self._window_host
        if not self._opened:
            self._open()
        step, scaler = self.steps_done, self.scaler
        stepped, self._stepped = self._stepped, False
        found_inf, self._found_inf = self._found_inf, None
        result = StepResult(step=step, lr=self._lr_used if stepped else self._lr_next, t_wall_s=time.time(),
                            scaled=scaler is not None)
        self._lr_next = float(self.optimizer.param_groups[0]["lr"])
        if self._memory is not None:  # the allocator's peak over this step (its window opened before the step)
            start, held_at_start = self._memory
            self._memory = None
            result.peak_above_start_bytes = meter.close_memory_window(start)
            result.lane_peak_bytes = held_at_start + result.peak_above_start_bytes
        if scaler is None:
            result.skipped = False
        elif not self._fused:
            result.skipped = not stepped  # GradScaler stepped the optimizer only if the gradients were finite
        elif meter.immediate:
            result.skipped = bool(found_inf is not None and found_inf.item() > 0)  # a CPU tensor: no wait
        # else a fused optimizer decided on the device: read with the other figures (resolve_step)
        skipped = bool(result.skipped)
        total = norms = None
        if step % self.config.grad_norm_every == 0 or skipped:
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                norms, total = grad_norms(grads)
        if meter.immediate:
            result.step_ms = step_ms
            result.loss = loss.item() if isinstance(loss, torch.Tensor) else float(loss)  # a CPU tensor: no wait
            if scaler is not None:
                result.scale, result.scale_after = self._scale_before, scaler.get_scale()
            if total is not None:
                result.grad_norm = total.item()
        else:
            self._send(window, result, loss, found_inf, total, norms)
        self._probe(result, skipped)
        result.probe_ms = (time.perf_counter() - began) * 1e3 + hooked_ms
        if meter.immediate:
            self._record(result, samples)
        else:
            self._in_flight.append((result, samples))
            self._resolve()
        self.steps_done = step + 1
        self._layers.between_steps(step, step + 1)  # layer diagnostics touch point (3/5)
        # The flush's own time is the store's (RecordSink.write_seconds): outside this step's window and the next.
        if len(self._rows) >= PUSH_ROWS or time.monotonic() >= self._push_at:
            self._push_rows()
        self._sink.flush_if_due()
        self._window = self._start_window()

    def flush(self) -> None:
        """Write what was recorded now (otherwise every `flush_every_s`); under torchrun every rank calls it."""
        self._resolve()
        self._push_rows()
        self._sink.flush()

    def close(self, status: str = "finished", error: str = "") -> None:
        """The last records and the run's final status (finished, unless told otherwise); idempotent. Under
        torchrun every rank calls it."""
        if self.closed:
            return
        self.closed = True
        for hook in self._hooks:
            hook.remove()
        self._layers.close()
        if self._trace is not None:
            self._trace.stop()
            self._trace = None
        self._resolve(wait=True)
        if not self._opened:
            self._open()
        self._push_rows()
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

    # --- requests from the dashboard (amp_core.records.requests) ---------------------------------------------------
    def _take_requests(self) -> None:
        """Answer what the layer watch read; take the page's new requests: a layer pass or an op trace of the next
        step."""
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

    def _answer_trace(self) -> None:
        from amp_core.probes.steptrace import to_answer

        trace, self._trace = self._trace.stop(), None
        asked, self._trace_asked = self._trace_asked, []
        step = self.steps_done
        self._sink.event("traced", f"step {step} was traced on request: its step time includes the tracer's", LANE,
                         step)
        for request_id in asked:
            self._desk.answer(request_id, f"every op of step {step} ({len(trace.records)} ops)", to_answer(trace))

    # --- hooks: what the optimizer and the model tell -----------------------------------------------------------
    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._lr_used = float(optimizer.param_groups[0]["lr"])
        # GradScaler hands a fused optimizer its found-inf flag (a device tensor) as this attribute.
        self._found_inf = getattr(optimizer, "found_inf", None)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True

    def _see_autocast(self, module, args) -> None:
        device_type = self.device.type
        enabled = torch.is_autocast_enabled(device_type)
        self._autocast_seen = (enabled, torch.get_autocast_dtype(device_type) if enabled else None)
        self._forward_hook.remove()  # once is enough: a loop keeps its precision
        self._hooks.remove(self._forward_hook)

    # --- measuring ---------------------------------------------------------------------------------------------
    def _start_window(self) -> float | InFlight:
        """Open the next step's timed window (and, on CUDA steps that measure memory, its allocator window)."""
        if self._trace_asked and self._trace is None:
            self._start_trace()  # a page asked for an op trace of this step
        meter, scaler = self._meter, self.scaler
        if meter.immediate:
            if scaler is not None:
                self._scale_before = scaler.get_scale()  # a CPU tensor: nothing to wait for
            self._window_host = meter.start()
            return self._window_host
        scale = scaler._get_scale_async() if scaler is not None else None
        # Before the scaler's first step its scale lives on the host: get_scale() answers from there, with no sync.
        self._scale_before = scaler.get_scale() if scaler is not None and scale is None else None
        upcoming = self.steps_done
        if upcoming == 1 or (upcoming > 1 and upcoming % self.config.memory_every == 0):
            held = sum(held_bytes(self._params, self.optimizer))  # tensor metadata: no sync
            self._memory = (meter.open_memory_window(), held)
        self._window_host = time.perf_counter()
        return meter.start(scale)

    def _send(self, flight: InFlight, result: StepResult, loss, found_inf, total, norms) -> None:
        """CUDA: the step's device figures to pinned host memory behind it (no sync); read by `_resolve`."""
        # A float loss is filled in on the device: a copy from pageable host memory would wait for the step.
        values = [loss.detach().to(self.device) if isinstance(loss, torch.Tensor)
                  else torch.full((), float(loss), device=self.device)]
        if self.scaler is not None:
            result.scale = self._scale_before  # None: it comes from the window's pinned copy
            values += (found_inf if self._fused and found_inf is not None else self._no_flag,
                       self.scaler._get_scale_async())
        if total is not None:
            values += (total, norms)
            result.norm_names = [n for n, p in zip(self._names, self._params, strict=True) if p.grad is not None]
        self._meter.send(flight, values)
        result.in_flight = flight

    def _probe(self, result: StepResult, skipped: bool) -> None:
        """Sampled figures after the step (they may sync on CUDA): bytes held, the parameters that overflowed on a
        skipped step, gradient statistics."""
        step = result.step
        if step <= 1 or step % self.config.memory_every == 0:
            result.held = held_bytes(self._params, self.optimizer)
        nonfinite = result.grad_norm is not None and not math.isfinite(result.grad_norm)
        if skipped or nonfinite:
            result.bad_params = gradstats.nonfinite_params(_inner(self.model))
        every, budget = self.config.gradstats_every, self.config.probe_budget
        sampled = (every and step % every == 0) or skipped
        if sampled and (not budget or self._stats_s <= budget * self._loop_s):
            started = time.perf_counter()
            if result.scaled and result.scale is None:
                self._meter.wait(result.in_flight)  # a sampled step: the scale it began with, read now (a sync)
                result.scale = float(result.in_flight.scale_before[0])
            result.grad_stats = gradstats.model_grad_stats(_inner(self.model), result.scale or 1.0)
            self._stats_s += time.perf_counter() - started

    def _resolve(self, wait: bool = False) -> None:
        """CUDA: steps whose figures reached the host become records, oldest first (`wait`: all of them, a sync)."""
        while self._in_flight:
            result, samples = self._in_flight[0]
            ready = self._meter.ready(result.in_flight)
            if not (ready or wait or len(self._in_flight) >= MAX_IN_FLIGHT):
                break
            self._in_flight.popleft()
            resolve_step(self._meter, result, wait=not ready)
            self._record(result, samples)

    def _record(self, result: StepResult, samples: int | None) -> None:
        """One resolved step -> a row of its record (memory figures carried between measurements), and its events
        when it has any. Rows reach the sink as columns now and then (`_push_rows`): building a StepRecord a step
        costs a loop with a cold cache ~20 us, a tuple ~1 us."""
        if result.held is not None:
            self._held = result.held
        if result.peak_above_start_bytes is not None:
            self._peak_above_start, self._lane_peak = result.peak_above_start_bytes, result.lane_peak_bytes
        params_bytes, grads_bytes, optim_bytes = self._held
        on_cuda = not self._meter.immediate
        self._rows.append((
            result.step, result.t_wall_s, result.loss, result.step_ms,
            samples / (result.step_ms / 1e3) if samples and result.step_ms > 0 else math.nan, result.lr,
            math.nan if result.scale is None else result.scale, bool(result.skipped),
            math.nan if result.grad_norm is None else result.grad_norm, params_bytes, grads_bytes, optim_bytes,
            0, self._peak_above_start if on_cuda else None,
            self._lane_peak if on_cuda else params_bytes + grads_bytes + optim_bytes, result.probe_ms))
        if (result.skipped or result.grad_stats or result.bad_params or result.scale_after != result.scale
                or not math.isfinite(result.loss)):  # what record_step_events writes events for
            record_step_events(self._sink, LANE, result)
        failure = ("skipped by the scaler" if result.skipped else "loss not finite" if not math.isfinite(result.loss)
                   else "gradient norm not finite" if result.grad_norm is not None
                   and not math.isfinite(result.grad_norm) else "")
        if failure:  # layer diagnostics touch point (4/5): name the first module that held inf/NaN
            self._layers.failed(result.step, failure)

    def _push_rows(self) -> None:
        """The rows gathered so far to the sink, as columns (a figure the Monitor does not measure is NaN)."""
        for kind, message, step, data in self._layers.read():  # layer diagnostics touch point (5/5)
            self._sink.event(kind, message, LANE, step, **data)
        self._take_requests()  # requests touch point (3/3)
        rows, self._rows = self._rows, []
        self._push_at = time.monotonic() + self.config.flush_every_s / 2
        if not rows:
            return
        matrix = np.array(rows, dtype=np.float64)  # None -> NaN
        columns = {name: typed(matrix[:, ROW_FIELDS.index(name)] if name in ROW_FIELDS else
                               np.full(len(rows), np.nan), dtype) for name, dtype in STEP_COLUMNS.items()}
        self._sink.extend_steps(LANE, self.mode, columns)

    # --- the run in the store ---------------------------------------------------------------------------------
    def _open(self) -> None:
        """Register the run (on the first step when the mode is seen from the loop)."""
        if not self.mode:
            enabled, dtype = self._autocast_seen or (False, None)
            self.mode = mode_from_dtypes(dtype if enabled else None, self._params[0].dtype, self.device.type)
        self._opened = True
        self._sink.open(self._saved_config(), str(self.device), torch.__version__,
                        [{"source": SOURCE, "ranks": self.world_size}])

    def _saved_config(self) -> dict[str, Any]:
        config, optimizer, scaler = self.config, self.optimizer, self.scaler
        total = config.total_steps or int(getattr(self.scheduler, "total_steps", 0) or 0)
        workload = config.workload or type(_inner(self.model)).__name__
        saved = {"source": SOURCE, "name": config.name, "workload": workload,
                 "modes": [self.mode], "steps": total, "optimizer": type(optimizer).__name__.lower(),
                 "lr": float(optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"])),
                 "scheduler": _scheduler_name(self.scheduler), "fused_optimizer": self._fused,
                 "grad_norm_every": config.grad_norm_every, "gradstats_every": config.gradstats_every,
                 "memory_every": config.memory_every, "probe_budget": config.probe_budget,
                 "world_size": self.world_size, "ddp": self._ddp, "integration": config.integration,
                 "layers_every": config.layers_every,
                 "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "", "host": socket.gethostname(),
                 "pid": os.getpid(), "faults": []}
        if scaler is not None:
            saved["scaler"] = {"init_scale": scaler._init_scale, "growth_factor": scaler._growth_factor,
                               "backoff_factor": scaler._backoff_factor, "growth_interval": scaler._growth_interval}
        return saved


def _flush_at_exit(ref: weakref.ref) -> None:
    """A script ending without closing its Monitor: its records are written (rank 0's own under torchrun: the other
    ranks may be gone), its status left running, so the store sees the process gone and marks it interrupted."""
    monitor = ref()
    if monitor is None or monitor.closed or not monitor._opened:
        return
    try:
        monitor._resolve(wait=True)
        monitor._push_rows()
        if isinstance(monitor._sink, RankSink):
            monitor._sink.flush_own()
        else:
            monitor._sink.flush()
    except Exception as exc:  # at exit, a message rather than a second traceback
        print(f"AMP Lab Monitor: the last records of run {monitor.run_id} could not be written: {exc}",
              file=sys.stderr)
