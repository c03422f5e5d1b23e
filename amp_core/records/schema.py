"""Records: the contract between the runner (or a Monitor), the store and the pages. Units are in the names."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass(slots=True)
class StepRecord:
    """One lane, one optimizer step. Units are in the names."""

    run_id: str
    lane: int
    mode: str
    step: int
    t_wall_s: float
    """Unix time when the host finished the step (on CUDA: finished queuing it; the device may end later)."""
    loss: float
    step_ms: float
    """Time of the step's training work: perf_counter on a CPU; on CUDA the device time between two events on the
    lane's stream (no host sync). Sampled probes run outside it (probe_ms)."""
    samples_per_s: float
    lr: float
    """LR the optimizer used on this step (after any LR fault)."""
    scale: float | None
    """GradScaler scale used for this step's backward (None: the mode has no scaler)."""
    skipped: bool
    """The optimizer step was skipped because gradients held inf/NaN."""
    grad_norm: float
    """L2 norm of the unscaled gradients, computed in fp32 (inf/NaN if they were not finite). NaN also on steps where
    it was not measured (RunConfig.grad_norm_every): a measured non-finite norm comes with a skipped_step or
    nonfinite_grads event, and in modes where gradients overflow it is measured on every step."""
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    activations_bytes: int
    """Bytes saved for backward (saved_tensors_hooks on a forward of its own); measured every `memory_every` steps,
    carried between."""
    peak_above_start_bytes: int | None
    """CUDA: the allocator peak during this lane's own step above the allocation at its start (activations,
    gradients being formed, optimizer temporaries); measured every `memory_every` steps from step 1, carried between.
    None without CUDA (and before the first measurement)."""
    lane_peak_bytes: int | None
    """The lane's own memory peak, unchanged by other lanes. CUDA: what the lane held at its step's start (params,
    grads, optimizer state) + peak_above_start_bytes. CPU: params + grads + optimizer state + activations (storage
    sizes: a CPU has no allocator statistics). None on CUDA before the first measurement."""
    probe_ms: float
    """Host time this step spent in sampled probes (memory, gradient statistics, forensics), outside step_ms."""


STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StepRecord))


@dataclass(slots=True)
class Event:
    """A notable thing: skipped step, scale change, fault fired, non-finite loss, error, run status."""

    run_id: str
    kind: str
    message: str
    lane: int | None = None
    step: int | None = None
    t_wall_s: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)


class RecordBuffer:
    """StepRecords held column by column, so a page builds a DataFrame of 80k rows in milliseconds."""

    def __init__(self) -> None:
        self._columns: dict[str, list] = {name: [] for name in STEP_FIELDS}
        self._count = 0

    def append(self, record: StepRecord) -> None:
        for name in STEP_FIELDS:
            self._columns[name].append(getattr(record, name))
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def frame(self, since: int = 0, until: int | None = None) -> pd.DataFrame:
        """Rows [since, until) as a DataFrame (safe while the runner appends: it reads a fixed count)."""
        until = self._count if until is None else until
        return pd.DataFrame({name: col[since:until] for name, col in self._columns.items()}, columns=list(STEP_FIELDS))

    def rows(self, since: int, until: int) -> list[tuple]:
        """Rows [since, until) as tuples in STEP_FIELDS order (for the store)."""
        return list(zip(*(self._columns[name][since:until] for name in STEP_FIELDS), strict=True))


def empty_steps_frame() -> pd.DataFrame:
    return pd.DataFrame({name: [] for name in STEP_FIELDS})


