"""Run: one thread steps K precision lanes interleaved (A B C A B C ...), per mode one lane per seed replicate;
RunManager: the process's runs."""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from amp_core import background
from amp_core.config import ConfigError, RunConfig
from amp_core.precision import resolve_device
from amp_core.precision.switches import choose_threads
from amp_core.probes.sampled import SampledProbe
from amp_core.race.hooks import lane_probe_track, with_engine_hooks
from amp_core.race.lanes import Lane, build_bases, divergence_hint, plan_plain_steps, run_outcome, started_event
from amp_core.race.reading import RunReading
from amp_core.race.snapshots import SnapshotRing
from amp_core.race.step import LaneState, build_lane_state, plain_work, train_step
from amp_core.records import Event
from amp_core.records.sink import RecordSink, new_run_id
from amp_core.records.store import RunStore
from amp_core.runs import RunReader
from amp_core.telemetry import LaneTrack, StepRecorder, StepResult
from amp_core.workloads import WORKLOADS, Data, check_launch

__all__ = ["Lane", "Run", "RunHooks", "RunLimitError", "RunManager", "build_lane_state"]


LaneHook = Callable[["Run", Lane, int], float | None]


@dataclass(slots=True)
class RunHooks:
    """Where a Run is extended — the torchrun race, recipes, replay snapshots, tests — instead of by overriding its
    methods. Every hook runs on the run's own thread, in the order of its list; none may call `st.*`.

    - `build_lane(config, index, mode, base_model, workload, device) -> LaneState`: how a lane's model, optimizer,
      scheduler and scaler are built (default `build_lane_state`; a recipe that builds its own optimizer replaces it);
    - `lane_setup(run, lane)`: once every lane's state is built, for each lane in order (wrap its model:
      `lane.state.bind_model(...)`);
    - `setup_done(run)`: after the "started" event, before the first step (replace `run.generators`, say something);
    - `before_lane_step(run, lane, step)` / `after_lane_step(run, lane, step)`: around each full lane step, the
      lane's batch in `run.batch_of(lane)`; after a failed step `lane.status` is "failed". Between two lane steps the
      lane's model is quiet: a snapshot (`run.snapshot_lane`, or the state itself) can be taken there. A before hook
      that measures returns the host seconds it took (else None): they join the step's probe_ms, outside its step_ms.
      A hook that acts only every N steps says so with an `every` attribute (an int > 0): the steps in between may
      then be plain ones, which no hook sees; a hook without it sees every step (the replay snapshots,
      snapshots.SnapshotHook, are the first before hook when RunConfig.snapshot_every is set);
    - `probes(run, lane) -> SampledProbe | None`: each lane's per-step diagnostics (probes.sampled), one made per lane
      (None: nothing for this lane), which its step driver carries (the layer amax, probes.layer_amax.LayerAmaxProbe,
      is the first when RunConfig.amax_every is set); they join the steps' plain-or-full choice through their
      `full_at`, and their figures are read at each flush;
    - `lane_end(run, lane)`: a lane's state is let go (it failed, diverged or the run ended);
    - `on_divergence(run, lane, why, step)`: a lane's loss went non-finite; default `Run.stop_lane` (torchrun: the
      ranks agree first);
    - `run_end(run)`: the thread's last act, after the final status is set and the records are closed;
    - `lane_meta(run, lane) -> dict`: facts stored with each lane when the run opens, beside its seed (e.g. the FSDP2
      policy it trains under, which Compare names);
    - `describe(run) -> (clause, data)`: once every lane is set up, what the run's `started` event says beyond its
      lanes (a clause of its message, fields of its data).
    """

    build_lane: Callable[..., LaneState] = build_lane_state
    lane_meta: list[Callable[[Run, Lane], dict]] = field(default_factory=list)
    describe: list[Callable[[Run], tuple[str, dict]]] = field(default_factory=list)
    lane_setup: list[Callable[[Run, Lane], None]] = field(default_factory=list)
    setup_done: list[Callable[[Run], None]] = field(default_factory=list)
    before_lane_step: list[LaneHook] = field(default_factory=list)
    after_lane_step: list[LaneHook] = field(default_factory=list)
    on_divergence: Callable[[Run, Lane, str, int], None] | None = None
    lane_end: list[Callable[[Run, Lane], None]] = field(default_factory=list)
    probes: list[Callable[[Run, Lane], SampledProbe]] = field(default_factory=list)
    run_end: list[Callable[[Run], None]] = field(default_factory=list)

    def plain_steps(self) -> tuple[int, ...] | None:
        """The every N of each lane-step hook when every one of them acts every N steps only (the steps in between
        may be plain); None when one watches every step."""
        everies = [getattr(hook, "every", None) for hook in (*self.before_lane_step, *self.after_lane_step)]
        return None if None in everies else tuple(everies)

    def lane_meta_of(self, run: Run, lane: Lane) -> dict:
        """What is stored with `lane` when the run opens: its seed, and what each `lane_meta` hook adds."""
        meta = {"seed": lane.seed}
        for hook in self.lane_meta:
            meta.update(hook(run, lane))
        return meta


