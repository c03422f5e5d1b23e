"""Layer numerics: where in a model precision breaks — per-module ranges against fp16 and bf16, the first module to
produce inf/NaN, and each module's error against an fp32 run of the same weights and batch.

A probe runs a throwaway copy of the model through one forward + backward (no optimizer step) on one batch twice:
as an fp32 reference (32-true), then in the chosen mode, with the same weights, batch and random state. Hooks sit on
the copy's modules and on the tensors those produce, so a training thread running the original at the same time
sees none of them. Format shares come from really casting the values to fp16 and bf16 (as gradstats does), not
from thresholds, and every figure comes back as plain data.

`LayerAmaxSampler` is the light version a run takes every N steps (RunConfig.amax_every): the abs max of each
module's output and output gradient, on a shadow copy of the lane, outside the timed step.
"""

from __future__ import annotations

import copy
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from amp_core.config import ConfigError, RunConfig
from amp_core.precision import BASELINE_MODE, Precision, availability, compile_option, get_precision
from amp_core.torch_private import foreach_copy_
from amp_core.workloads import WORKLOADS, Workload, check_launch

ROOT = "(root)"
"""Module path of the model itself."""
LOSS = "(loss)"
"""Module path of the loss function (wrapped as a module so its output and gradient are seen like a layer's)."""
FORWARD, BACKWARD = "forward", "backward"
FP16_MAX = torch.finfo(torch.float16).max
"""65504: the largest finite fp16 value; a cast of anything from 65520 up gives inf."""
FP16_TINY = torch.finfo(torch.float16).tiny
"""2^-14: the smallest normal fp16 value; below it fp16 is subnormal (fewer significant bits), then 0 below 2^-25."""
DEFAULT_NUMERICS_BATCH = RunConfig.__dataclass_fields__["batch_size"].default
"""Batch of a workload probe: a run's default batch, so the ranges are the ones its training steps see."""

_CONTAINERS = (tuple, list)
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Closure = Callable[[nn.Module, Any], torch.Tensor]
"""A user's loss as a function of the model and the batch (attach mode: the replay of a Monitor's step)."""


@dataclass(frozen=True, slots=True)
class TensorRange:
    """Magnitudes of one tensor (or of all the floating tensors a module takes or returns), and what fp16 and bf16 do
    to them. Shares are of the finite non-zero elements, each multiplied by `cast_factor` and really cast."""

    dtype: str
    """Dtype(s) the values were held in ("fp16", "fp32", "fp16, fp32")."""
    numel: int
    inf: int
    nan: int
    zeros: int
    """Elements exactly 0."""
    abs_max: float
    """Largest finite |x| (0.0 when every finite element is 0)."""
    min_nonzero: float
    """Smallest finite non-zero |x| (NaN when there is none)."""
    fp16_overflow: float | None
    """Share a cast to fp16 turns into inf (the four shares are None where the values were not cast: a probe casts
    the fp32 reference's values, what the formats do to the true values)."""
    fp16_subnormal: float | None
    """Share that lands in fp16's subnormal range (non-zero, below 2^-14: precision is lost bit by bit)."""
    fp16_zero: float | None
    """Share a cast to fp16 flushes to 0."""
    bf16_zero: float | None
    """Share a cast to bf16 flushes to 0."""
    cast_factor: float = 1.0
    """What the values were multiplied by before the casts (the loss scale, for gradients under a GradScaler)."""

    @property
    def nonfinite(self) -> int:
        return self.inf + self.nan

    @property
    def dynamic_range_log2(self) -> float:
        """log2(abs_max / min_nonzero): how many binades the values span (NaN without a non-zero finite value)."""
        if not self.min_nonzero > 0:
            return math.nan
        return math.log2(self.abs_max / self.min_nonzero)

    def describe(self) -> str:
        """One line: '|x| in [1.2e-05, 3.4e+02] (24.7 binades), 2 inf, 0 NaN, 4096 values in fp16'."""
        spread = (f"|x| in [{self.min_nonzero:.3g}, {self.abs_max:.3g}] ({self.dynamic_range_log2:.1f} binades)"
                  if self.min_nonzero > 0 else "no finite non-zero value")
        return f"{spread}, {self.inf} inf, {self.nan} NaN, {self.numel} values in {self.dtype}"


@dataclass(slots=True)
class ModuleNumerics:
    """One call of one module, in the mode and in the fp32 reference."""

    module: str
    """Dotted module path, (root) for the model, (loss) for the loss function."""
    call: int
    """0 for the module's first call in the step, 1 for its second, ..."""
    order: int
    """Position among forward calls, in the order they finished (a child before its parent)."""
    output: TensorRange | None
    input: TensorRange | None
    grad: TensorRange | None
    """Gradient w.r.t. the output, as the backward held it (scaled by the loss scale under a GradScaler)."""
    grad_order: int | None
    """Position in the backward, in the order the output gradients arrived."""
    reference_output: TensorRange | None
    reference_input: TensorRange | None
    reference_grad: TensorRange | None
    """The fp32 reference's gradient, unscaled; its format shares are those of the values times the mode's scale."""
    output_error: float | None
    """‖y_mode − y_fp32‖ / ‖y_fp32‖ of the output (None when the two runs did not produce the same output shapes)."""

    @property
    def label(self) -> str:
        return _label(self.module, self.call)


