"""Layer diagnostics of an attached run (a Monitor's, a trainer callback's): per-layer ranges every N steps, the first
module that held inf/NaN after a failed step, and a layer pass on request, measured by hooks on the user's own model
during its own step, kept on the device and read at the Monitor's flush.

A watched step hooks every module (probes.numerics' recorder, as a race's layer amax sample does): each float output,
and each gradient w.r.t. an output as the backward produces it, becomes a small vector of figures on its device (abs
max, inf/NaN count, elements, and per format fp16 / bf16 / fp8 e4m3fn / fp8 e5m2 the values a round-to-nearest cast
overflows (beyond the largest value plus half a step: inf, NaN or saturated), makes subnormal, or flushes to zero:
counted against each format's limits in one bucketize, which the tests hold to what real casts do). Nothing is
read on the step: at a flush each watched step's figures reach the host in one transfer and become a `layer_amax` event
(the race's, so the same heatmap draws it, with the shares beside) and, when the step failed, a `first_nonfinite` event
naming the first module in execution order whose output held inf/NaN (else the first gradient in backward order), with
its abs max before and after.

Steps between watched ones carry no hook at all: arming registers the hooks before a step and removes them after it.

`LayerWatchProbe` is the layer watch as a sampled probe (probes.sampled): a Monitor's step driver carries it, and a
race lane's can too (RunHooks.probes), recording the same figures of the same loop.

A race's lane with FP8 matmuls samples its layers (RunConfig.amax_every) with `Fp8RangeSampler`: the same figures on
the lane's shadow copy, plus e4m3fn / e5m2 after the scale torchao's own code gives each tensor.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp_core.precision import Precision
from amp_core.probes.numerics import LAYER_AMAX_EVENT, ROOT, LayerAmax, LayerAmaxSampler, _label, _Recorder
from amp_core.probes.sampled import NOT_SOON, ProbeTrack, SampledProbe

FORMATS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8 e4m3fn": torch.float8_e4m3fn,
                                   "fp8 e5m2": torch.float8_e5m2}
"""The formats each watched value is cast to."""
EFFECTS = ("overflow", "subnormal", "zero")
"""What a cast does to a finite non-zero value: overflow (inf or NaN), subnormal, flushed to zero."""
FIELDS = ("abs_max", "nonfinite", "numel", *(f"{name} {effect}" for name in FORMATS for effect in EFFECTS))
"""The figures of one watched tensor, in the order `tensor_figures` returns them."""
FIRST_NONFINITE_EVENT = "first_nonfinite"
"""Event kind: the first module whose output (or gradient) held inf/NaN in a watched step after a failed step."""


def _limits(dtype: torch.dtype) -> tuple[float, float, float]:
    """The magnitudes where a round-to-nearest-even cast of an fp32 value to `dtype` flushes to zero (at or below
    half the smallest subnormal), stays subnormal (below the smallest normal less half a subnormal step: from there it
    rounds up to a normal), and overflows (from the largest value plus half a step there: inf, NaN, or saturated in
    fp8 e4m3fn, which has no inf)."""
    info = torch.finfo(dtype)
    smallest_subnormal = info.smallest_normal * info.eps
    top_step = 2.0 ** math.floor(math.log2(info.max)) * info.eps
    return smallest_subnormal / 2, info.smallest_normal - smallest_subnormal / 2, info.max + top_step / 2


_ORDERED = sorted((limit, name, which) for name, dtype in FORMATS.items()
                  for which, limit in zip(EFFECTS[::-1], _limits(dtype), strict=True))
"""Every format's limits, ascending, as (magnitude, format, "zero" | "subnormal" | "overflow")."""
_BOUNDARIES: dict[torch.device, torch.Tensor] = {}


def _boundaries(device: torch.device) -> torch.Tensor:
    """The limits as bucket edges where a value belongs to the bucket at or below the edge: the strict ones (subnormal
    below, overflow from) one fp32 step lower."""
    if device not in _BOUNDARIES:
        edges = torch.tensor([limit for limit, _, _ in _ORDERED], dtype=torch.float32)
        strict = torch.tensor([which != "zero" for _, _, which in _ORDERED])
        edges = torch.where(strict, torch.nextafter(edges, torch.zeros_like(edges)), edges)
        _BOUNDARIES[device] = edges.to(device)
    return _BOUNDARIES[device]


