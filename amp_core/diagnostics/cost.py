"""What each precision mode costs per step for a workload on this device, measured the way a run measures it.

The Train page shows it before launch, because the brochure speedups do not hold everywhere: on a CPU without
native fp16, 16-mixed autocast made a 1x1-conv CNN 62x slower than fp32. The probe is a short race through the runner
itself: a real Run of the chosen modes (32-true always among them), on the same thread set-up, the lanes interleaved
as in a run, a few warm-up steps left out, each lane's figure the median of its step times. A probe that timed each
mode on its own, on another thread, read bf16-mixed anywhere from 0.11x to 3.9x of 32-true where runs showed 0.7-0.8x.
The figures are remembered; a finished run whose medians disagree by more than AGREEMENT replaces them.

For sizes too slow to probe (a GPU size on a CPU), `estimate_step` says what a step would take before anyone
launches it: an ESTIMATE, from counted FLOPs and a measured matmul rate, and marked as one wherever it is shown.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from amp_core import background
from amp_core.config import RunConfig
from amp_core.precision import BASELINE_MODE, get_precision, resolve_device
from amp_core.race.runner import Run
from amp_core.records.store import RunStore
from amp_core.runs import PROBE_RUN_PREFIX
from amp_core.workloads import WORKLOADS, check_launch

SLOW_FACTOR = 1.5
"""A mode taking this many times the baseline's time per step (or more) is flagged as far slower."""
WARMUP_STEPS = 10
"""Steps of each lane left out of its figure: first calls, allocator growth, oneDNN picking its kernels."""
TIMED_STEPS = 30
"""Steps of each lane the figure is the median of."""
MIN_TIMED_S = 1.0
"""A race whose timed steps took less than this in all lanes is raced again for longer: a few dozen steps of a small
model last a few milliseconds, and a moment of another process on a core (the browser drawing the page that asked)
moved a mode's figure by a quarter (bf16-mixed read 1.07x-1.67x of 32-true over five server starts; the runs launched
right after, 1.32x-1.43x)."""
TIME_CAP_S = 20.0
"""A race still going after this long is stopped; its lanes' figures come from the steps made so far (capped)."""
AGREEMENT = 0.20
"""A finished run whose median ms/step of a mode is more than this far (relative) from the remembered figure
replaces the remembered figures with its own."""
MIN_RUN_STEPS = WARMUP_STEPS + TIMED_STEPS
"""A run teaches the board only if each of its lanes made at least this many steps."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One mode's measured cost on one workload, size, batch and device."""

    mode: str
    ms_per_step: float
    """Median of the lane's timed steps (each step's own measured time, as a run records it)."""
    steps_timed: int
    capped: bool
    """The time cap cut the race short (fewer steps than asked)."""
    source: str = "cost probe"
    """What measured it: the cost probe, or a run (its id) whose figures replaced the probe's."""


def race_modes(config: RunConfig) -> tuple[str, ...]:
    """The modes a probe of `config` races: 32-true (the yardstick) first, then the config's own."""
    return (BASELINE_MODE, *[mode for mode in config.modes if mode != BASELINE_MODE])


def cost_key(config: RunConfig) -> tuple:
    """What a step's cost depends on (not the step count, seed, LR or name): the figures are remembered by it."""
    return (config.workload, config.size, config.batch_size, resolve_device(config.device), config.data_dir,
            config.optimizer, config.fused_optimizer, config.scheduler, config.grad_clip > 0, config.memory_every,
            config.gradstats_every, config.grad_norm_every, config.amax_every, config.intra_op_threads)


