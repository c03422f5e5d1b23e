"""Run: one thread steps K precision lanes interleaved (A B C A B C ...), per mode one lane per seed replicate;
RunManager: the process's runs."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass

import pandas as pd
import torch

from amp_core import background
from amp_core.config import ConfigError, RunConfig, check_launch
from amp_core.measure import tensor_bytes
from amp_core.precision import Precision, get_precision, resolve_device
from amp_core.probes.faults import FaultPlan, init_scale_override, param_by_name
from amp_core.probes.gradstats import GradStats
from amp_core.probes.numerics import LAYER_AMAX_EVENT, LayerAmaxSampler
from amp_core.probes.replay import SnapshotRing
from amp_core.records import Event, StepRecord, empty_steps_frame
from amp_core.records.query import MAX_POINTS, LaneSeries, read_lane
from amp_core.records.sink import RecordSink
from amp_core.records.store import RunStore, StoredTrack
from amp_core.step import LaneState, StepResult, record_step_events, resolve_step, train_step
from amp_core.switches import pin_intra_op_threads, process_intra_op_threads
from amp_core.workloads import WORKLOADS, Data, Workload

RESOLVE_EVERY_S = 0.25
"""On CUDA, lane steps whose figures have reached the host become records at least this often."""
RESOLVE_BATCH = 32
"""... and whenever this many lane steps are waiting (a query per step waiting, never a wait)."""
TEAM_MARGIN = 0.5
"""choose_threads keeps a team of intra-op threads only when one thread is this much slower (relative) on a step: a
team gains at most that when the cores are free and loses several times over when one is taken (bench/viewers.py:
a CLI run that chose 2 threads kept 0.36-0.67 of its speed with two browser sessions watching, 0.82-0.86 with 1)."""
MEASURE_ROUNDS = 3
"""choose_threads times one thread and the team alternately this many times and keeps the best of each."""
MAX_IN_FLIGHT = 256
"""At this many lane steps ahead of the device the loop waits for the oldest (see Run._resolve)."""


@dataclass(slots=True)
class LaneSnapshot:
    """A copy of a lane taken between two steps (for the op inspector): changing it changes nothing live."""

    mode: str
    step: int
    model: torch.nn.Module
    precision: Precision
    workload: Workload
    batch: tuple[torch.Tensor, torch.Tensor]
    scale: float | None = None
    """The lane's GradScaler scale at the snapshot (None: the mode has no scaler)."""


@dataclass(slots=True)
class HeldBytes:
    """What a lane holds between steps (measured, not modelled): parameters, gradients, optimizer state."""

    params_bytes: int = 0
    grads_bytes: int = 0
    optim_bytes: int = 0


class Lane:
    """One precision mode (and seed replicate) inside a run: its training state and its status."""

    def __init__(self, index: int, mode: str, seed: int = 0, replicate: int = 0):
        self.index = index
        self.mode = mode
        self.seed = seed
        """The seed of the lane's initial weights and batches (RunConfig.seed + replicate)."""
        self.replicate = replicate
        """Which seed replicate of its mode the lane is (0 .. RunConfig.seeds - 1)."""
        self.status = "pending"
        """pending | running | finished | stopped | diverged | failed."""
        self.error = ""
        self.steps_done = 0
        self.state: LaneState | None = None
        self.held = HeldBytes()
        self.activations_bytes = 0
        """Bytes saved for backward at the last measured step (carried between measurements)."""
        self.peak_above_start_bytes: int | None = None
        """CUDA: the allocator peak above its step's start at the last measured step (carried between)."""
        self.peak_bytes: int | None = None
        """CUDA: the lane's own peak at the last measured step (carried between)."""

    def lane_peak_bytes(self, on_cuda: bool) -> int | None:
        """The lane's own peak (see StepRecord.lane_peak_bytes), from the last measurements."""
        if on_cuda:
            return self.peak_bytes
        return self.held.params_bytes + self.held.grads_bytes + self.held.optim_bytes + self.activations_bytes


def build_optimizer(config: RunConfig, model: torch.nn.Module, precision: Precision):
    """The lane's optimizer: the recipe decides (torch's, or torchao's low-bit / stochastic-rounding Adam(W))."""
    return precision.build_optimizer(model.parameters(), config.optimizer, lr=config.lr, eps=config.eps,
                                     fused=config.fused_optimizer)


