"""The largest batch each recipe allows: on CUDA found by real steps (a bounded search; an out-of-memory is caught and
the allocator emptied), with the throughput at that batch; on a CPU modelled from the bytes a step really holds at
two batch sizes (fixed bytes + bytes per sample) against a memory budget, and labelled "modelled"."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from amp_core import background
from amp_core.config import ConfigError, RunConfig
from amp_core.probes.memory import held_bytes
from amp_core.workloads import WORKLOADS, check_launch

PROBE_BATCHES = (4, 16)
"""The two batch sizes a CPU model is measured at (activations grow linearly in the batch between them)."""
MAX_SEARCH_BATCH = 1 << 16
"""The CUDA search never tries a batch above this."""
THROUGHPUT_STEPS = 5
"""Steps timed at the found batch on CUDA (after one warm-up step)."""


@dataclass(frozen=True, slots=True)
class MaxBatch:
    """The largest batch one recipe allows under a budget, and the figures it came from."""

    recipe: str
    batch: int
    """The largest batch (0: not even one sample fits)."""
    modelled: bool
    """True on a CPU: fixed + batch x per-sample bytes against the budget, not tried."""
    fixed_bytes: int
    """Parameters, gradients and optimizer state after a step (measured), plus the activations' intercept."""
    per_sample_bytes: float
    """Bytes saved for backward per sample (measured at two batch sizes)."""
    budget_bytes: int
    samples_per_s: float | None = None
    """CUDA only: throughput measured at `batch`."""

    def line(self) -> str:
        budget = f"budget {self.budget_bytes / 2**20:,.0f} MiB"
        if not self.modelled:
            rate = "" if self.samples_per_s is None else f", {self.samples_per_s:,.0f} samples/s at that batch"
            return f"{self.recipe}: max batch {self.batch:,} (measured by real steps, {budget}{rate})"
        return (f"{self.recipe}: max batch {self.batch:,} (modelled: fixed {self.fixed_bytes / 2**20:.2f} MiB + "
                f"{self.per_sample_bytes / 2**10:.1f} KiB/sample, {budget})")


def available_bytes(device: str) -> int:
    """The default budget: free GPU memory on CUDA, else the machine's available memory."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil

    return psutil.virtual_memory().available


def _lane(config: RunConfig, recipe: str, batch: int):
    from amp_core.race.step import build_lane_state

    workload = WORKLOADS[config.workload]
    model, _ = workload.seeded_model_and_batch(config)
    data = workload.load_data(config)
    state = build_lane_state(config, 0, recipe, model, workload, config.device)
    return state, data.sample(torch.Generator().manual_seed(config.seed), batch)


def _step_bytes(config: RunConfig, recipe: str, batch: int) -> tuple[int, int]:
    """(held after a step, bytes saved for backward) of one real step of `recipe` at `batch`."""
    from amp_core.race.step import train_step

    state, sample = _lane(config, recipe, batch)
    result = train_step(state, sample, 0, measure_memory=True)
    return sum(held_bytes(state.params, state.optimizer)), result.activations_bytes


def modelled_max_batch(config: RunConfig, recipe: str, budget: int) -> MaxBatch:
    """CPU: fixed and per-sample bytes measured at PROBE_BATCHES, the largest batch that fits `budget`."""
    small, large = PROBE_BATCHES
    held, act_small = _step_bytes(config, recipe, small)
    _, act_large = _step_bytes(config, recipe, large)
    per_sample = max((act_large - act_small) / (large - small), 1.0)
    fixed = held + max(int(act_small - per_sample * small), 0)
    batch = max(int((budget - fixed) // per_sample), 0)
    return MaxBatch(recipe, batch, True, fixed, per_sample, budget)


def searched_max_batch(config: RunConfig, recipe: str, budget: int) -> MaxBatch:
    """CUDA: real steps at growing batches (doubling, then bisection), an out-of-memory caught and the allocator
    emptied; the budget caps the allocator's peak. Throughput timed at the batch found."""
    from amp_core.race.step import train_step

    def fits(batch: int) -> bool:
        try:
            torch.cuda.reset_peak_memory_stats()
            state, sample = _lane(config, recipe, batch)
            train_step(state, sample, 0)
            torch.cuda.synchronize()  # the step's kernels must have run for its peak to be known
            return torch.cuda.max_memory_allocated() <= budget
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()

    low, high = 0, 1
    while high <= MAX_SEARCH_BATCH and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    rate = None
    if low:
        state, sample = _lane(config, recipe, low)
        train_step(state, sample, 0)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for step in range(1, THROUGHPUT_STEPS + 1):
            train_step(state, sample, step)
        torch.cuda.synchronize()  # the figure: the steps' wall time
        rate = low * THROUGHPUT_STEPS / (time.perf_counter() - started)
        torch.cuda.empty_cache()
    return MaxBatch(recipe, low, False, 0, float("nan"), budget, rate)