def tensor_figures(tensor: torch.Tensor) -> torch.Tensor:
    """One tensor's figures as a float64 vector on its device (no host sync; `figures` reads it): abs max (NaN or inf
    when it held one), inf/NaN count, elements, and how many finite non-zero values fall in each bucket between the
    formats' limits (one bucketize and one bincount, whatever the number of formats)."""
    magnitude = tensor.detach().float().reshape(-1).abs()
    finite = torch.isfinite(magnitude)
    counted = finite & (magnitude != 0)
    edges = _boundaries(magnitude.device)
    buckets = torch.where(counted, torch.bucketize(magnitude, edges), len(edges) + 1)
    counts = torch.bincount(buckets, minlength=len(edges) + 2)[:len(edges) + 1]
    head = torch.stack([magnitude.amax() if magnitude.numel() else magnitude.new_zeros(()),
                        (~finite).sum().float(), magnitude.new_tensor(float(magnitude.numel()))])
    return torch.cat([head.double(), counts.double()])


def figures(vector: list[float]) -> dict[str, float]:
    """What `tensor_figures` measured, read on the host, as FIELDS."""
    out = dict(zip(FIELDS[:3], vector[:3], strict=True))
    counts = vector[3:]
    for index, (_, name, which) in enumerate(_ORDERED):
        if which == "zero":  # buckets at or below this edge
            out[f"{name} zero"] = sum(counts[:index + 1])
        elif which == "subnormal":
            zero_edge = next(i for i, (_, n, w) in enumerate(_ORDERED) if n == name and w == "zero")
            out[f"{name} subnormal"] = sum(counts[zero_edge + 1:index + 1])
        else:
            out[f"{name} overflow"] = sum(counts[index + 1:])
    return {name: out[name] for name in FIELDS}


class _TimedRecorder(_Recorder):
    """probes.numerics' recorder, its hooks' whole host time added up (the watched step's probe time). Its hooks run
    inside the user's forward and backward: one that fails keeps the failure (`error`) and does nothing more in that
    step, so the user's step goes on (the Monitor tells the failure: MonitorDesk)."""

    def __init__(self, names: dict[nn.Module, str]):
        super().__init__(names, tensor_figures)
        self.hook_s = 0.0
        self.error: Exception | None = None

    def _on_forward(self, *args) -> None:
        if self.error is not None:
            return
        started = time.perf_counter()
        try:
            super()._on_forward(*args)
        except Exception as exc:
            self.error = exc
        self.hook_s += time.perf_counter() - started

    def _on_grad(self, *args) -> None:
        if self.error is not None:
            return
        started = time.perf_counter()
        try:
            super()._on_grad(*args)
        except Exception as exc:
            self.error = exc
        self.hook_s += time.perf_counter() - started


@dataclass(slots=True)
class WatchedStep:
    """One step's hooks and what they kept (device tensors until read)."""

    step: int
    why: str
    """Why it was watched: "sampled", "requested", or the failure it was armed after."""
    recorder: _TimedRecorder
    failed: str = ""
    """Set when this very step failed (its own figures then name the first inf/NaN)."""
    after_failure: tuple[int, str] | None = None
    """(step, why) of an earlier failed step this one was armed after."""
    request_ids: list[int] = field(default_factory=list)
    """Requests from the dashboard this step answers."""
    scale: torch.Tensor | float | None = None
    """The loss scale its backward used (a copy of the scaler's device tensor, read with the figures), or None."""