class Run(RunReading):
    """A launch: one workload, one lane per mode and seed replicate, driven by one background thread.

    Run owns the lifecycle (start, pause, resume, stop, join) and the interleaved loop; a StepRecorder (telemetry)
    turns each lane step into records through its RecordSink; what can be read of it from any thread is RunReading's
    (reading.py). It is extended through `hooks` (RunHooks; the engine's: hooks.py), never by overriding its methods.
    `sink`: where the records go (default a RecordSink on `store`; torchrun: a RankSink).
    """

    offers_fsdp = False
    """Whether this kind of run can shard its lanes with FSDP2 (RunConfig.fsdp): a rank of a torchrun job can."""

    def __init__(self, config: RunConfig, store: RunStore | None = None, run_id: str | None = None, *,
                 sink: RecordSink | None = None, hooks: RunHooks | None = None):
        self.config = config
        self.sink = sink if sink is not None else RecordSink(run_id or new_run_id(), store)
        self.run_id = self.sink.run_id
        self.hooks = hooks if hooks is not None else RunHooks()
        self.recorder = StepRecorder(self.sink)
        self.recorder.on_record.append(self._recorded)
        self.device = resolve_device(config.device)
        self.lanes = [Lane(i, mode, seed, seed - config.seed) for i, (mode, seed) in enumerate(config.lanes())]
        self.status = "pending"
        """pending | running | paused | finished | stopped | failed."""
        self.created_at = time.time()
        self.generators: list[torch.Generator] = []
        """One batch sampler per seed replicate (set up by the thread; a setup_done hook may replace them)."""
        self.data: Data | None = None
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._asked = False
        """A pause or a stop was asked: the loop looks at the two events above only when this is set (an attribute
        read, where `Event.is_set` would be a Python call on every lane step)."""
        self._pause_at: int | None = None
        """`pause_at`'s step: the thread pauses itself before that step's first lane step."""
        self._parked = threading.Event()
        """Set while a paused run's thread waits for `resume`, every step it made recorded (`wait_paused`)."""
        self._step_lock = threading.RLock()
        self._control = threading.Lock()
        """Held while the status changes (see the control methods)."""
        self._thread: threading.Thread | None = None
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """This step's batch of each seed replicate (every lane of a seed trains on its seed's)."""
        self._samples = 0
        """Samples in the current batch (for samples/s)."""
        self.snapshots = SnapshotRing(config.snapshot_every, config.snapshot_keep)
        """[replay] Each lane's rolling state snapshots (RunConfig.snapshot_every/keep): amp_core.race.snapshots, read
        by amp_core.diagnostics.replay; taken by a SnapshotHook, the first before_lane_step hook."""
        self.compile_captures: dict[int, list] = {}
        """[compiled lanes] Per lane, what its own compiles produced (amp_core.race.compiled.LaneCompile: graphs' ops,
        kernels, casts; the first compile and the latest recompiles), made by the compile hooks while it compiles."""
        self.hooks = with_engine_hooks(self.hooks, config, self.snapshots)

    # --- control -------------------------------------------------------------------------------------------
    # Status changes from the page (pause, resume) and the thread's own final status are made under `_control`:
    # a pause that read "running" can never overwrite the "finished" of a run that ended meanwhile.
    def start(self) -> Run:
        """Check the config against this process and device (ConfigError), register the run, start the thread."""
        if self._thread is not None:
            raise RuntimeError("a run starts once")
        check_launch(self.config)
        if self.config.fsdp and not self.offers_fsdp:
            raise ConfigError("fsdp", "FSDP2 shards each lane's model across the ranks of a torchrun job: run it "
                                      "with `amp-lab run --nproc N --fsdp`")
        self.sink.open(self.config.to_dict(), self.device, torch.__version__,
                       lane_meta=[self.hooks.lane_meta_of(self, lane) for lane in self.lanes],
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
            self._asked = True
            self.sink.event("paused", "paused by the user")

    def pause_at(self, step: int) -> None:
        """Run on (resuming a paused run) and pause before step `step`, every lane having made `step` steps (or the
        step under way, where `step` has passed), all recorded: `wait_paused` then returns. A run that ends first
        never pauses. The thread pauses itself: nothing outside it needs to watch the step count (bench.overhead's
        turns wait on `wait_paused`, where a thread polling the count would take the GIL in the run's steps)."""
        with self._control:
            if self.status not in ("running", "paused"):
                return
            self._pause_at = step
            self._asked = True
        self.resume()

    def _pause_self(self, step: int) -> None:
        """The thread, at `pause_at`'s step: paused as by `pause` (a stop or the end, meanwhile, wins)."""
        with self._control:
            self._pause_at = None
            if self.status == "running":
                self.status = "paused"
                self._resume.clear()
                self.sink.event("paused", f"paused before step {step}", step=step)

    def wait_paused(self, timeout: float | None = None) -> bool:
        """Wait until a paused run's thread has stopped stepping (every step it made recorded and flushed); False if
        it did not within `timeout` (a run that ended, or was never paused, never does)."""
        return self._parked.wait(timeout)

    def resume(self) -> None:
        with self._control:
            if self.status != "paused":
                return
            self._parked.clear()  # before the thread wakes: a `wait_paused` after the next `pause` waits for it
            self.status = "running"
            self.sink.event("resumed", "resumed by the user")
            self._asked = self._stop.is_set() or self._pause_at is not None
            self._resume.set()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the lane step under way and join the thread."""
        self._ask_to_stop()
        self.join(timeout)

    def _ask_to_stop(self) -> None:
        self._stop.set()
        self._asked = True
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

    # --- lanes (the run's thread; hooks may call these) ------------------------------------------------------
    def stop_lane(self, lane: Lane, why: str, step: int) -> None:
        """Stop a lane whose loss went non-finite now; its steps still on their way are dropped."""
        dropped = self.recorder.drop(lane.track)
        lane.status, lane.error = "diverged", why + divergence_hint(self.config, lane.state.precision)
        self._free(lane)
        self.sink.event("diverged", f"lane stopped: {lane.error}", lane.index, step, steps_run_after=dropped)

    def _free(self, lane: Lane) -> None:
        if lane.state is not None:
            lane.state.driver.end_probes()
        lane.state = None
        for hook in self.hooks.lane_end:
            hook(self, lane)

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
                if lane.state is not None:
                    self._free(lane)  # free the models; records stay
            with self._control:
                self.status = final = run_outcome(self.lanes, bool(failure), self._stop.is_set())
            self.sink.event(final, f"run {final}")
            self.sink.close(final, [(lane.index, lane.status, lane.error) for lane in self.lanes])
            for hook in self.hooks.run_end:
                hook(self)

    def _setup(self) -> None:
        config, workload = self.config, WORKLOADS[self.config.workload]
        self.data = workload.load_data(config)
        bases = build_bases(config, workload, self.data)
        for lane in self.lanes:
            lane.state = self.hooks.build_lane(config, lane.index, lane.mode, bases[lane.replicate], workload,
                                               self.device)
            lane.track = self.recorder.track(lane.index, lane.mode, lane.state.meter)
            lane.state.driver.attach(self.recorder, lane.track)
            lane.status = "running"
        self.generators = [torch.Generator().manual_seed(config.seed + r) for r in range(config.seeds)]
        first = self.lanes[0].state  # measured on the lane's own model, before any hook wraps it
        threads = choose_threads(first, self.data.sample(torch.Generator().manual_seed(config.seed + 1),
                                                         config.batch_size), config.intra_op_threads)
        for lane in self.lanes:
            for hook in self.hooks.lane_setup:
                hook(self, lane)
        message, data = started_event(config, self.lanes, bases, self.device, threads,
                                      [hook(self) for hook in self.hooks.describe])
        self.sink.event("started", message, **data)
        for hook in self.hooks.setup_done:
            hook(self)

    def _loop(self) -> None:
        config, recorder, hooks, sink = self.config, self.recorder, self.hooks, self.sink
        # Plain steps where every hook acts every N steps only, and the sink's flush needs no call per step.
        plain_run = plan_plain_steps(self.lanes, hooks.plain_steps(), sink.counts_calls)
        for lane in self.lanes:
            # Made now that every lane-setup hook has bound the model the lane trains (a DDP wrapper, say).
            state = lane.state if lane.plain else None
            lane.plain_step = None if state is None else \
                state.driver.plain_step(plain_work(state), state.precision.step_context)
            if lane.state is not None and hooks.probes:
                probes = [probe for make in hooks.probes if (probe := make(self, lane)) is not None]
                lane.state.driver.carry(probes, lane_probe_track(self, lane))
        reading = [lane.state.driver for lane in self.lanes if lane.state is not None and lane.state.driver.sampled]
        flush_at, workload = 0.0, WORKLOADS[config.workload]
        # Bound once: on a plain step each attribute looked up or Python call made is a few hundred ns to a
        # microsecond with the caches holding the model.
        sample, generators, lanes = self.data.sample, self.generators, self.lanes
        sizes, step_lock, monotonic = [config.batch_size] * len(generators), self._step_lock, time.monotonic
        for step in range(config.steps):
            # Every lane of a seed sees this same batch, in the same order.
            self._batches = batches = list(map(sample, generators, sizes))
            self._samples = samples = workload.samples_in(batches[0])
            stepped = False
            for lane in lanes:
                if self._asked:
                    if self._pause_at is not None and step >= self._pause_at:
                        self._pause_self(step)
                    if not self._resume.is_set():
                        self._park()
                    if self._stop.is_set():
                        break
                if lane.status == "running":
                    driver = lane.state.driver
                    if driver.is_plain(step):
                        try:
                            with step_lock:
                                failed = lane.plain_step(step, batches[lane.replicate], samples)
                        except Exception as exc:
                            self._lane_failed(lane, step, exc)
                        else:
                            lane.steps_done = step + 1
                            if failed is not None:  # a loss known not to be finite (the lane stops on it as on a
                                self._drain()       # full step) or a skipped step: recorded at once, in full
                                window, lr, loss, skipped = failed
                                with step_lock:
                                    result = driver.finish(window, step, lr, loss, skipped=skipped)
                                driver.record(result, samples)
                    else:
                        self._drain()  # the plain steps before this one are recorded first, in step order
                        probe_s = 0.0  # what the before hooks measured, outside the step's timed window
                        for hook in hooks.before_lane_step:
                            probe_s += hook(self, lane, step) or 0.0
                        self._lane_step(lane, step, probe_s)
                        for hook in hooks.after_lane_step:
                            hook(self, lane, step)
                    stepped = True
                if monotonic() >= flush_at:  # one clock read a step (a RankSink's flush counts steps: each)
                    self._drain()  # what the flush writes holds every step made
                    for driver in reading:  # the sampled probes' figures kept on the device, as events
                        driver.read_probes()
                    sink.flush_if_due()
                    flush_at = sink.flush_due_at if plain_run else 0.0
            if (self._asked and self._stop.is_set()) or not stepped:
                break
        self._drain()
        for driver in reading:
            driver.read_probes()
        recorder.resolve(wait=True)
        stopped = self._stop.is_set()
        for lane in self.lanes:
            if lane.status == "running":
                lane.status = "stopped" if stopped and lane.steps_done < config.steps else "finished"

    def _park(self) -> None:
        """A paused run's thread: every step it made recorded and flushed, it waits for `resume` (or a stop)."""
        self._drain()
        self.recorder.resolve(wait=True)  # a paused run shows every step it made
        self.sink.flush()
        self._parked.set()
        self._resume.wait()
        self._parked.clear()

    def _lane_step(self, lane: Lane, step: int, probe_s: float) -> None:
        state, schedule = lane.state, lane.state.schedule
        try:
            with self._step_lock:
                result = train_step(state, self._batches[lane.replicate], step, measure_memory=schedule.memory(step),
                                     collect_grad_stats=schedule.grad_stats(step))
            result.probe_ms += probe_s * 1e3
        except Exception as exc:  # one lane failing (e.g. out of memory) must not take the others down
            self._lane_failed(lane, step, exc)
            return
        state.driver.record(result, self._samples)
        state.driver.after_step(step)

    def _drain(self) -> None:
        """Every lane's kept plain steps become records, oldest first (lane by lane: each lane's are in step order)."""
        for lane in self.lanes:
            if lane.state is not None:
                lane.state.driver.drain()

    def _lane_failed(self, lane: Lane, step: int, exc: Exception) -> None:
        self._drain()
        self.recorder.resolve(wait=True)  # its earlier steps still become records
        lane.status, lane.error = "failed", f"{type(exc).__name__}: {exc}"
        self._free(lane)
        self.sink.event("error", lane.error, lane.index, step, traceback=traceback.format_exc(limit=5))

    def _recorded(self, track: LaneTrack, result: StepResult) -> None:
        """A lane step became a record: count it; a non-finite loss stops the lane (on CUDA it is noticed when the
        figures arrive, so the lane may have queued a few more steps: they are dropped)."""
        lane = self.lanes[track.lane]
        step = result.step
        lane.steps_done = max(lane.steps_done, step + 1)  # a plain step counted itself when it was made
        if not math.isfinite(result.loss) and self.config.stop_on_divergence and lane.status == "running":
            why = f"loss became {result.loss} at step {step}"
            if self.hooks.on_divergence is None:
                self.stop_lane(lane, why, step)
            else:
                self.hooks.on_divergence(self, lane, why, step)
        elif lane.steps_done >= self.config.steps and lane.status == "running":
            lane.status = "finished"


class RunLimitError(ConfigError):
    pass


class RunManager(RunReader):
    """The process's runs (thread-safe), and every run read alike whether it trains here or is in the store
    (RunReader). Pages share one through st.cache_resource."""

    def __init__(self, store: RunStore | None = None, max_running: int = 2, keep: int = 20, store_error: str = ""):
        super().__init__(store)
        self.store_error = store_error
        """Why there is no store (the file was damaged or foreign); runs then live in memory only."""
        self.max_running = max_running
        self.keep = keep
        self._runs: dict[str, Run] = {}
        self._lock = threading.Lock()

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

    def record_event(self, run_id: str, kind: str, message: str, lane: int | None = None, step: int | None = None,
                     **data) -> None:
        """An event about a run made after the fact (a replay's report): through its sink when this process holds it
        (written at its next flush, or now when it has ended), else straight into the store."""
        run = self.get(run_id)
        if run is not None:
            run.sink.event(kind, message, lane, step, **data)
            if not run.alive:
                run.sink.flush()
        elif self.store is not None:
            self.store.add_events([Event(run_id, kind, message, lane, step, data=data)])

    def runs(self) -> list[Run]:
        with self._lock:
            return list(self._runs.values())

    def stop_all(self, timeout: float = 30.0) -> None:
        for run in self.runs():
            run.stop(timeout)
