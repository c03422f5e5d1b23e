"""Records: the contract between the runner (or a Monitor), the store and the pages. Units are in the names.

StepRecord is also the one declaration of the columnar layout: every field that does not name the track (run_id,
lane, mode, rank) becomes a numpy column whose dtype comes from the field's annotation (int -> int64, float ->
float64, bool -> bool, `float | None` and `int | None` -> float64 with NaN for None) unless the field says
`column("float32")`. Adding a figure is one line here; the memory layout, the store, the summary and export follow.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pandas as pd


def column(dtype: str, **kwargs) -> Any:
    """A StepRecord field held as a numpy column of `dtype` (instead of the dtype its annotation implies)."""
    return field(metadata={"dtype": np.dtype(dtype)}, **kwargs)


@dataclass(slots=True)
class StepRecord:
    """One lane, one optimizer step. Units are in the names."""

    run_id: str
    lane: int
    mode: str
    step: int
    t_wall_s: float
    """Unix time when the host finished the step (on CUDA: finished queuing it; the device may end later)."""
    loss: float = column("float32")
    """The training loss (a float32 or narrower tensor's value: float32 holds it exactly)."""
    step_ms: float = column("float32")
    """Time of the step's training work: perf_counter on a CPU; on CUDA the device's time between two events on the
    lane's stream (no host sync; for a model too small to keep the GPU busy, the device's compute, not the host's
    launch time: see telemetry.meters.CudaMeter). Sampled probes run outside it (probe_ms)."""
    samples_per_s: float = column("float32")
    lr: float
    """LR the optimizer used on this step (after any LR fault)."""
    scale: float | None = column("float32")
    """GradScaler scale used for this step's backward (None: the mode has no scaler); a power of two times the
    initial scale, exact in float32."""
    skipped: bool
    """The optimizer step was skipped because gradients held inf/NaN."""
    grad_norm: float = column("float32")
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
    probe_ms: float = column("float32")
    """Host time this step spent in sampled probes (memory, gradient statistics, forensics), outside step_ms."""
    rank: int = 0
    """The torchrun rank that measured this record (0 outside torchrun)."""


STEP_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StepRecord))
TRACK_FIELDS: tuple[str, ...] = ("run_id", "lane", "mode", "rank")
"""Fields that name a track (one lane's records from one rank): held once per track, not once per record."""

_ANNOTATION_DTYPES = {"int": "int64", "float": "float64", "bool": "bool", "float | None": "float64",
                      "int | None": "float64"}


def _column_dtypes() -> dict[str, np.dtype]:
    dtypes = {}
    for f in dataclasses.fields(StepRecord):
        if f.name in TRACK_FIELDS:
            continue
        if "dtype" in f.metadata:
            dtypes[f.name] = f.metadata["dtype"]
        elif f.type in _ANNOTATION_DTYPES:
            dtypes[f.name] = np.dtype(_ANNOTATION_DTYPES[f.type])
        else:
            raise TypeError(f"StepRecord.{f.name}: annotate it {' or '.join(_ANNOTATION_DTYPES)}, "
                            f"or give it column(dtype); got {f.type!r}")
    return dtypes


STEP_COLUMNS: dict[str, np.dtype] = _column_dtypes()
"""Per-record numeric columns (name -> numpy dtype), in StepRecord order; `step` is the key of a track."""
OPTIONAL_COLUMNS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(StepRecord)
                                             if str(f.type).endswith("| None"))
"""Columns where NaN means "not measured" (None), never a non-finite value training produced."""
HELD_PARTS: tuple[str, ...] = ("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes")
"""The parts of the bytes a lane holds at a step; their sum is the summarized figure `held_bytes`."""
SAMPLED_COLUMNS: tuple[str, ...] = ("grad_norm",)
"""Figures measured on sampled steps only, NaN on the others ("not measured"): only an infinite value marks a record.
(A NaN grad_norm on each unsampled step once marked 96 % of a 32-true lane's records, which were then kept apart.)"""
MARK_COLUMNS: tuple[str, ...] = tuple(name for name, dtype in STEP_COLUMNS.items() if dtype.kind == "f"
                                      and name not in OPTIONAL_COLUMNS and name not in SAMPLED_COLUMNS)