@dataclass(slots=True)
class LayerWatch:
    """Watches `model`'s modules on chosen steps of a user's loop; see the module's docstring. `every`: sample every N
    steps (0: only after a failed step or on request)."""

    model: nn.Module
    every: int
    budget: float = 0.0
    """Sampled steps are watched only while the sampled watches so far have taken at most this share of the loop's
    own time (`between_steps`' `loop_s`); 0: no limit. Failed steps and requests are always watched."""
    spent_s: float = 0.0
    """Host time of the sampled watches so far (their hooks')."""
    last_s: float = 0.0
    """What the last sampled watch took (the next one is expected to take as much: SamplingSchedule.within_budget)."""
    names: dict[nn.Module, str] = field(init=False)
    current: WatchedStep | None = None
    pending: list[WatchedStep] = field(default_factory=list)
    """Watched steps whose figures have not been read yet."""
    watch_next: tuple[int, str] | None = None
    """A failed step that was not watched: the next step is, to name its first inf/NaN."""
    last_failed: int | None = None
    streak_named: bool = False
    """A run of consecutive failed steps (a model whose weights went NaN fails every step) is named once."""
    requests: list[int] = field(default_factory=list)
    """Requests from the dashboard for the next step ("layer numerics at the next step"), by id."""
    answers: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """(request id, answer) of requested steps read so far, for the Monitor to write."""
    off: bool = False
    """Switched off for the run (its own failure, amp_core.attach.guard): no step is watched any more."""
    scale_of: Callable[[], torch.Tensor | float | None] | None = None
    """The loss scale now, without a host sync (torch_private.scale_tensor of the loop's GradScaler): a watched
    step's gradients are held scaled, and its sample says by how much (the forecast unscales them)."""

    def __post_init__(self) -> None:
        self.names = {module: name or ROOT for name, module in self.model.named_modules()}

    # --- driven by the Monitor ----------------------------------------------------------------------------------
    def between_steps(self, ended: int, upcoming: int, loop_s: float = 0.0) -> None:
        """After step `ended`: its hooks come off (its figures wait for the flush); hooks go on for `upcoming` when
        it is sampled (and within the budget, `loop_s` being the loop's own time so far), requested, or follows an
        unwatched failure."""
        watched = self.current
        if watched is not None:
            watched.recorder.__exit__()
            if watched.why == "sampled":
                self.last_s = watched.recorder.hook_s
                self.spent_s += self.last_s
            if watched.recorder.error is None:
                self.pending.append(watched)
            self.current = None
        if self.off:
            return
        why = ""
        if self.watch_next is not None:
            why = f"after step {self.watch_next[0]} failed ({self.watch_next[1]})"
        elif self.requests:
            why = "requested"
        elif self._sampled(upcoming, loop_s):
            why = "sampled"
        if why:
            self._arm(upcoming, why)

    def idle(self, upcoming: int, loop_s: float = 0.0) -> bool:
        """No step is watched now, and `between_steps(upcoming - 1, upcoming, loop_s)` would arm none."""
        return self.off or (self.current is None and self.watch_next is None and not self.requests
                            and not self._sampled(upcoming, loop_s))

    def _sampled(self, step: int, loop_s: float) -> bool:
        return bool(self.every) and step % self.every == 0 and (
            not self.budget or self.spent_s + self.last_s <= self.budget * loop_s)

    def failed(self, step: int, why: str) -> None:
        """Step `step` was skipped by the scaler or its loss or gradient norm was not finite: its own figures name the
        first inf/NaN when it was watched, else the next step is watched for it (once per run of consecutive
        failed steps)."""
        consecutive = self.last_failed is not None and step == self.last_failed + 1
        self.last_failed = step
        if consecutive and self.streak_named:
            return
        self.streak_named = True
        for watched in (self.current, *self.pending):
            if watched is not None and watched.step == step:
                watched.failed = why
                return
        if self.watch_next is None:
            self.watch_next = (step, why)

    def watches(self, step: int) -> bool:
        """Whether step `step` is (or was, its figures unread) watched: its own figures can name its first inf/NaN."""
        return any(watched is not None and watched.step == step for watched in (self.current, *self.pending))

    def hook_error(self) -> Exception | None:
        """What a hook of the step under way raised (its figures are then dropped), or None."""
        return self.current.recorder.error if self.current is not None else None

    def switch_off(self) -> None:
        """No step is watched any more (its hooks come off); requests are answered with nothing."""
        self.close()
        self.off, self.watch_next, self.pending = True, None, []

    def hooks_so_far_s(self) -> float:
        """Host time the hooks have taken in the step under way."""
        return self.current.recorder.hook_s if self.current is not None else 0.0

    def close(self) -> None:
        if self.current is not None:
            self.current.recorder.__exit__()
            self.current = None

    def read(self) -> list[tuple[str, str, int, dict[str, Any]]]:
        """The watched steps' figures (one host transfer each; on CUDA it waits for those steps, which a flush is
        allowed to) as events: (kind, message, step, data)."""
        events = []
        for watched in self.pending:
            events += self._events(watched)
        self.pending = []
        return events

    # --- hooks --------------------------------------------------------------------------------------------------
    def _arm(self, step: int, why: str) -> None:
        watched = WatchedStep(step, why, _TimedRecorder(self.names))
        if self.watch_next is not None:
            watched.after_failure, self.watch_next = self.watch_next, None
        watched.request_ids, self.requests = self.requests, []
        scale = self.scale_of() if self.scale_of is not None else None
        watched.scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else scale  # the scaler updates it
        watched.recorder.__enter__()
        self.current = watched

    # --- reading ------------------------------------------------------------------------------------------------
    def _events(self, watched: WatchedStep) -> list[tuple[str, str, int, dict[str, Any]]]:
        recorder = watched.recorder
        if not recorder.kept:
            self.answers += [(request_id, {"step": watched.step, "layers": None, "messages": [
                "no module produced a floating-point output in that step"]}) for request_id in watched.request_ids]
            return []
        calls = recorder.calls
        rows = [figures(vector) for vector in torch.stack(recorder.kept).cpu().tolist()]  # the step's one transfer
        inputs = [_combined(rows, call.inputs) for call in calls]
        scale = float(watched.scale) if watched.scale is not None else None  # read at the flush, with the figures
        sample, outputs, grads = _sample(calls, rows, scale, FORMATS)
        modules = sample.modules
        data = {**sample.event_data(), "why": watched.why, "sample_ms": watched.recorder.hook_s * 1e3}
        events = [(LAYER_AMAX_EVENT, sample.message(), watched.step, data)]
        if watched.failed or watched.after_failure:
            events.append(self._first_nonfinite(watched, modules, inputs, outputs, grads, calls))
        for request_id in watched.request_ids:
            self.answers.append((request_id, {"step": watched.step, "layers": data,
                                              "messages": [message for _, message, _, _ in events]}))
        return events

    def _first_nonfinite(self, watched: WatchedStep, modules, inputs, outputs, grads, calls):
        if watched.after_failure:
            failed_step, why = watched.after_failure
            when = (f"in step {watched.step}, the next step after arming the hooks (step {failed_step} failed and was "
                    "not watched" + (f"; step {watched.step} failed too" if watched.failed else "") + ")")
        else:
            failed_step, why = watched.step, watched.failed
            when = "in the failing step itself (it was watched)"
        data: dict[str, Any] = {"failed_step": failed_step, "watched_step": watched.step, "failure": why,
                                "same_step": failed_step == watched.step}
        forward = next((i for i, f in enumerate(outputs) if f and f["nonfinite"]), None)
        if forward is not None:
            before, after = _amax(inputs[forward]), _amax(outputs[forward])
            data |= {"module": modules[forward], "phase": "forward", "before_amax": before, "after_amax": after}
            message = (f"first inf/NaN: {modules[forward]} (forward output: |max| of its input {_text(before)}, of its "
                       f"output {_text(after)}) {when}")
            return FIRST_NONFINITE_EVENT, message, watched.step, data
        order = sorted((call.grad_order, i) for i, call in enumerate(calls) if call.grad_order is not None)
        previous = None
        for _, index in order:
            if grads[index] and grads[index]["nonfinite"]:
                before = _amax(grads[previous]) if previous is not None else None
                after = _amax(grads[index])
                data |= {"module": modules[index], "phase": "backward", "before_amax": before, "after_amax": after,
                         "previous_module": modules[previous] if previous is not None else None}
                source = f"the gradient reaching {modules[previous]} before it" if previous is not None else "none"
                message = (f"first inf/NaN: {modules[index]} (gradient of its output: |max| {_text(after)}; "
                           f"{source}: {_text(before)}) {when}")
                return FIRST_NONFINITE_EVENT, message, watched.step, data
            previous = index
        data |= {"module": None, "phase": None}
        return (FIRST_NONFINITE_EVENT, f"no module held inf/NaN {when}: the failure ({why}) came from outside the "
                                       "modules' outputs and gradients (e.g. the optimizer or the loss)",
                watched.step, data)