def _label(module: str, call: int) -> str:
    return module if call == 0 else f"{module} (call {call + 1})"


@dataclass(frozen=True, slots=True)
class ParamError:
    """One parameter's gradient in the mode against the fp32 reference."""

    param: str
    error: float
    """‖g_mode / scale − g_fp32‖ / ‖g_fp32‖."""
    reference_norm: float
    """‖g_fp32‖."""
    dtype: str
    """The gradient's dtype in the mode."""


@dataclass(frozen=True, slots=True)
class FirstNonFinite:
    """The first module, in execution order, whose forward output or output gradient held inf or NaN."""

    module: str
    call: int
    phase: str
    """forward | backward."""
    inf: int
    nan: int
    inputs: TensorRange | None
    """The ranges of the module's forward inputs in the mode."""
    why: str
    """One line for people."""

    def line(self) -> str:
        return f"first non-finite: {self.module} ({self.phase})"


@dataclass(slots=True)
class NumericsReport:
    """One numerics probe. Plain data: picklable, cacheable."""

    label: str
    """What was probed ("digits_mlp · 16-mixed", "run 3 · lane 1 · 16-mixed · step 120")."""
    mode: str
    reference_mode: str
    device: str
    scale: float | None
    """The loss scale of the mode's backward (None: the mode has no GradScaler)."""
    modules: list[ModuleNumerics]
    """Every module call, in forward order."""
    params: list[ParamError]
    first_nonfinite: FirstNonFinite | None
    loss: float
    reference_loss: float

    def first_line(self) -> str:
        """`first non-finite: <module path> (forward|backward)` or `first non-finite: none`."""
        return self.first_nonfinite.line() if self.first_nonfinite else "first non-finite: none"

    def module_frame(self) -> pd.DataFrame:
        """One row per module call in forward order. `out_*`/`in_*`/`grad_*` magnitudes are the mode's tensors;
        the fp16/bf16 shares are what those formats do to the fp32 reference's values (gradients times the scale)."""
        rows = []
        for m in self.modules:
            row: dict[str, Any] = {"module": m.label, "path": m.module, "order": m.order,
                                   "dtype": m.output.dtype if m.output else ""}
            for prefix, actual, reference in (("out", m.output, m.reference_output), ("in", m.input, m.reference_input),
                                              ("grad", m.grad, m.reference_grad)):
                row.update({
                    f"{prefix}_abs_max": actual.abs_max if actual else math.nan,
                    f"{prefix}_min_nonzero": actual.min_nonzero if actual else math.nan,
                    f"{prefix}_range_log2": actual.dynamic_range_log2 if actual else math.nan,
                    f"{prefix}_inf": actual.inf if actual else 0,
                    f"{prefix}_nan": actual.nan if actual else 0,
                    f"{prefix}_ref_abs_max": reference.abs_max if reference else math.nan,
                    **{f"{prefix}_{share}": getattr(reference, share) if reference else math.nan
                       for share in SHARES},
                })
            row["output_error"] = m.output_error if m.output_error is not None else math.nan
            rows.append(row)
        return pd.DataFrame(rows, columns=MODULE_COLUMNS)

    def error_frame(self) -> pd.DataFrame:
        """Module outputs ranked by relative error against fp32, worst first (inf/NaN errors on top)."""
        frame = self.module_frame()[["module", "dtype", "output_error", "out_abs_max", "out_ref_abs_max"]]
        frame = frame.dropna(subset=["out_ref_abs_max"])  # modules without a floating output have no error
        return _ranked(frame, "output_error")

    def param_frame(self) -> pd.DataFrame:
        """Parameter gradients ranked by relative error against fp32, worst first."""
        frame = pd.DataFrame([{"param": p.param, "dtype": p.dtype, "grad_error": p.error,
                               "ref_grad_norm": p.reference_norm} for p in self.params],
                             columns=["param", "dtype", "grad_error", "ref_grad_norm"])
        return _ranked(frame, "grad_error")


SHARES = ("fp16_overflow", "fp16_subnormal", "fp16_zero", "bf16_zero")
MODULE_COLUMNS = ["module", "path", "order", "dtype",
                  *(f"{prefix}_{name}" for prefix in ("out", "in", "grad")
                    for name in ("abs_max", "min_nonzero", "range_log2", "inf", "nan", "ref_abs_max", *SHARES)),
                  "output_error"]