def max_batches(workload: str, recipes: tuple[str, ...], *, size: str = "small", device: str = "auto",
                budget_mib: float | None = None, optimizer: str = "adam") -> list[MaxBatch]:
    """The largest batch of each recipe (ConfigError for a bad workload, size, recipe or budget)."""
    return _search(*_checked(workload, recipes, size, device, budget_mib, optimizer))


def _checked(workload: str, recipes: tuple[str, ...], size: str, device: str, budget_mib: float | None,
             optimizer: str) -> tuple[RunConfig, int]:
    """(the search's config on a resolved device, the budget in bytes); ConfigError for bad input."""
    config = RunConfig(workload=workload, modes=recipes, size=size, device=device, optimizer=optimizer,
                       batch_size=PROBE_BATCHES[0], gradstats_every=0)
    check_launch(config)
    from amp_core.precision import resolve_device

    device = resolve_device(device)
    config = RunConfig.from_dict({**config.to_dict(), "device": device})
    if budget_mib is not None and not budget_mib > 0:
        raise ConfigError("budget_mib", f"must be > 0, got {budget_mib!r}")
    return config, int(budget_mib * 2**20) if budget_mib is not None else available_bytes(device)


def _search(config: RunConfig, budget: int) -> list[MaxBatch]:
    find = searched_max_batch if torch.device(config.device).type == "cuda" else modelled_max_batch
    return [find(copy.copy(config), recipe, budget) for recipe in config.modes]


class MaxBatchJob:
    """`max_batches` off the caller's thread (a page's button): the input is checked at once (ConfigError), the
    search runs on a background thread; `done` says when `found` (or `error`, one line) is there."""

    def __init__(self, workload: str, recipes: tuple[str, ...], *, size: str = "small", device: str = "auto",
                 budget_mib: float | None = None, optimizer: str = "adam"):
        self.config, self.budget = _checked(workload, recipes, size, device, budget_mib, optimizer)
        self.found: list[MaxBatch] | None = None
        self.error = ""
        self._thread = background.start(self._work, "amp-maxbatch")

    def _work(self) -> None:
        try:
            self.found = _search(self.config, self.budget)
        except Exception as error:  # e.g. a recipe that failed in its step: the page shows a line, not a trace
            self.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the search is done (scripts and tests); False if `timeout_s` ran out first."""
        self._thread.join(timeout_s)
        return self.done

    def rows(self) -> list[dict]:
        """One row per recipe: the batch, what it came from, the budget, and modelled or the measured throughput."""
        return [{"recipe": m.recipe, "max batch": m.batch,
                 "bytes / sample": m.per_sample_bytes if m.modelled else None,
                 "fixed MiB": m.fixed_bytes / 2**20 if m.modelled else None, "budget MiB": m.budget_bytes / 2**20,
                 "found by": "modelled" if m.modelled else "real steps",
                 "samples / s": m.samples_per_s} for m in self.found or ()]