def divergence_hint(config: RunConfig, precision: Precision) -> str:
    """Why a lane may have diverged, when the config makes it likely (shown with the divergence event)."""
    dtype = precision.param_dtype
    if config.optimizer != "sgd" and torch.tensor(config.eps, dtype=dtype).item() == 0:
        return (f" — Adam's eps={config.eps:g} is 0 in {str(dtype).removeprefix('torch.')}, and its second moment "
                "underflows there too: try eps=1e-4 or SGD for this mode")
    return ""


def build_lane_state(config: RunConfig, index: int, mode: str, base_model: torch.nn.Module, workload: Workload,
                     device: str) -> LaneState:
    """A lane's model (a copy of the shared initial model), optimizer, scheduler and scaler."""
    precision = get_precision(mode, device)
    model = precision.prepare_module(copy.deepcopy(base_model))
    optimizer = build_optimizer(config, model, precision)
    s = config.scaler
    scaler = precision.make_scaler(init_scale_override(config.faults, mode) or s.init_scale, s.growth_factor,
                                   s.backoff_factor, s.growth_interval)
    state = LaneState(index=index, precision=precision, workload=workload, model=model, optimizer=optimizer,
                      scaler=scaler, grad_clip=config.grad_clip, faults=FaultPlan.for_lane(config.faults, mode),
                      grad_norm_every=config.grad_norm_every)
    if config.scheduler == "onecycle":
        state.scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=config.steps,
                                                              cycle_momentum=config.optimizer == "sgd")
    return state


def choose_threads(state: LaneState, batch: tuple[torch.Tensor, torch.Tensor], requested: int = 0) -> str:
    """Set the calling thread's own intra-op threads (no other thread's): `requested`, else measured: the process's
    setting when this model's step is long or one thread is clearly slower (TEAM_MARGIN), else 1. Says what it chose.

    On a machine with few cores, an OpenMP team started from a second thread (a run's, a probe's) wakes its
    workers through the kernel for every parallel op (libgomp throttles spinning once it manages more threads
    than there are cores), about 25 us each: for a small model that is most of a step. Big ops amortise it, so
    only quick steps are measured, on a copy of the lane's model, with a batch the caller does not train on.
    A team wins little on a quick step and loses much when a core is taken: while a browser, a dashboard or another
    run uses one of two cores, every parallel op waits for the team's descheduled thread (a CLI run followed by two
    browser sessions ran 10-100x slower with 2 threads, chosen for 0.24 ms against 0.25 ms with 1).
    """
    if requested:
        pin_intra_op_threads(requested)
        return f"{requested} intra-op thread(s), as configured"
    default = pin_intra_op_threads(process_intra_op_threads())
    if default <= 1 or state.precision.device_type != "cpu":
        return f"{default} intra-op thread(s)"
    model = copy.deepcopy(state.model)
    inputs, targets = (state.precision.prepare_input(t) for t in batch)

    def forward_backward_s() -> float:
        best = math.inf
        for _ in range(4):
            start = time.perf_counter()
            with state.precision.forward_context():
                loss = state.workload.loss(model(inputs), targets)
            loss.backward()
            best = min(best, time.perf_counter() - start)
        return best

    # One thread first: its time does not depend on what else the machine runs (a team's does).
    pin_intra_op_threads(1)
    single = forward_backward_s()
    if single > 0.05:
        pin_intra_op_threads(default)
        return f"{default} intra-op threads"
    # Then both in turn, best of each: a moment of load (a page drawing as the run starts) must not decide it.
    multi = math.inf
    for _ in range(MEASURE_ROUNDS):
        pin_intra_op_threads(default)
        multi = min(multi, forward_backward_s())
        pin_intra_op_threads(1)
        single = min(single, forward_backward_s())
    if single > multi * (1 + TEAM_MARGIN):
        pin_intra_op_threads(default)
        return f"{default} intra-op threads (measured {multi * 1e3:.2f} ms vs {single * 1e3:.2f} ms with 1)"
    pin_intra_op_threads(1)
    return f"1 intra-op thread (measured {single * 1e3:.2f} ms vs {multi * 1e3:.2f} ms with {default})"