def _ranked(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """Worst first: NaN (the run broke), then inf, then the largest finite value."""
    key = pd.DataFrame({"nan": frame[column].isna(), "value": frame[column].fillna(math.inf)})
    order = key.sort_values(["nan", "value"], ascending=False, kind="stable").index
    return frame.loc[order].reset_index(drop=True)


# --- measuring many tensors at once ------------------------------------------------------------------------------
#
# The classes are read from bits with integer ops: a non-negative float's bits order like the float, and the
# exponent field says zero-or-subnormal / normal / inf-or-NaN. On a CPU that is several times faster than boolean
# comparisons, whose kernels are not vectorised. The casts themselves are real: `.to(torch.float16)` rounds as the
# format does, and its result's bits are what is classified.

_F32_INF = 0x7F800000
"""Bits of fp32 +inf; above it, NaN."""
_LARGEST_INT32 = 0x7FFFFFFF
_COUNTED = ("zeros", "nonzero", "inf", "nan", "fp16_inf", "fp16_subnormal", "fp16_zero", "bf16_zero")


def _chunk_elements(device: torch.device) -> int:
    """Elements measured at once: a CPU's cache holds a chunk's dozen working arrays; a GPU wants large launches."""
    return 1 << 24 if device.type == "cuda" else 1 << 16


def _figures(tensors: Sequence[torch.Tensor], cast_factor: float, casts: bool = True) -> list[dict[str, float]]:
    """Per tensor: numel, zeros, inf, nan, nonzero (finite), abs_max (finite), min_nonzero (finite) and, with
    `casts`, of the finite non-zero values times `cast_factor`, how many a real cast makes fp16 inf / fp16
    subnormal / fp16 0 / bf16 0 (else those are None).

    Values are measured in fp32 (exact for fp32, fp16 and bf16 tensors) and multiplied by the factor in fp32, as
    a GradScaler's scaled loss is. Tensors are cut into pieces measured a chunk at a time.
    """
    pieces, owners = [], []
    for index, tensor in enumerate(tensors):
        for piece in tensor.reshape(-1).split(_chunk_elements(tensor.device)) if tensor.numel() else ():
            pieces.append(piece)
            owners.append(index)
    out = [{"numel": 0, **dict.fromkeys(_COUNTED, 0 if casts else None), **dict.fromkeys(_COUNTED[:4], 0),
            "abs_max": 0.0, "min_nonzero": math.nan} for _ in tensors]
    measured = (f for chunk in _chunks(pieces) for f in _chunk_figures(chunk, cast_factor, casts))
    for owner, figures in zip(owners, measured, strict=True):
        total = out[owner]
        for name in ("numel", *_COUNTED):
            if figures.get(name) is not None:
                total[name] += figures[name]
        total["abs_max"] = max(total["abs_max"], figures["abs_max"])
        total["min_nonzero"] = min((v for v in (total["min_nonzero"], figures["min_nonzero"]) if not math.isnan(v)),
                                   default=math.nan)
    return out


def _chunk_figures(chunk: list[torch.Tensor], cast_factor: float, casts: bool) -> list[dict[str, float]]:
    sizes = [t.numel() for t in chunk]
    magnitude = torch.cat([t.float() for t in chunk]).abs_()
    bits = magnitude.view(torch.int32)
    # First as if every value were finite ("finite non-zero" is then "non-zero"); the largest bits say whether that
    # held (inf and NaN have the largest bits), all read in one host transfer per chunk (off the training path).
    highs = torch.stack([part.amax() for part in bits.split(sizes)])
    smallest = (bits - 1).bitwise_and_(_LARGEST_INT32)  # 0 -> the largest int, never a non-zero's minimum
    figures = _piece_figures(magnitude, bits.clamp(max=1), smallest, sizes, cast_factor, casts)
    rows = torch.cat([highs[:, None].long(), figures], dim=1).tolist()
    counts: list[list[int] | None] = [None] * len(sizes)
    if any(row[0] >= _F32_INF for row in rows):  # inf or NaN somewhere: classify every value
        nonfinite = ((bits >> 23) + 1) >> 8  # 1 where the exponent field is all ones (inf, NaN)
        what = bits.clamp(max=1) + nonfinite + (bits - _F32_INF).clamp_(0, 1)  # 0 zero, 1 finite, 2 inf, 3 NaN
        finite_nonzero = (1 - (what - 1).abs_()).clamp_(min=0)
        highs = torch.stack([part.amax() for part in (bits * (1 - nonfinite)).split(sizes)])
        smallest = torch.maximum(bits, (1 - finite_nonzero) * _LARGEST_INT32) - 1  # excluded -> never the minimum
        figures = _piece_figures(magnitude, finite_nonzero, smallest, sizes, cast_factor, casts)
        counts_tensor = torch.stack([torch.bincount(part, minlength=4) for part in what.split(sizes)])
        rows = torch.cat([highs[:, None].long(), figures], dim=1).tolist()
        counts = counts_tensor.tolist()
    out = []
    for size, (high, low, nonzero, *cast), count in zip(sizes, rows, counts, strict=True):
        zeros, inf, nan = (count[0], count[2], count[3]) if count is not None else (size - nonzero, 0, 0)
        out.append({"numel": size, "zeros": zeros, "nonzero": nonzero, "inf": inf, "nan": nan,
                    "abs_max": _float_from_bits(high),
                    "min_nonzero": _float_from_bits(low) if 0 < low < _F32_INF else math.nan,
                    **dict(zip(("fp16_inf", "fp16_subnormal", "fp16_zero", "bf16_zero"),
                               cast if casts else [None] * 4, strict=True))})
    return out


def _piece_figures(magnitude: torch.Tensor, finite_nonzero: torch.Tensor, smallest: torch.Tensor, sizes: list[int],
                   cast_factor: float, casts: bool) -> torch.Tensor:
    """Per piece (int64 rows): smallest finite non-zero's bits, finite non-zero count, and with `casts` the counts of
    those a cast makes fp16 inf, fp16 subnormal, fp16 0, bf16 0. `smallest` holds bits - 1 where a value counts and
    a larger number where not."""
    lows = torch.stack([part.amin() for part in smallest.split(sizes)]).long() + 1
    if not casts:
        return torch.stack([lows, torch.stack([part.sum() for part in finite_nonzero.split(sizes)])], dim=1)
    source = magnitude if cast_factor == 1.0 else magnitude * cast_factor
    # The sign bit is masked off: a cast of NaN may give a negative NaN.
    half = source.to(torch.float16).view(torch.int16).bitwise_and_(0x7FFF)
    code = ((half >> 10) << 2).bitwise_or_(half.clamp(max=1) << 1)
    code.bitwise_or_(source.to(torch.bfloat16).view(torch.int16).bitwise_and_(0x7FFF).clamp_(max=1))
    code.bitwise_or_(finite_nonzero.to(torch.int16) << 7)
    # Codes 128..255 are the finite non-zero values': [fp16 exponent field, fp16 non-zero, bf16 non-zero].
    real = torch.stack([torch.bincount(part, minlength=256) for part in code.split(sizes)])[:, 128:].view(-1, 32, 2, 2)
    return torch.stack([lows, real.sum((1, 2, 3)), real[:, 31].sum((1, 2)), real[:, 0, 1].sum(1),
                        real[:, :, 0].sum((1, 2)), real[:, :, :, 0].sum((1, 2))], dim=1)


def _float_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _chunks(pieces: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for piece in pieces:
        if chunk and (size + piece.numel() > _chunk_elements(piece.device) or piece.device != chunk[0].device):
            yield chunk
            chunk, size = [], 0
        chunk.append(piece)
        size += piece.numel()
    if chunk:
        yield chunk


def _combine(figures: Sequence[dict[str, float]], dtypes: Sequence[str], cast_factor: float) -> TensorRange | None:
    """One TensorRange over several tensors' figures (a module with two outputs is measured as one)."""
    if not figures:
        return None
    total = figures[0] if len(figures) == 1 else {
        name: sum(f[name] for f in figures) if figures[0][name] is not None else None for name in ("numel", *_COUNTED)}
    nonzero = total["nonzero"]

    def share(name: str) -> float | None:
        return None if total[name] is None else total[name] / nonzero if nonzero else 0.0

    lows = [f["min_nonzero"] for f in figures if not math.isnan(f["min_nonzero"])]
    return TensorRange(
        dtype=", ".join(dict.fromkeys(dtypes)), numel=total["numel"], inf=total["inf"], nan=total["nan"],
        zeros=total["zeros"], abs_max=max(f["abs_max"] for f in figures), min_nonzero=min(lows, default=math.nan),
        fp16_overflow=share("fp16_inf"), fp16_subnormal=share("fp16_subnormal"), fp16_zero=share("fp16_zero"),
        bf16_zero=share("bf16_zero"), cast_factor=cast_factor)


def _relative_errors(pairs: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]]
                     ) -> list[tuple[float, float] | None]:
    """(‖a − b‖ / ‖b‖, ‖b‖) per pair of tensor lists (a: the mode's, b: fp32's), norms in fp64; None where the
    shapes differ."""
    usable = [i for i, (a, b) in enumerate(pairs)
              if a and len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b, strict=True))]
    errors: list[tuple[float, float] | None] = [None] * len(pairs)
    if not usable:
        return errors
    device = pairs[usable[0]][1][0].device
    norms = torch.stack([
        torch.stack([torch.linalg.vector_norm(torch.sub(x, y.to(x.device)), dtype=torch.float64),
                     torch.linalg.vector_norm(y, dtype=torch.float64).to(x.device)]).to(device)
        for i in usable for x, y in zip(*pairs[i], strict=True)]).tolist()
    at = 0
    for i in usable:
        parts = norms[at:at + len(pairs[i][1])]
        at += len(parts)
        diff = math.sqrt(sum(d * d for d, _ in parts))
        reference = math.sqrt(sum(r * r for _, r in parts))
        errors[i] = (diff / reference if reference > 0 else (0.0 if diff == 0 else math.inf), reference)
    return errors