def _combined(rows: list[dict[str, float]], indices: list[int]) -> dict[str, float] | None:
    """The figures of the tensors at `indices` (a module call's outputs, or its output's gradients) as one."""
    if not indices:
        return None
    picked = [rows[i] for i in indices]
    out = {name: sum(row[name] for row in picked) for name in picked[0] if name != "abs_max"}
    maxima = [row["abs_max"] for row in picked]
    out["abs_max"] = math.nan if any(math.isnan(m) for m in maxima) else max(maxima)
    return out


def _sample(calls, rows: list[dict[str, float]], scale: float | None, formats) -> tuple[LayerAmax, list, list]:
    """(LayerAmax with the shares of `formats`, each call's output figures, each call's gradient figures)."""
    outputs = [_combined(rows, call.outputs) for call in calls]
    grads = [_combined(rows, call.grads) for call in calls]
    sample = LayerAmax(modules=[_label(call.module, call.call) for call in calls],
                       output_amax=[_amax(f) for f in outputs], grad_amax=[_amax(f) for f in grads], scale=scale,
                       shares={"output": _shares(outputs, formats), "grad": _shares(grads, formats)})
    return sample, outputs, grads


def _amax(figures: dict[str, float] | None) -> float | str | None:
    """A race's layer amax value: the float, "inf"/"nan" where the tensor held one, None where there was none."""
    if figures is None:
        return None
    value = figures["abs_max"]
    if math.isnan(value):
        return "nan"
    if math.isinf(value) or figures["nonfinite"]:
        return "inf"
    return value