def race(config: RunConfig, *, warmup: int = WARMUP_STEPS, steps: int = TIMED_STEPS, time_cap_s: float = TIME_CAP_S,
         min_timed_s: float = MIN_TIMED_S, on_start=None,
         store: RunStore | None = None) -> dict[str, ProbeResult | str]:
    """Race `config`'s modes (see race_modes) for `warmup` + `steps` steps through a real Run, and give
    each mode's median step time after the warm-up, or the error text of a lane that failed. Where those timed steps
    took less than `min_timed_s` in all, that race only told the pace: the modes race again, for as many steps as
    fill `min_timed_s` (within what is left of `time_cap_s`), and that race gives the figures. ConfigError for
    settings a run would refuse. `on_start(run)` is called with each Run once it started (to stop it from outside).
    `store`: where each race is kept as an ordinary run (the advisor's evidence); None keeps it in memory only."""
    deadline = time.monotonic() + time_cap_s
    out, timed_s, ended = _race_once(config, warmup, steps, time_cap_s, on_start, store=store)
    if ended != "finished" or timed_s >= min_timed_s or timed_s <= 0:
        return out
    round_s = timed_s / steps  # one step of every lane, as this race went
    left_s = deadline - time.monotonic()
    longer = min(math.ceil(min_timed_s / round_s), int(left_s / 2 / round_s) - warmup)
    if longer <= steps:
        return out
    again, _, _ = _race_once(config, warmup, longer, deadline - time.monotonic(), on_start, enough=steps, store=store)
    # Cut by the cap before it timed as many steps as the short race (the machine slowed down): the short one stands.
    return out if any(isinstance(result, ProbeResult) and result.capped for result in again.values()) else again


def _race_once(config: RunConfig, warmup: int, steps: int, time_cap_s: float, on_start,
               enough: int | None = None, store: RunStore | None = None) -> tuple[dict[str, ProbeResult | str], float,
                                                                                  str]:
    """One race (see `race`): each mode's figure, the seconds its timed steps took in all lanes, how the Run ended.
    A figure of fewer than `enough` timed steps (default: `steps`) is marked capped."""
    enough = steps if enough is None else enough
    # A lane whose loss goes NaN still costs what a step costs: it steps on, as it would with stop_on_divergence off.
    probe = dataclasses.replace(config, modes=race_modes(config), steps=warmup + steps, faults=(),
                                name=config.name or "cost probe", stop_on_divergence=False)
    run = Run(probe, store, run_id=f"{PROBE_RUN_PREFIX}{uuid.uuid4().hex[:8]}").start()
    if on_start is not None:
        on_start(run)
    run.join(time_cap_s)
    capped = run.alive
    if capped:
        run.stop()
    frame = run.frame()
    out: dict[str, ProbeResult | str] = {}
    timed_s = 0.0
    for lane in run.lanes:
        if lane.status == "failed":
            out[lane.mode] = lane.error or lane.status
            continue
        rows = frame[frame["lane"] == lane.index]
        timed = rows.loc[rows["step"] >= warmup, "step_ms"].to_numpy(dtype=float)
        if timed.size == 0:  # the cap came during the warm-up: its steps, slow as they are, are all there is
            timed = rows["step_ms"].to_numpy(dtype=float)
        if timed.size == 0:
            out[lane.mode] = f"no step finished within {time_cap_s:g} s"
            continue
        timed_s += float(timed.sum()) / 1e3
        out[lane.mode] = ProbeResult(lane.mode, float(np.median(timed)), int(timed.size), timed.size < enough)
    return out, timed_s, "capped" if capped else run.status


def relative_costs(results: list[ProbeResult], baseline: str = BASELINE_MODE) -> pd.DataFrame:
    """mode, ms_per_step, time_vs_baseline (x the baseline's ms/step), far_slower, steps_timed, capped, source."""
    frame = pd.DataFrame([{"mode": r.mode, "ms_per_step": r.ms_per_step, "steps_timed": r.steps_timed,
                           "capped": r.capped, "source": r.source} for r in results],
                         columns=["mode", "ms_per_step", "steps_timed", "capped", "source"])
    base = frame.loc[frame["mode"] == baseline, "ms_per_step"]
    frame["time_vs_baseline"] = frame["ms_per_step"] / base.iloc[0] if not base.empty else float("nan")
    frame["far_slower"] = frame["time_vs_baseline"] >= SLOW_FACTOR
    return frame[["mode", "ms_per_step", "time_vs_baseline", "far_slower", "steps_timed", "capped", "source"]]