# --- recording one forward + backward ----------------------------------------------------------------------------

def _float_tensors(value: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The floating-point tensors in a module's arguments or results, in order."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.append(value)
    elif isinstance(value, _CONTAINERS):
        for item in value:
            _float_tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _float_tensors(item, found)
    return found


class _LossModule(nn.Module):
    """The loss function as a module, so its output and gradient are recorded like a layer's."""

    def __init__(self, loss: Loss):
        super().__init__()
        self.loss = loss

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(output, target)


@dataclass(slots=True)
class _Call:
    module: str
    call: int
    inputs: list[int]
    outputs: list[int]
    grads: list[int] = field(default_factory=list)
    grad_order: int | None = None


class _Recorder:
    """Hooks on the modules of one copy (and tensor hooks on what they produce) for one forward + backward.

    Each tensor is kept once, as `keep(tensor)` returns it, keyed by identity and version: a module whose output
    another module later changes in place (ReLU(inplace=True)) keeps the values it really produced.
    """

    def __init__(self, names: dict[nn.Module, str], keep: Callable[[torch.Tensor], Any]):
        self.names = names
        self.keep = keep
        self.calls: list[_Call] = []
        self.kept: list[Any] = []
        self.kept_dtypes: list[str] = []
        self.grad_arrivals = 0
        self._index: dict[tuple[int, int], int] = {}
        self._held: list[torch.Tensor] = []  # the originals stay alive while recording, so ids are not reused
        self._counts: dict[str, int] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> _Recorder:
        for module in self.names:
            self._handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))
        return self

    def __exit__(self, *args: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._held.clear()
        self._index.clear()

    def _store(self, tensor: torch.Tensor) -> int:
        key = (id(tensor), tensor._version)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.kept)
            self.kept.append(self.keep(tensor.detach()))
            self.kept_dtypes.append(_dtype_name(tensor.dtype))
            self._held.append(tensor)
        return index

    def original(self, index: int) -> torch.Tensor:
        """The tensor itself (not what `keep` made of it); only while recording."""
        return self._held[index]

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = self.names[module]
        count = self._counts[name] = self._counts.get(name, -1) + 1
        outputs = _float_tensors(output)
        record = _Call(name, count, [self._store(t) for t in _float_tensors((args, kwargs))],
                       [self._store(t) for t in outputs])
        self.calls.append(record)
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, record=record: self._on_grad(record, grad))

    def _on_grad(self, record: _Call, grad: torch.Tensor) -> None:
        if record.grad_order is None:
            record.grad_order = self.grad_arrivals
            self.grad_arrivals += 1
        record.grads.append(self._store(grad))


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch."))


