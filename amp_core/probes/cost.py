"""A short measured cost probe: what each precision mode costs per step for a workload on this device.

The Train page shows it before launch, because the brochure speedups do not hold everywhere: on a CPU without
native fp16, 16-mixed autocast made a 1x1-conv CNN 62x slower than fp32. The probe runs the real training step
(the runner's lane set-up and `train_step`) for a few steps per mode, under a time cap.

For sizes too slow to probe (a GPU size on a CPU), `estimate_step` says what a step would take before anyone
launches it: an ESTIMATE, from counted FLOPs and a measured matmul rate, and marked as one wherever it is shown.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from dataclasses import dataclass

import pandas as pd
import torch

from amp_core.config import RunConfig, check_launch
from amp_core.precision import BASELINE_MODE, get_precision, resolve_device
from amp_core.runner import build_lane_state, choose_threads
from amp_core.step import resolve_step, train_step
from amp_core.workloads import WORKLOADS

SLOW_FACTOR = 1.5
"""A mode taking this many times the baseline's time per step (or more) is flagged as far slower."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One mode's measured cost on one workload, size, batch and device."""

    mode: str
    ms_per_step: float
    """Median of the timed steps (each step's own measured time: perf_counter on a CPU, CUDA events on a GPU)."""
    steps_timed: int
    capped: bool
    """The time cap cut the probe short (fewer steps than asked)."""


def probe_mode(workload: str, size: str, batch_size: int, mode: str, device: str = "auto", *, steps: int = 5,
               time_cap_s: float = 2.0, seed: int = 0) -> ProbeResult:
    """Time `steps` training steps of `mode` after one untimed warm-up step, stopping early at `time_cap_s`.

    If the warm-up alone uses up the cap, its own time is the figure (steps_timed 1, capped): slow enough to
    warn about, and no more waiting. Raises ConfigError for settings a run would refuse.
    """
    config = RunConfig(workload=workload, size=size, batch_size=batch_size, modes=(mode,), device=device, seed=seed)
    check_launch(config)
    work = WORKLOADS[workload]
    data = work.load_data(config)
    torch.manual_seed(seed)
    model = work.build_model(size, data)
    state = build_lane_state(config, 0, mode, model, work, resolve_device(device))
    generator = torch.Generator().manual_seed(seed)

    def step_ms(step: int) -> float:
        # The probe needs each step's time now: on CUDA that waits for the step (the probe is no run).
        return resolve_step(state.meter, train_step(state, data.sample(generator, batch_size), step), wait=True).step_ms

    # The same thread choice a run makes, or the probe would time conditions no run trains under.
    choose_threads(state, data.sample(torch.Generator().manual_seed(seed + 1), batch_size))
    started = time.perf_counter()
    warmup_ms = step_ms(0)  # first-call dispatch, allocator costs
    times = []
    for step in range(1, steps + 1):
        if time.perf_counter() - started >= time_cap_s:
            break
        times.append(step_ms(step))
    if not times:
        return ProbeResult(mode, warmup_ms, 1, True)
    return ProbeResult(mode, statistics.median(times), len(times), len(times) < steps)


def relative_costs(results: list[ProbeResult], baseline: str = BASELINE_MODE) -> pd.DataFrame:
    """mode, ms_per_step, time_vs_baseline (x the baseline's ms/step), far_slower, steps_timed, capped."""
    frame = pd.DataFrame([{"mode": r.mode, "ms_per_step": r.ms_per_step, "steps_timed": r.steps_timed,
                           "capped": r.capped} for r in results],
                         columns=["mode", "ms_per_step", "steps_timed", "capped"])
    base = frame.loc[frame["mode"] == baseline, "ms_per_step"]
    frame["time_vs_baseline"] = frame["ms_per_step"] / base.iloc[0] if not base.empty else float("nan")
    frame["far_slower"] = frame["time_vs_baseline"] >= SLOW_FACTOR
    return frame[["mode", "ms_per_step", "time_vs_baseline", "far_slower", "steps_timed", "capped"]]


ProbeKey = tuple[str, str, int, str, str]
"""(workload, size, batch_size, mode, device): what a probe's figure depends on."""


class ProbeBoard:
    """Probes measured on a worker thread, one at a time, and remembered for the life of the process.

    A page asks with `get` and never waits: the first ask queues the probe and answers None (pending); later asks
    answer the ProbeResult, or the error text if the probe raised. The worker ends when the queue is empty.
    """

    def __init__(self, steps: int = 5, time_cap_s: float = 2.0):
        self.steps = steps
        self.time_cap_s = time_cap_s
        self._results: dict[ProbeKey, ProbeResult | str] = {}
        self._queue: list[ProbeKey] = []
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def get(self, key: ProbeKey) -> ProbeResult | str | None:
        with self._lock:
            if key in self._results:
                return self._results[key]
            if key not in self._queue:
                self._queue.append(key)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="amp-probe", daemon=True)
                self._worker.start()
        return None

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is done (for scripts and tests); False if `timeout_s` ran out first."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout_s)
        return not (worker is not None and worker.is_alive())

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._worker = None
                    return
                key = self._queue[0]
            workload, size, batch_size, mode, device = key
            try:
                outcome: ProbeResult | str = probe_mode(workload, size, batch_size, mode, device, steps=self.steps,
                                                        time_cap_s=self.time_cap_s)
            except Exception as exc:  # an unrunnable probe is shown as text; it must not kill the worker
                outcome = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._results[key] = outcome
                self._queue.remove(key)


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