class ProbeBoard:
    """Cost probes raced on a worker thread, one at a time, and remembered for the life of the process.

    A page asks with `get(config)` and never waits: the first ask queues a race and answers None (measuring); later
    asks answer each mode's ProbeResult, or the error text of a mode that could not run. `learn_from_run` lets a
    finished run's own figures replace remembered ones that disagree with it. `stop` ends the race under way and
    forgets the queue (at exit, or when a test ends); a later ask starts again.
    """

    def __init__(self, warmup: int = WARMUP_STEPS, steps: int = TIMED_STEPS, time_cap_s: float = TIME_CAP_S,
                 min_timed_s: float = MIN_TIMED_S):
        self.warmup, self.steps, self.time_cap_s, self.min_timed_s = warmup, steps, time_cap_s, min_timed_s
        self._figures: dict[tuple, dict[str, ProbeResult | str]] = {}
        """Per cost_key, each mode's figure (or why its lane failed)."""
        self._refused: dict[tuple, str] = {}
        """Per (cost_key, race_modes): why a race of exactly those modes could not start."""
        self._queue: list[RunConfig] = []
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._racing: Run | None = None
        self._stopped = False

    def known(self, config: RunConfig) -> dict[str, ProbeResult | str] | None:
        """Each of the config's modes (race_modes order) as remembered, or None if one is not measured yet."""
        with self._lock:
            return self._known(config)

    def _known(self, config: RunConfig) -> dict[str, ProbeResult | str] | None:
        figures = self._figures.get(cost_key(config), {})
        modes = race_modes(config)
        refused = self._refused.get((cost_key(config), modes))
        if refused is not None:
            return dict.fromkeys(modes, refused)
        return {mode: figures[mode] for mode in modes} if all(mode in figures for mode in modes) else None

    def get(self, config: RunConfig) -> dict[str, ProbeResult | str] | None:
        """As `known`; when a figure is missing, a race of every mode of the config is queued (None: measuring)."""
        with self._lock:
            found = self._known(config)
            if found is not None:
                return found
            self._stopped = False
            if not any(cost_key(q) == cost_key(config) and race_modes(q) == race_modes(config) for q in self._queue):
                self._queue.append(config)
            if self._worker is None:
                self._worker = background.start(self._work, "amp-probe", stop=self.stop)
        return None

    def measuring(self) -> bool:
        with self._lock:
            return self._worker is not None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is done (for scripts and tests); False if `timeout_s` ran out first."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout_s)
        return not (worker is not None and worker.is_alive())

    def stop(self) -> None:
        """Forget the queue and stop the race under way (its thread ends within a lane step)."""
        with self._lock:
            self._queue.clear()
            self._stopped = True
            racing = self._racing
        if racing is not None:
            racing.stop(timeout=0)

    def learn_from_run(self, config: RunConfig, medians: dict[str, tuple[float, int]], run_id: str) -> bool:
        """A run of `config` made `medians` {mode: (median ms/step, steps)}. If a remembered figure of one of its
        modes is more than AGREEMENT away from the run's, the run's figures replace the remembered ones (and the
        others of that key, raced beside the stale figures, are forgotten, to be raced again). True if replaced."""
        usable = {mode: (ms, steps) for mode, (ms, steps) in medians.items()
                  if steps >= MIN_RUN_STEPS and math.isfinite(ms) and ms > 0}
        if not usable:
            return False
        key = cost_key(config)
        with self._lock:
            figures = self._figures.get(key, {})
            stale = [mode for mode, (ms, _) in usable.items() if isinstance(figures.get(mode), ProbeResult)
                     and abs(figures[mode].ms_per_step / ms - 1) > AGREEMENT]
            if not stale:
                return False
            self._figures[key] = {mode: ProbeResult(mode, ms, steps, False, f"run {run_id}")
                                  for mode, (ms, steps) in usable.items()}
        return True

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self._stopped:
                    self._worker = None
                    return
                config = self._queue[0]

            def racing(run: Run) -> None:
                with self._lock:
                    self._racing = run
                    stopped = self._stopped
                if stopped:
                    run.stop(timeout=0)

            outcome: dict[str, ProbeResult | str] = {}
            refused = ""
            try:
                outcome = race(config, warmup=self.warmup, steps=self.steps, time_cap_s=self.time_cap_s,
                               min_timed_s=self.min_timed_s, on_start=racing)
            except Exception as exc:  # an unrunnable config is shown as text; it must not kill the worker
                refused = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._racing = None
                if refused:
                    self._refused[cost_key(config), race_modes(config)] = refused
                elif not self._stopped:  # a race cut short by stop() measured nothing worth keeping
                    self._figures.setdefault(cost_key(config), {}).update(outcome)
                if self._queue and self._queue[0] is config:
                    self._queue.pop(0)


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """An ESTIMATE of one training step's time, not a measurement: the FLOPs of its forward and backward, counted,
    divided by the rate this device reached on a real matmul in the mode's compute dtype. Matmuls and convolutions
    are counted; elementwise ops, the optimizer and launch overheads are not, so a real step takes longer."""

    mode: str
    flops_per_step: float
    """Forward + backward FLOPs at the real batch (torch.utils.flop_counter)."""
    matmul_flops_per_s: float
    """Measured on this device: a square matmul in the mode's compute dtype."""
    compute_dtype: str

    @property
    def ms_per_step(self) -> float:
        return self.flops_per_step / self.matmul_flops_per_s * 1e3