"""A non-finite value in one of these marks its record (as a skipped step does): marks are kept exactly."""


def typed(values, dtype: np.dtype) -> np.ndarray:
    """Float64 values (NaN where missing) as a column of `dtype`: a missing int or flag becomes 0."""
    values = np.asarray(values, dtype=np.float64)
    if dtype.kind != "f" and np.isnan(values).any():
        values = np.nan_to_num(values, nan=0.0)
    return values.astype(dtype)


PRECISION_NOT_APPLIED = "precision_not_applied"
"""Event kind: a trainer was asked for one precision and the model's ops ran in another (an integration saw it)."""
FP16_WITHOUT_SCALING = "fp16_without_loss_scaling"
"""Event kind: fp16 ran with no GradScaler, so gradients that underflow fp16 are not protected."""
WHAT_RAN_EVENTS: tuple[str, ...] = (PRECISION_NOT_APPLIED, FP16_WITHOUT_SCALING)
"""Event kinds about what really ran, which the Train page and the report show as warnings."""


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


@dataclass(slots=True)
class GradStats:
    """One parameter's gradient on one step (after unscale_)."""

    param: str
    numel: int
    zeros: int
    """Elements exactly 0."""
    inf: int
    nan: int
    hist: list[int]
    """Counts of finite non-zero |g| by floor(log2|g|), bins gradstats.HIST_LO..HIST_HI (clamped at both ends)."""
    scale: float
    """The scale the 'scaled' fractions multiply by (1 for unscaled modes)."""
    fractions: dict[str, float] = field(default_factory=dict)
    """Of the finite non-zero elements: '{fmt}.{zero|subnormal|overflow}.{unscaled|scaled}' -> fraction."""
    lost_update_fraction: float | None = None
    """Of the elements with a finite non-zero gradient: share whose parameter did not change this step."""

    @property
    def total(self) -> int:
        return sum(self.hist) + self.zeros + self.inf + self.nan

    def to_dict(self) -> dict:
        """Its fields by name, shallow (the histogram and fractions are the object's own: JSON copies them anyway).
        `asdict` walked each histogram bin as an object to copy: ~60 calls per parameter on every sampled step."""
        return {name: getattr(self, name) for name in GRAD_STATS_FIELDS}


GRAD_STATS_FIELDS = tuple(f.name for f in fields(GradStats))


def steps_frame(parts: list[tuple[str, int, str, int, dict[str, np.ndarray]]]) -> pd.DataFrame:
    """A DataFrame in STEP_FIELDS order from (run_id, lane, mode, rank, columns) parts, one per track."""
    if not parts:
        return empty_steps_frame()
    columns: dict[str, Any] = {}
    for name in STEP_FIELDS:
        if name in TRACK_FIELDS:
            index = TRACK_FIELDS.index(name)
            values = [np.full(len(cols["step"]), part[index], dtype=object if name in ("run_id", "mode") else
                              np.int64) for *part, cols in parts]
        else:
            values = [cols[name] for *_, cols in parts]
        columns[name] = values[0] if len(values) == 1 else np.concatenate(values)
    frame = pd.DataFrame(columns, columns=list(STEP_FIELDS))
    for name in ("run_id", "mode"):
        frame[name] = frame[name].astype(str)
    return frame


def empty_steps_frame() -> pd.DataFrame:
    """No records, every column with its dtype."""
    columns = {name: np.array([], dtype=STEP_COLUMNS.get(name, np.int64)) for name in STEP_FIELDS}
    columns["run_id"] = columns["mode"] = np.array([], dtype=object)
    frame = pd.DataFrame(columns, columns=list(STEP_FIELDS))
    for name in ("run_id", "mode"):
        frame[name] = frame[name].astype(str)
    return frame