def _module_names(model: nn.Module, loss_module: nn.Module) -> dict[nn.Module, str]:
    names = {module: name or ROOT for name, module in model.named_modules()}
    names[loss_module] = LOSS
    return names


@dataclass(slots=True)
class _Pass:
    """What one forward + backward of one copy left: the recorder, the loss, and the parameters' gradients."""

    recorder: _Recorder
    loss: float
    grads: dict[str, torch.Tensor]


def prepare_batch(precision: Precision, batch: Any) -> Any:
    """A batch of any shape (a tensor, tuple, list or dict of them, other values as they are) as `precision` trains
    on it: every tensor on the device, floating ones in the parameter dtype."""
    if isinstance(batch, torch.Tensor):
        return precision.prepare_input(batch)
    if isinstance(batch, dict):
        return type(batch)((key, prepare_batch(precision, value)) for key, value in batch.items())
    if isinstance(batch, _CONTAINERS):
        return type(batch)(prepare_batch(precision, value) for value in batch)
    return batch


def _run_pass(model: nn.Module, precision: Precision, loss: Loss | None, batch: Any, scale: float | None,
              rng: list[torch.Tensor], closure: Closure | None = None) -> _Pass:
    """One forward + backward of `model` (a throwaway copy) as the training step runs it, recorded."""
    for parameter in model.parameters():
        parameter.grad = None  # before the cast: Module.to() would cast a gradient in place, under a caller's feet
    model = precision.prepare_module(model)
    if closure is None:
        inputs, target = (precision.prepare_input(t) for t in batch)
        loss_module = _LossModule(loss)
        names = _module_names(model, loss_module)
    else:
        names = {module: name or ROOT for name, module in model.named_modules()}
        batch = prepare_batch(precision, batch)
    recorder = _Recorder(names, lambda t: t.clone())
    # The same random state in both passes (dropout masks match); the process's own RNG is restored after.
    with torch.random.fork_rng(devices=_cuda_devices(precision)), precision.step_context():
        _set_rng_state(precision, rng)
        with recorder:
            with precision.forward_context():
                value = loss_module(model(inputs), target) if closure is None else closure(model, batch)
            (value * scale if scale is not None else value).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return _Pass(recorder, float(value.detach().float()), grads)


def _cuda_devices(precision: Precision) -> list[torch.device]:
    return [torch.device(precision.device)] if precision.device_type == "cuda" else []