def _text(value: float | str | None) -> str:
    return "none" if value is None else value if isinstance(value, str) else f"{value:.3g}"


def _shares(figures: list[dict[str, float] | None], formats) -> dict[str, dict[str, list[float | None]]]:
    """Per format and effect, each module's share of its values (None where it had none)."""
    return {name: {effect: [f[f"{name} {effect}"] / f["numel"] if f and f["numel"] else None for f in figures]
                   for effect in EFFECTS} for name in formats}


# --- a race's FP8 lane: its sampled layers against e4m3fn / e5m2, unscaled and as torchao scales them ----------------

FP8_FORMATS = {"fp8 e4m3fn": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}
SCALED = " scaled"
"""Suffix of a format measured after torchao's scale ("fp8 e4m3fn scaled")."""
ROLES = {"output": "input", "grad": "grad_output"}
"""What torchao's Float8Linear calls a module output (the next Linear's input) and the gradient reaching it."""


class _ScaledRecorder(_Recorder):
    """probes.numerics' recorder keeping, per tensor, its figures (FORMATS, unscaled) and then, per FP8 format, the
    figures of the tensor times the scale torchao's recipe would give it: an output as a Float8Linear's input, a
    gradient as its grad_output."""

    def __init__(self, names: dict[nn.Module, str], float8):
        super().__init__(names, self._measure)
        self.float8 = float8
        self.role = ROLES["output"]

    def _measure(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [tensor_figures(tensor)]
        for dtype in FP8_FORMATS.values():
            scaled = tensor.float() * self.float8.cast_scale(tensor, self.role, dtype) if tensor.numel() else tensor
            parts.append(tensor_figures(scaled))
        return torch.cat(parts)

    def _on_grad(self, *args) -> None:
        self.role = ROLES["grad"]
        try:
            super()._on_grad(*args)
        finally:
            self.role = ROLES["output"]


def _scaled_figures(vector: list[float]) -> dict[str, float]:
    """What `_ScaledRecorder` kept of one tensor, read on the host: FIELDS, then '<fp8 format> scaled <effect>'."""
    width = len(vector) // (1 + len(FP8_FORMATS))  # three `tensor_figures` vectors, one after the other
    out = figures(vector[:width])
    for index, name in enumerate(FP8_FORMATS, start=1):
        scaled = figures(vector[index * width:(index + 1) * width])
        out |= {f"{name}{SCALED} {effect}": scaled[f"{name} {effect}"] for effect in EFFECTS}
    return out


class Fp8RangeSampler(LayerAmaxSampler):
    """A race's layer amax sample (RunConfig.amax_every) for a lane with FP8 matmuls: on the same shadow copy, each
    module's output and output gradient measured against fp16 / bf16 / e4m3fn / e5m2 by the figures an attached run
    records (`tensor_figures`: unscaled, a plain cast), and against e4m3fn / e5m2 after the scale torchao's recipe
    computes for it (its own `tensor_to_scale`: tensorwise one per tensor, rowwise one per row, as a Float8Linear
    would cast it). What torchao really casts are the Linear layers' inputs and grad_outputs; every module's tensors
    are measured as if they were one."""

    def sample(self, batch: tuple[torch.Tensor, torch.Tensor], scale: float | None = None) -> LayerAmax:
        float8 = self.precision.float8
        recorder = _ScaledRecorder(self._names, float8)
        self.record(batch, scale, recorder)
        # The sample's one transfer of its figures (outside the timed step: the run reports it as sample_ms).
        rows = [_scaled_figures(v) for v in torch.stack(recorder.kept).cpu().tolist()] if recorder.kept else []
        formats = [*FORMATS, *(f"{name}{SCALED}" for name in FP8_FORMATS)]
        sample, _, _ = _sample(recorder.calls, rows, scale, formats)
        casts = {which: f"{_FORMAT_NAMES[float8.cast_config(role).target_dtype]}{SCALED}"
                 for which, role in ROLES.items()}
        return LayerAmax(sample.modules, sample.output_amax, sample.grad_amax, scale, sample.shares,
                         fp8={"recipe": float8.torchao_recipe, "scaling": float8.scaling(), "casts": casts})


_FORMAT_NAMES = {dtype: name for name, dtype in FP8_FORMATS.items()}


def layer_sampler(model: nn.Module, precision: Precision, loss) -> LayerAmaxSampler:
    """A race lane's layer amax sampler: an FP8 lane's also measures its ranges against e4m3fn / e5m2."""
    cls = Fp8RangeSampler if precision.float8 is not None else LayerAmaxSampler
    return cls(model, precision, loss)


class LayerWatchProbe(SampledProbe):
    """The layer watch as a sampled probe (probes.sampled): hooks on the track's own model during its own step, armed
    after the step before a watched one, its figures read when the owner says a read is due (a Monitor: every half
    flush interval). It needs no batch: it runs in a user's loop as in a race lane."""

    name = "the layer watch"

    def __init__(self, every: int, budget: float = 0.0):
        super().__init__()
        self.every = every
        self.budget = budget
        """LayerWatch.budget: the share of the loop's own time the sampled watches may take (0: no limit)."""
        self.watch: LayerWatch | None = None
        """The layer watch itself, made on the track's model when the probe is attached (its requests, answers and
        failures are read by the Monitor's desk)."""

    def attach(self, track: ProbeTrack) -> None:
        super().attach(track)
        self.watch = LayerWatch(track.model, self.every, self.budget, scale_of=track.scale)
        self.watch.between_steps(-1, 0)

    def full_at(self, step: int) -> int:
        """`step` while a step is watched or would be armed now; else the step before the next sampled one (it arms
        the watch for the next)."""
        watch = self.watch
        if not watch.idle(step, self.track.loop_s()):
            return step
        if not watch.every or watch.off:
            return NOT_SOON
        watched = -(-(step + 1) // watch.every) * watch.every
        return watched - 1

    def after_step(self, step: int) -> None:
        """The hooks off the step that ended (its figures wait for `read`), on for the next when it is watched; a hook
        that failed in the step, or arming that fails, is told to the track."""
        watch = self.watch
        error = watch.hook_error()
        try:
            watch.between_steps(step, step + 1, self.track.loop_s())
        except Exception as exc:
            error = exc
        if error is not None and not self.track.failed(self.name, error, step):
            watch.switch_off()

    def read(self) -> None:
        """The watched steps' figures as events (one host transfer each), `layer_amax` samples feeding the forecast."""
        watch, track = self.watch, self.track
        try:
            for kind, message, step, data in watch.read():
                self.tell(kind, message, step, data)
        except Exception as exc:
            watch.pending = []
            if not track.failed(self.name, exc, track.steps_done()):
                watch.switch_off()

    @contextlib.contextmanager
    def aside(self):
        """The watched step's hooks off while the model runs a forward that is not the step's, then on again (nothing
        has been recorded yet: the step's own forward follows)."""
        watched = self.watch.current
        if watched is None:
            yield
            return
        watched.recorder.__exit__()
        try:
            yield
        finally:
            watched.recorder.__enter__()

    def switch_off(self) -> None:
        self.watch.switch_off()

    def end(self) -> None:
        self.watch.close()