@functools.lru_cache(maxsize=64)
def step_flops(workload: str, size: str, batch_size: int) -> float:
    """FLOPs of one forward + backward of the workload at `batch_size`, counted by torch.utils.flop_counter.

    Counted on the meta device (shapes only: no weights allocated, nothing computed), with a real batch's shapes.
    A model that needs real values (data-dependent code) is counted on a 2-sample real batch and scaled.
    """
    from torch.utils.flop_counter import FlopCounterMode

    config = RunConfig(workload=workload, size=size, batch_size=batch_size)
    check_launch(config)
    spec = WORKLOADS[workload]
    data = spec.load_data(config)
    generator = torch.Generator().manual_seed(0)

    def count(device: str, batch: int) -> float:
        with torch.device(device):
            model = spec.build_model(size, data)
        inputs, targets = (t.to(device) for t in data.sample(generator, batch))
        with FlopCounterMode(display=False) as counter:
            spec.loss(model(inputs), targets).backward()
        return float(counter.get_total_flops())

    try:
        return count("meta", batch_size)
    except (NotImplementedError, RuntimeError):
        return count("cpu", 2) * batch_size / 2


@functools.lru_cache(maxsize=32)
def matmul_flops_per_s(mode: str, device: str = "auto", side: int = 512, min_time_s: float = 0.2,
                       warmup: int = 3) -> float:
    """This device's FLOP rate on a real `side` x `side` matmul in the mode's compute dtype (TF32 on for tf32), the
    best of repeated timings over at least `min_time_s` after `warmup` calls (oneDNN's bf16 path here ran 12x faster
    from about the tenth call). On CUDA each timing waits for the device (a probe, no run)."""
    precision = get_precision(mode, device)
    dtype = precision.autocast_dtype or precision.param_dtype
    a = torch.randn(side, side, device=precision.device).to(dtype)
    b = torch.randn(side, side, device=precision.device).to(dtype)
    cuda = precision.device_type == "cuda"
    best, spent = float("inf"), 0.0
    with precision.step_context():
        for _ in range(warmup):
            a @ b
        if cuda:
            torch.cuda.synchronize()  # the warm-up's kernels are not the first timed matmul's
        while spent < min_time_s or best == float("inf"):
            started = time.perf_counter()
            a @ b
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            best, spent = min(best, elapsed), spent + elapsed
    return 2 * side**3 / best


def estimate_step(workload: str, size: str, batch_size: int, mode: str, device: str = "auto") -> StepEstimate:
    """What one step of `mode` would take here, estimated (see StepEstimate). Raises ConfigError for settings a run
    would refuse."""
    check_launch(RunConfig(workload=workload, size=size, batch_size=batch_size, modes=(mode,), device=device))
    precision = get_precision(mode, device)
    dtype = precision.autocast_dtype or precision.param_dtype
    return StepEstimate(mode, step_flops(workload, size, batch_size), matmul_flops_per_s(mode, device),
                        str(dtype).removeprefix("torch.") + (" (TF32)" if precision.tf32 else ""))