class Run:
    """A launch: one workload, one lane per mode and seed replicate, driven by one background thread.

    Run owns control (start, pause, resume, stop) and the loop; what the loop produces goes through its RecordSink.
    """

    def __init__(self, config: RunConfig, store: RunStore | None = None, run_id: str | None = None):
        self.config = config
        # 48 random bits: run ids written from many hosts into one store never meet
        self.run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:12]
        self.sink = RecordSink(self.run_id, store)
        self.device = resolve_device(config.device)
        self.lanes = [Lane(i, mode, seed, seed - config.seed) for i, (mode, seed) in enumerate(config.lanes())]
        self.status = "pending"
        """pending | running | paused | finished | stopped | failed."""
        self.created_at = time.time()
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._step_lock = threading.RLock()
        self._control = threading.Lock()
        """Held while the status changes (see the control methods)."""
        self._thread: threading.Thread | None = None
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """This step's batch of each seed replicate (every lane of a seed trains on its seed's)."""
        self._batch: tuple[torch.Tensor, torch.Tensor] | None = None
        """The batch of the lane stepping now (its seed's)."""
        self._amax_samplers: dict[int, LayerAmaxSampler] = {}
        """Per lane, the shadow copy layer amax is sampled on (RunConfig.amax_every)."""
        self._samples = 0
        """Samples in the current batch (for samples/s)."""
        self._in_flight: deque[tuple[Lane, LaneState, StepResult, int]] = deque()
        """CUDA lane steps whose figures are still on their way to the host, oldest first."""
        self._resolve_at = 0.0
        self.data: Data | None = None
        self.snapshots = SnapshotRing(config.snapshot_every, config.snapshot_keep)
        """[replay] Each lane's rolling state snapshots (RunConfig.snapshot_every/keep): amp_core.probes.replay."""

    # --- control -------------------------------------------------------------------------------------------
    # Status changes from the page (pause, resume) and the thread's own final status are made under `_control`:
    # a pause that read "running" can never overwrite the "finished" of a run that ended meanwhile.
    def start(self) -> Run:
        """Check the config against this process and device (ConfigError), register the run, start the thread."""
        if self._thread is not None:
            raise RuntimeError("a run starts once")
        check_launch(self.config)
        self.sink.open(self.config.to_dict(), self.device, torch.__version__,
                       lane_meta=[{"seed": lane.seed} for lane in self.lanes],
                       lane_modes=[lane.mode for lane in self.lanes])
        self.status = "running"
        self._thread = background.start(self._main, f"amp-run-{self.run_id}", stop=self._ask_to_stop)
        return self

    def pause(self) -> None:
        """Pause before the next lane step (the one under way finishes); a run that is not running is left as it is."""
        with self._control:
            if self.status != "running":
                return
            self.status = "paused"
            self._resume.clear()
            self.sink.event("paused", "paused by the user")

    def resume(self) -> None:
        with self._control:
            if self.status != "paused":
                return
            self.status = "running"
            self.sink.event("resumed", "resumed by the user")
            self._resume.set()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the lane step under way and join the thread."""
        self._ask_to_stop()
        self.join(timeout)

    def _ask_to_stop(self) -> None:
        self._stop.set()
        self._resume.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def going(self) -> bool:
        """Not over yet: about to start, or its thread still going (what counts against RunManager.max_running)."""
        return self._thread is None or self._thread.is_alive()

    @property
    def store_error(self) -> str:
        return self.sink.store_error

    # --- reading (any thread) ------------------------------------------------------------------------------
    def frame(self, since: int = 0) -> pd.DataFrame:
        """Step records [since, now) as a DataFrame."""
        return self.sink.records.frame(since)

    def events(self, since: int = 0) -> list[Event]:
        return self.sink.events[since:]

    def grad_stats(self) -> list[tuple[str, int, int, GradStats]]:
        return list(self.sink.grad_stats)

    def snapshot_lane(self, index: int) -> LaneSnapshot:
        """Copy lane `index` between two steps: its current weights, and the batch of the current step. ValueError if
        the lane holds no model (not started yet, or ended: the thread frees a lane's model when it ends)."""
        lane = self.lanes[index]
        with self._step_lock:
            state = lane.state  # read once: the thread may free the lane the moment the lock is let go
            if state is None or not self._batches:
                why = "has not started yet" if lane.status == "pending" else f"has ended ({lane.status})"
                raise ValueError(f"lane {index} ({lane.mode}) {why}")
            model = copy.deepcopy(state.model)
            batch = tuple(t.clone() for t in self._batches[lane.replicate])
            step = lane.steps_done
            scaler = state.scaler
            scale = scaler.get_scale() if scaler.is_enabled() else None  # a device sync, between two steps
        for p in model.parameters():
            p.grad = None
        return LaneSnapshot(lane.mode, step, model, state.precision, state.workload, batch, scale)

    # --- the thread ----------------------------------------------------------------------------------------
    def _main(self) -> None:
        failure = ""
        try:
            self._setup()
            self._loop()
        except Exception as exc:  # the run failed as a whole (e.g. its data could not load)
            failure = f"{type(exc).__name__}: {exc}"
            self.sink.event("error", failure, data_traceback=traceback.format_exc(limit=5))
            for lane in self.lanes:
                if lane.status in ("pending", "running"):
                    lane.status, lane.error = "failed", str(exc)
        finally:
            for lane in self.lanes:
                lane.state = None  # free the models; records stay
            self._amax_samplers.clear()
            with self._control:
                if failure or (self.lanes and all(lane.status == "failed" for lane in self.lanes)):
                    self.status = "failed"
                elif self._stop.is_set():
                    self.status = "stopped"
                else:
                    self.status = "finished"
                final = self.status
            self.sink.event(final, f"run {final}")
            self.sink.close(final, [(lane.index, lane.status, lane.error) for lane in self.lanes])

    def _setup(self) -> None:
        config, workload = self.config, WORKLOADS[self.config.workload]
        self.data = workload.load_data(config)
        bases = []
        for replicate in range(config.seeds):  # every mode of a seed starts from that seed's weights
            torch.manual_seed(config.seed + replicate)
            bases.append(workload.build_model(config.size, self.data))
        for fault in config.faults:
            if fault.kind in ("grad_inf", "grad_nan"):
                param_by_name(bases[0], fault.param)  # an unknown name fails the run now, not at the fault's step
        for lane in self.lanes:
            lane.state = build_lane_state(config, lane.index, lane.mode, bases[lane.replicate], workload, self.device)
            lane.status = "running"
            params_bytes = tensor_bytes(lane.state.model.parameters())
            lane.held = HeldBytes(params_bytes, params_bytes, 0)  # grads match params; optimizer state after step 1
        self._generators = [torch.Generator().manual_seed(config.seed + r) for r in range(config.seeds)]
        first = self.lanes[0].state
        threads = choose_threads(first, self.data.sample(torch.Generator().manual_seed(config.seed + 1),
                                                         config.batch_size), config.intra_op_threads)
        lanes = f"{config.workload} x {', '.join(config.modes)}"
        if config.seeds > 1:
            lanes += f" x {config.seeds} seeds ({config.seed}-{config.seed + config.seeds - 1})"
        recipes = {lane.mode: lane.state.precision.recipe_report(bases[lane.replicate])
                   for lane in self.lanes if lane.replicate == 0 and lane.state.precision.options}
        skipped = "".join(f"; {recipe}: {len(report['fp8_layers'])} Linear layers in FP8, skipped "
                          f"{', '.join(report['fp8_skipped']) or 'none'}"
                          for recipe, report in recipes.items() if "fp8_layers" in report)
        self.sink.event("started", f"{lanes} on {self.device}; {threads}{skipped}",
                        intra_op_threads=torch.get_num_threads(), recipes=recipes)

    def _loop(self) -> None:
        config = self.config
        for step in range(config.steps):
            # Every lane of a seed sees this same batch, in the same order.
            self._batches = [self.data.sample(generator, config.batch_size) for generator in self._generators]
            self._samples = WORKLOADS[config.workload].samples_in(self._batches[0])
            stepped = False
            for lane in self.lanes:
                if not self._resume.is_set():
                    self._resolve(wait=True)  # a paused run shows every step it made
                    self.sink.flush()
                    self._resume.wait()
                if self._stop.is_set():
                    break
                if lane.status == "running":
                    self._batch = self._batches[lane.replicate]
                    self._run_lane_step(lane, step)
                    stepped = True
                if self._in_flight and (len(self._in_flight) >= RESOLVE_BATCH or time.monotonic() >= self._resolve_at):
                    self._resolve()
                self.sink.flush_if_due()
            if self._stop.is_set() or not stepped:
                break
        self._resolve(wait=True)
        stopped = self._stop.is_set()
        for lane in self.lanes:
            if lane.status == "running":
                lane.status = "stopped" if stopped and lane.steps_done < config.steps else "finished"

    def _run_lane_step(self, lane: Lane, step: int) -> None:
        config, state = self.config, lane.state
        measure = step <= 1 or step % config.memory_every == 0
        stats = config.gradstats_every > 0 and step % config.gradstats_every == 0
        # [replay] Before the step, outside its timed window: its host time joins the step's probe_ms below.
        snapshot_s = (self.snapshots.take(state, step, self._batch, self._generators[lane.replicate])
                      if self.snapshots.due(step) else 0.0)
        try:
            with self._step_lock:
                result = train_step(state, self._batch, step, measure_memory=measure, collect_grad_stats=stats)
            result.probe_ms += snapshot_s * 1e3
        except Exception as exc:  # one lane failing (e.g. out of memory) must not take the others down
            self._resolve(wait=True)  # its earlier steps still become records
            lane.status, lane.error = "failed", f"{type(exc).__name__}: {exc}"
            lane.state = None
            self._amax_samplers.pop(lane.index, None)
            self.sink.event("error", lane.error, lane.index, step, traceback=traceback.format_exc(limit=5))
            return
        if result.in_flight is None:
            self._record(lane, state, result, self._samples)
        else:
            self._in_flight.append((lane, state, result, self._samples))
        if self.config.amax_every and step % self.config.amax_every == 0 and lane.state is not None:
            self._sample_layer_amax(lane, step)

    def _resolve(self, wait: bool = False) -> None:
        """Turn CUDA lane steps whose figures have reached the host into records, oldest first, stopping at the first
        still on its way; `wait` waits for all of them (a host sync: the run's end, a pause, a failing lane).

        Past MAX_IN_FLIGHT waiting steps the oldest is waited for: the host is then that many steps ahead of the
        device, so the wait costs the device nothing (the launch queue would stop the host soon anyway).
        """
        while self._in_flight:
            lane, state, result, samples = self._in_flight[0]
            ready = state.meter.ready(result.in_flight)
            if not (ready or wait or len(self._in_flight) >= MAX_IN_FLIGHT):
                break
            self._in_flight.popleft()
            resolve_step(state.meter, result, wait=not ready)
            self._record(lane, state, result, samples)
        self._resolve_at = time.monotonic() + RESOLVE_EVERY_S

    def _record(self, lane: Lane, state: LaneState, result: StepResult, samples: int) -> None:
        """One resolved lane step -> its StepRecord and events; a non-finite loss stops the lane (on CUDA it is
        noticed here, when the figures arrive, so the lane may have queued a few more steps: they are dropped)."""
        if result.held is not None:
            lane.held = HeldBytes(*result.held)
        if result.activations_bytes is not None:
            lane.activations_bytes = result.activations_bytes
        if result.peak_above_start_bytes is not None:
            lane.peak_above_start_bytes, lane.peak_bytes = result.peak_above_start_bytes, result.lane_peak_bytes
        step, held = result.step, lane.held
        self.sink.step(StepRecord(
            run_id=self.run_id, lane=lane.index, mode=lane.mode, step=step, t_wall_s=result.t_wall_s,
            loss=result.loss, step_ms=result.step_ms, samples_per_s=samples / (result.step_ms / 1e3),
            lr=result.lr, scale=result.scale, skipped=bool(result.skipped),
            grad_norm=math.nan if result.grad_norm is None else result.grad_norm,
            params_bytes=held.params_bytes, grads_bytes=held.grads_bytes, optim_bytes=held.optim_bytes,
            activations_bytes=lane.activations_bytes, peak_above_start_bytes=lane.peak_above_start_bytes,
            lane_peak_bytes=lane.lane_peak_bytes(not state.meter.immediate), probe_ms=result.probe_ms))
        lane.steps_done = step + 1
        record_step_events(self.sink, lane.index, result)
        if not math.isfinite(result.loss) and self.config.stop_on_divergence and lane.status == "running":
            self._stop_diverged(lane, f"loss became {result.loss} at step {step}", step)
        elif lane.steps_done >= self.config.steps and lane.status == "running":
            lane.status = "finished"

    def _stop_diverged(self, lane: Lane, why: str, step: int) -> None:
        """Stop a lane whose loss went non-finite; its steps still queued are dropped. (Under torchrun the ranks
        stop a lane together: amp_core.distributed.DistributedRun.)"""
        dropped = [entry for entry in self._in_flight if entry[0] is lane]
        self._in_flight = deque(entry for entry in self._in_flight if entry[0] is not lane)
        lane.status, lane.error = "diverged", why + divergence_hint(self.config, lane.state.precision)
        lane.state = None
        self._amax_samplers.pop(lane.index, None)
        self.sink.event("diverged", f"lane stopped: {lane.error}", lane.index, step, steps_run_after=len(dropped))

    def _sample_layer_amax(self, lane: Lane, step: int) -> None:
        """Per-module abs max on a shadow copy of the lane (its weights after this step, this step's batch), taken
        after the timed step: its cost is reported in the event as sample_ms and never enters step_ms."""
        state = lane.state
        start = time.perf_counter()
        try:
            scale = state.scaler.get_scale() if state.scaler.is_enabled() else None  # a device sync: sampled steps only
            sampler = self._amax_samplers.get(lane.index)
            if sampler is None:
                sampler = LayerAmaxSampler(state.model, state.precision, state.workload.loss)
                self._amax_samplers[lane.index] = sampler
            sample = sampler.sample(self._batch, scale)
        except Exception as exc:  # a failed sample must not stop the lane
            self.sink.event("warning", f"layer amax sampling failed: {type(exc).__name__}: {exc}", lane.index, step)
            return
        self.sink.event(LAYER_AMAX_EVENT, sample.message(), lane.index, step, **sample.event_data(),
                        sample_ms=(time.perf_counter() - start) * 1e3)


class RunLimitError(ConfigError):
    pass


class RunManager:
    """The process's runs (thread-safe). Pages share one through st.cache_resource."""

    def __init__(self, store: RunStore | None = None, max_running: int = 2, keep: int = 20, store_error: str = ""):
        self.store = store
        self.store_error = store_error
        """Why there is no store (the file was damaged or foreign); runs then live in memory only."""
        self.max_running = max_running
        self.keep = keep
        self._runs: dict[str, Run] = {}
        self._lock = threading.Lock()
        self._problems: dict[str, list[str]] = {}
        """Per run: what readers of its stored records could not read (a damaged chunk), said once each."""

    def launch(self, config: RunConfig) -> Run:
        """Create and start a run; RunLimitError if `max_running` runs are already going (a run counts from the
        moment it is created here, so two launches at once cannot both pass the limit)."""
        with self._lock:
            check_launch(config)
            going = [r for r in self._runs.values() if r.going]
            if len(going) >= self.max_running:
                raise RunLimitError("runs", f"{len(going)} runs are already going (at most {self.max_running}); "
                                            "stop one or wait for it to finish")
            run = Run(config, self.store)
            self._runs[run.run_id] = run
            over = [r for r in self._runs.values() if not r.going]
            for old in over[: max(0, len(self._runs) - self.keep)]:
                del self._runs[old.run_id]
        try:
            return run.start()
        except BaseException:  # it never started (a store that refused it): it holds no place
            with self._lock:
                self._runs.pop(run.run_id, None)
            raise

    def get(self, run_id: str) -> Run | None:
        with self._lock:
            return self._runs.get(run_id)

    def runs(self) -> list[Run]:
        with self._lock:
            return list(self._runs.values())

    def stop_all(self, timeout: float = 30.0) -> None:
        for run in self.runs():
            run.stop(timeout)

    # --- one view over live runs and the store ---------------------------------------------------------------
    def list_runs(self) -> pd.DataFrame:
        """Runs in the store and in memory, newest first: run_id, name, workload, modes, status, created_at."""
        columns = ["run_id", "name", "workload", "modes", "status", "created_at"]
        if self.store is not None:
            self.store.check_liveness()
        stored = self.store.runs()[columns] if self.store is not None else pd.DataFrame(columns=columns)
        live = {r.run_id: r for r in self.runs()}
        stored = stored[~stored["run_id"].isin(live)]
        memory = pd.DataFrame([{"run_id": r.run_id, "name": r.config.name, "workload": r.config.workload,
                                "modes": list(r.config.modes), "status": r.status, "created_at": r.created_at}
                               for r in live.values()], columns=columns)
        frames = [f for f in (memory, stored) if not f.empty]
        if not frames:
            return pd.DataFrame(columns=columns)
        return pd.concat(frames, ignore_index=True).sort_values("created_at", ascending=False, ignore_index=True)

    def track_sources(self, run_id: str, reuse: list | None = None) -> list:
        """The run's tracks as sources for `amp_core.records.query`: in memory while the run is held here, else in
        the store (StoredTrack, for one reader at a time; those in `reuse` keep what they cached)."""
        run = self.get(run_id)
        if run is not None:
            return list(run.sink.records.tracks())
        if self.store is None:
            return []
        return self.store.track_sources(run_id, reuse, self._problems.setdefault(run_id, []))

    def lane_series(self, run_id: str, start: int | None = None, stop: int | None = None,
                    max_points: int = MAX_POINTS, sources: list | None = None) -> list[LaneSeries]:
        """Each track of a run read for charts and headlines: steps [start, stop) (default: all) in about
        `max_points` points per figure, exact (see amp_core.records.query). `sources`: from `track_sources`."""
        sources = self.track_sources(run_id) if sources is None else sources
        stored = self.store is not None and any(isinstance(source, StoredTrack) for source in sources)
        with self.store.snapshot() if stored else contextlib.nullcontext():  # one consistent view of the store
            series = [read_lane(source, start, stop, max_points) for source in sources]
        return [s for s in series if s.stats.records]

    def steps(self, run_id: str, start: int = 0, stop: int | None = None) -> pd.DataFrame:
        """A run's step records of steps [start, stop), every one (memory while the run is held here, else the
        store; a damaged chunk's records are left out and said in `run_info(run_id)["problems"]`)."""
        run = self.get(run_id)
        if run is not None:
            frame = run.frame(start)
            return frame if stop is None else frame[frame["step"] < stop].reset_index(drop=True)
        if self.store is None:
            return empty_steps_frame()
        return self.store.steps(run_id, start, stop, strict=False, problems=self._problems.setdefault(run_id, []))

    def events(self, run_id: str) -> pd.DataFrame:
        """A run's events as a DataFrame (run_id, lane, step, kind, message, t_wall_s, data)."""
        run = self.get(run_id)
        if run is not None:
            return pd.DataFrame([dataclasses.asdict(e) for e in run.events()],
                                columns=["run_id", "kind", "message", "lane", "step", "t_wall_s", "data"])
        if self.store is not None:
            return self.store.events(run_id)
        return pd.DataFrame(columns=["run_id", "kind", "message", "lane", "step", "t_wall_s", "data"])

    def run_info(self, run_id: str) -> dict | None:
        """config (RunConfig dict), status, lanes [{lane, mode, status, error, steps_done, meta}] of a run, and
        problems: what of its stored records could not be read so far (a damaged chunk), as messages."""
        run = self.get(run_id)
        if run is not None:
            return {"run_id": run_id, "config": run.config.to_dict(), "status": run.status, "live": run.alive,
                    "lanes": [{"lane": lane.index, "mode": lane.mode, "status": lane.status, "error": lane.error,
                               "steps_done": lane.steps_done, "meta": {"seed": lane.seed}}
                              for lane in run.lanes],
                    "problems": []}
        if self.store is None:
            return None
        self.store.check_liveness()
        row = self.store.run(run_id)
        if row is None:
            return None
        counts: dict[int, int] = {}
        for track in self.store.tracks(run_id):  # steps per lane: its rank-0 track (ranks step together)
            counts[track["lane"]] = max(counts.get(track["lane"], 0), track["records"])
        return {"run_id": run_id, "config": row["config"], "status": row["status"], "live": False,
                "lanes": [{"lane": lane["lane"], "mode": lane["mode"], "status": lane["status"], "error": lane["error"],
                           "steps_done": int(counts.get(lane["lane"], 0)), "meta": lane["meta"]}
                          for lane in row["lanes"]],
                "problems": list(self._problems.get(run_id, []))}

    def grad_stats(self, run_id: str, lane: int, step: int | None = None) -> list[GradStats]:
        """Gradient statistics of a lane (one step, or every sampled step)."""
        run = self.get(run_id)
        if run is not None:
            return run.sink.grad_stats.get(lane, step)
        return self.store.grad_stats(run_id, lane, step) if self.store is not None else []

    def grad_stat_steps(self, run_id: str, lane: int) -> list[int]:
        run = self.get(run_id)
        if run is not None:
            return run.sink.grad_stats.steps(lane)
        return self.store.grad_stat_steps(run_id, lane) if self.store is not None else []
