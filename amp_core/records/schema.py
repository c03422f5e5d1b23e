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
    """Unix time when the step ended."""
    loss: float
    step_ms: float
    """Wall time of the step, device-synchronised on CUDA."""
    samples_per_s: float
    lr: float
    """LR the optimizer used on this step (after any LR fault)."""
    scale: float | None
    """GradScaler scale used for this step's backward (None: the mode has no scaler)."""
    skipped: bool
    """The optimizer step was skipped because gradients held inf/NaN."""
    grad_norm: float
    """L2 norm of the unscaled gradients (inf/NaN if they were not finite)."""
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    activations_bytes: int
    """Bytes saved for backward (saved_tensors_hooks); measured every `memory_every` steps, carried between."""
    cuda_peak_bytes: int | None
    """CUDA allocator peak during the step; None without CUDA."""


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