def _rng_state(precision: Precision) -> list[torch.Tensor]:
    """The random state both passes start from: the CPU's, and the GPU's on CUDA."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in _cuda_devices(precision))]


def _set_rng_state(precision: Precision, state: list[torch.Tensor]) -> None:
    torch.set_rng_state(state[0])
    for device, device_state in zip(_cuda_devices(precision), state[1:], strict=True):
        torch.cuda.set_rng_state(device_state, device)


def _ranges(recorder: _Recorder, grad_factor: float, casts: bool) -> tuple[list[TensorRange | None], ...]:
    """Per call: input, output and output-gradient ranges (with the fp16/bf16 casts when `casts`)."""
    is_grad = {index for call in recorder.calls for index in call.grads}
    groups = [(range(len(recorder.kept)), 1.0)] if grad_factor == 1.0 else [
        ([i for i in range(len(recorder.kept)) if i not in is_grad], 1.0), (sorted(is_grad), grad_factor)]
    figures = {}
    for indices, factor in groups:
        figures.update(zip(indices, _figures([recorder.kept[i] for i in indices], factor, casts), strict=True))

    def measure(indices: list[int], factor: float) -> TensorRange | None:
        return _combine([figures[i] for i in indices], [recorder.kept_dtypes[i] for i in indices], factor)

    return ([measure(c.inputs, 1.0) for c in recorder.calls], [measure(c.outputs, 1.0) for c in recorder.calls],
            [measure(c.grads, grad_factor) for c in recorder.calls])


def probe_step(model: nn.Module, precision: Precision, loss: Loss | None, batch: Any, *, scale: float | None = None,
               copy_model: bool = True, label: str = "", closure: Closure | None = None) -> NumericsReport:
    """Probe one forward + backward of `model` in `precision` against fp32 (32-true) on the same weights and batch.

    The model is deep-copied first unless `copy_model` is False (pass False only for a model that is already a
    throwaway copy): the caller's parameters, gradients and buffers are never touched. `scale` is the loss scale of
    the mode's backward (default: a fresh GradScaler's initial scale in modes that have one; ignored in modes
    without). Works for any model, loss and batch: a built-in workload, one registered at run time, a lane snapshot.
    `closure(model, batch)`, when given, computes the loss instead of `loss(model(inputs), target)` (a user's own
    loss: `model(**inputs).loss`, a LightningModule's training_step); `batch` is then any structure of tensors.
    """
    if not precision.uses_scaler:
        scale = None
    elif scale is None:
        scale = precision.make_scaler().get_scale()
    reference_precision = get_precision(BASELINE_MODE, precision.device)
    rng = _rng_state(precision)
    work = copy.deepcopy(model) if copy_model else model
    # One copy serves both passes: a pass changes no weight (no optimizer step; a dtype cast and back is exact),
    # only buffers a forward updates (BatchNorm's running statistics), which are put back in between.
    buffers = [buffer.clone() for buffer in work.buffers()]
    reference = _run_pass(work, reference_precision, loss, batch, None, rng, closure)
    with torch.no_grad():
        for buffer, saved in zip(work.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    actual = _run_pass(work, precision, loss, batch, scale, rng, closure)

    # The casts are measured on the fp32 values: what fp16 and bf16 do to the true values (a tensor the mode already
    # holds in fp16 shows its own overflow as inf and its underflow as zeros, and its error against fp32).
    in_mode, out_mode, grad_mode = _ranges(actual.recorder, 1.0, casts=False)
    in_ref, out_ref, grad_ref = _ranges(reference.recorder, scale or 1.0, casts=True)
    matched = _match(actual.recorder.calls, reference.recorder.calls)
    errors = _relative_errors([
        ([actual.recorder.kept[i] for i in call.outputs],
         [reference.recorder.kept[i] for i in reference.recorder.calls[other].outputs] if other is not None else [])
        for call, other in zip(actual.recorder.calls, matched, strict=True)])

    def pick(values: list, index: int | None) -> Any:
        return values[index] if index is not None else None

    modules = [ModuleNumerics(
        module=call.module, call=call.call, order=order, output=out_mode[order], input=in_mode[order],
        grad=grad_mode[order], grad_order=call.grad_order, reference_output=pick(out_ref, other),
        reference_input=pick(in_ref, other), reference_grad=pick(grad_ref, other),
        output_error=errors[order][0] if errors[order] is not None else None,
    ) for order, (call, other) in enumerate(zip(actual.recorder.calls, matched, strict=True))]
    return NumericsReport(
        label=label or precision.mode, mode=precision.mode, reference_mode=BASELINE_MODE, device=precision.device,
        scale=scale, modules=modules, params=_param_errors(actual.grads, reference.grads, scale or 1.0),
        first_nonfinite=_first_nonfinite(modules, scale), loss=actual.loss, reference_loss=reference.loss)


def _match(calls: list[_Call], reference: list[_Call]) -> list[int | None]:
    """For each call of the mode's pass, the same module's same call in the reference pass."""
    where = {(c.module, c.call): i for i, c in enumerate(reference)}
    return [where.get((c.module, c.call)) for c in calls]


def _param_errors(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                  scale: float) -> list[ParamError]:
    names = [name for name in reference if name in grads]
    # The mode's gradients are unscaled in fp64, where dividing by the scale adds no rounding of its own.
    errors = _relative_errors([([grads[name].double() / scale if scale != 1.0 else grads[name]], [reference[name]])
                               for name in names])
    return [ParamError(param=name, error=figures[0] if figures else math.nan,
                       reference_norm=figures[1] if figures else math.nan, dtype=_dtype_name(grads[name].dtype))
            for name, figures in zip(names, errors, strict=True)]


def _first_nonfinite(modules: list[ModuleNumerics], scale: float | None) -> FirstNonFinite | None:
    """Forward calls in the order they finished, then output gradients in the order they arrived."""
    for m in modules:
        if m.output is not None and m.output.nonfinite:
            return FirstNonFinite(m.module, m.call, FORWARD, m.output.inf, m.output.nan, m.input,
                                  _why_forward(m))
    arrived = sorted((m for m in modules if m.grad_order is not None), key=lambda m: m.grad_order)
    for m in arrived:
        if m.grad is not None and m.grad.nonfinite:
            return FirstNonFinite(m.module, m.call, BACKWARD, m.grad.inf, m.grad.nan, m.input,
                                  _why_backward(m, scale))
    return None


def _why_forward(m: ModuleNumerics) -> str:
    held = f"{m.output.inf} inf" if m.output.inf else f"{m.output.nan} NaN"
    if m.input is not None and m.input.nonfinite:
        return (f"its input already held inf/NaN: the value broke in code outside any module (or in the data), "
                f"and {m.module}'s {m.output.dtype} output carries {held} on")
    reference = m.reference_output
    if reference is not None and reference.nonfinite:
        return f"its output is non-finite in fp32 too ({held} here): the model itself overflows, not the format"
    if reference is not None and "fp16" in m.output.dtype and reference.abs_max > FP16_MAX:
        return (f"its fp16 output holds {held}: in fp32 the same output reaches {reference.abs_max:.3g}, above "
                f"fp16's largest value {FP16_MAX:g}")
    peak = f"in fp32 it stays at most {reference.abs_max:.3g}" if reference is not None else "no fp32 reference"
    return f"its {m.output.dtype} output holds {held} although {peak}: a value inside the module overflowed"


def _why_backward(m: ModuleNumerics, scale: float | None) -> str:
    held = f"{m.grad.inf} inf" if m.grad.inf else f"{m.grad.nan} NaN"
    reference = m.reference_grad
    scaled = f" (loss scale {scale:g})" if scale else ""
    text = f"the gradient reaching its output holds {held} in the {m.grad.dtype} backward{scaled}"
    if reference is None:
        return text
    if reference.nonfinite:
        return f"{text}; it is non-finite in fp32 too: the model itself overflows, not the format"
    peak = reference.abs_max * (scale or 1.0)
    if scale and "fp16" in m.grad.dtype and peak > FP16_MAX:
        return (f"{text}: in fp32 it peaks at {reference.abs_max:.3g}, times the scale {peak:.3g}, above fp16's "
                f"largest value {FP16_MAX:g} — the GradScaler will skip this step and back off")
    return f"{text}; in fp32 it peaks at {reference.abs_max:.3g}"


# --- entry points ------------------------------------------------------------------------------------------------

def resolve_workload(workload: str | Workload) -> Workload:
    """A workload by registered name, or a Workload object as it is (one registered at run time, a plugin's)."""
    if isinstance(workload, Workload):
        return workload
    if workload not in WORKLOADS:
        raise ConfigError("workload", f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[workload]


def probe_workload(workload: str | Workload, mode: str, size: str = "small", device: str = "cpu", *, seed: int = 0,
                   batch_size: int = DEFAULT_NUMERICS_BATCH) -> NumericsReport:
    """Probe one batch of a freshly built workload (by name, or any Workload object) in one mode or recipe
    (`16-mixed+keep:head`) against fp32.

    ConfigError naming the field for a bad workload, mode (a compiled recipe too), size, device or batch size.
    """
    spec = resolve_workload(workload)
    try:
        config = RunConfig(workload=spec.name or type(spec).__name__, modes=(mode,), size=size, device=device,
                           seed=seed, batch_size=batch_size)
        if WORKLOADS.get(config.workload) is spec:
            check_launch(config)
        else:  # a Workload object nobody registered: the same checks, without the registry
            ok, reason = availability(mode, device)
            if not ok:
                raise ConfigError("modes", f"{mode} cannot run on this device: {reason}")
            spec.check_config(config)
    except ConfigError as error:
        if error.field != "modes":
            raise
        raise ConfigError("mode", error.why) from None  # one mode here: name the field as the caller spelled it
    if spec.sizes and size not in spec.sizes:
        raise ConfigError("size", f"{config.workload} has sizes {', '.join(spec.sizes)}, not {size!r}")
    precision = get_precision(mode, device)
    if compile_option(precision) is not None:
        raise ConfigError("mode", f"{mode}: a probe runs the step eagerly, module by module, so it would not show "
                                  "the compiled step; probe the recipe without its +compile (a compiled lane's layer "
                                  "numerics run on an eager copy too)")
    model, batch = spec.seeded_model_and_batch(config)
    return probe_step(model, precision, spec.loss, batch, copy_model=False, label=f"{config.workload} · {mode}")


def probe_lane(run: Any, lane_index: int) -> NumericsReport:
    """Probe a live lane on a snapshot of its current weights, its current batch and its current loss scale;
    the lane's parameters, gradients, optimizer and scaler are untouched."""
    snapshot = run.snapshot_lane(lane_index)
    label = f"run {run.run_id} · lane {lane_index} · {snapshot.mode} · step {snapshot.step}"
    return probe_step(snapshot.model, snapshot.precision, snapshot.workload.loss, snapshot.batch,
                      scale=snapshot.scale, copy_model=False, label=label)


# --- over time: a run's sampled per-layer abs max -----------------------------------------------------------------

LAYER_AMAX_EVENT = "layer_amax"
"""Event kind of a sampled per-layer abs max (data: modules, output_amax, grad_amax, scale, sample_ms)."""


@dataclass(frozen=True, slots=True)
class LayerAmax:
    """Per-module abs max of one sampled step: output and gradient w.r.t. the output, in execution order.

    A value is a float; the string "inf" or "nan" where the tensor held one (JSON has no inf or NaN); None where the
    module produced no such tensor (no floating output, or no gradient reached it)."""

    modules: list[str]
    output_amax: list[float | str | None]
    """Largest |output| of each module call."""
    grad_amax: list[float | str | None]
    """Largest |gradient w.r.t. the output|, as the backward held it (scaled under a GradScaler)."""
    scale: float | None
    shares: dict[str, dict[str, dict[str, list[float | None]]]] | None = None
    """Where measured (probes.layerwatch): per tensor ("output" | "grad"), format and effect, each module's share of
    its values a real cast overflows / makes subnormal / flushes to zero."""
    fp8: dict[str, Any] | None = None
    """An FP8 lane's sample: how torchao scales and casts (recipe, scaling, the format each tensor is cast to)."""

    def event_data(self) -> dict[str, Any]:
        """Plain JSON-able data for an Event."""
        extra = {name: value for name, value in (("shares", self.shares), ("fp8", self.fp8)) if value is not None}
        return {"modules": self.modules, "output_amax": self.output_amax, "grad_amax": self.grad_amax,
                "scale": self.scale, **extra}

    def message(self) -> str:
        pairs = list(zip(self.modules, self.output_amax, strict=True))
        broken = [name for name, value in pairs if isinstance(value, str)]
        if broken:
            return f"layer amax: {broken[0]} output holds inf/NaN"
        finite = [(value, name) for name, value in pairs if value is not None]
        if not finite:
            return "layer amax: no floating outputs"
        value, name = max(finite)
        return f"layer amax: largest output {value:.3g} in {name}"


class LayerAmaxSampler:
    """Samples a model's per-layer abs max, again and again, on a shadow copy made once.

    Before each sample the shadow takes the model's current parameters and buffers by an in-place copy: no module
    is built per sample (a deepcopy of a module costs more than a small model's step, and leaves garbage for the
    collector to find in the middle of later steps). Hooks go on the shadow only, and a forward's side effects
    (BatchNorm's running statistics) stay there. The model must keep its tensors (an optimizer updates in place).
    """

    def __init__(self, model: nn.Module, precision: Precision, loss: Loss):
        self.model = model
        self.precision = precision
        self.shadow = copy.deepcopy(model)
        self.loss_module = _LossModule(loss)
        self._names = _module_names(self.shadow, self.loss_module)
        self._sources = [*model.parameters(), *model.buffers()]
        self._targets = [*self.shadow.parameters(), *self.shadow.buffers()]

    def record(self, batch: tuple[torch.Tensor, torch.Tensor], scale: float | None, recorder: _Recorder) -> None:
        """One forward + backward of the shadow (its weights refreshed from the model) in the model's mode, seen by
        `recorder` (no parameter gradient is computed: only the gradients w.r.t. the outputs are asked for)."""
        with torch.no_grad():
            foreach_copy_(self._targets, self._sources)
        inputs, target = (self.precision.prepare_input(t) for t in batch)
        with self.precision.step_context(), recorder:
            with self.precision.forward_context():
                value = self.loss_module(self.shadow(inputs), target)
            outputs = [recorder.original(i) for i in dict.fromkeys(i for c in recorder.calls for i in c.outputs)]
            outputs = [t for t in outputs if t.requires_grad]
            if outputs:
                torch.autograd.grad(value * scale if scale else value, outputs, allow_unused=True)

    def sample(self, batch: tuple[torch.Tensor, torch.Tensor], scale: float | None = None) -> LayerAmax:
        """Abs max of every module's output and output gradient in one forward + backward of the shadow."""
        recorder = _Recorder(self._names, lambda t: t.abs().amax() if t.numel() else None)
        self.record(batch, scale, recorder)
        with self.precision.step_context():
            measured = [a for a in recorder.kept if a is not None]
            maxima = iter(torch.stack([a.float() for a in measured]).tolist() if measured else [])
        amax = [next(maxima) if a is not None else None for a in recorder.kept]

        def largest(indices: list[int]) -> float | str | None:
            values = [amax[i] for i in indices if amax[i] is not None]
            if any(math.isnan(v) for v in values):
                return "nan"
            if any(math.isinf(v) for v in values):
                return "inf"
            return max(values, default=None)

        return LayerAmax(modules=[_label(c.module, c.call) for c in recorder.calls],
                         output_amax=[largest(c.outputs) for c in recorder.calls],
                         grad_amax=[largest(c.grads) for c in recorder.calls], scale=scale)


def sample_layer_amax(model: nn.Module, precision: Precision, loss: Loss, batch: tuple[torch.Tensor, torch.Tensor],
                      scale: float | None = None) -> LayerAmax:
    """One sample of `model`'s per-layer abs max (on a copy); a run keeps a LayerAmaxSampler per lane instead."""
    return LayerAmaxSampler(model, precision, loss).sample(batch, scale)
