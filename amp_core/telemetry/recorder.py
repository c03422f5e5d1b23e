"""The step recorder: what one measured step (a StepResult) becomes — a StepRecord row and its events — once its
figures are on the host. One StepRecorder serves a run's lanes (runner.py) and a user's loop (monitor.py) alike.

A step's driver opens a Meter window, does (or watches) the training work, closes the window and sends the step's
device figures (`send_figures`); the recorder keeps the steps whose figures are still on their way (`add`), oldest
first, and turns each into a record once its window is `ready` (a query, never a wait) — at once on a CPU, where a
window is ready when it closes; on CUDA every RESOLVE_EVERY_S or RESOLVE_BATCH steps, and all of them at a flush
(`resolve(wait=True)`: a host sync, made only there).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from amp_core.records.schema import GradStats
from amp_core.records.sink import RecordSink
from amp_core.records.tracks import TrackRecords
from amp_core.telemetry.meters import Meter, Window
from amp_core.torch_private import scale_tensor

MAX_IN_FLIGHT = 256
"""At this many steps whose figures are on their way, the oldest is waited for: the host is then that many steps
ahead of the device, so the wait costs the device nothing (the launch queue would stop the host soon anyway)."""
RESOLVE_EVERY_S = 0.25
"""Steps whose figures have reached the host become records at least this often ..."""
RESOLVE_BATCH = 32
"""... and whenever this many steps are waiting (a query per step waiting, never a wait)."""


@dataclass(slots=True)
class StepResult:
    """What one step measured. Figures still on their way (`window`) are filled in by `resolve_step`."""

    step: int
    lr: float
    t_wall_s: float
    """When the host finished the step (on CUDA: finished queuing it; the device may finish later)."""
    scaled: bool
    step_ms: float = math.nan
    loss: float = math.nan
    scale: float | None = None
    """The GradScaler scale this step's backward used (None: no scaler)."""
    scale_after: float | None = None
    skipped: bool | None = None
    """None until known: a fused optimizer decides on the device (read with the figures)."""
    grad_norm: float | None = None
    """None on steps where the norm was not measured."""
    probe_ms: float = 0.0
    activations_bytes: int | None = None
    """Set on steps where the saved-tensor probe ran."""
    held: tuple[int, int, int] | None = None
    """(parameters, gradients, optimizer state) bytes after the step, on steps that measured memory."""
    peak_above_start_bytes: int | None = None
    """Set on steps where the allocator's window was open (CUDA)."""
    lane_peak_bytes: int | None = None
    """Set with peak_above_start_bytes: held at the step's start + peak_above_start_bytes."""
    # Empty tuples, not lists, by default: most steps have none, and a step should allocate little.
    bad_params: list[dict] | tuple = ()
    """Parameters with inf/NaN gradients (filled when the step skipped or the gradients were not finite)."""
    grad_stats: list[GradStats] | tuple = ()
    fired_faults: list | tuple = ()
    """(step, FaultSpec) of the faults that fired on this step."""
    window: Window | None = None
    """The meter's window while the figures are on their way."""
    norm_names: list[str] | None = None
    """The parameters whose norms were sent, in order (None: no norms were sent)."""
    skip_sent: bool = False
    """The found-inf flag was sent with the figures (the skip was not known on the host)."""
    filled: bool = False
    """The figures were filled in as they were sent (a meter that has them on the host at once)."""


@dataclass(slots=True)
class PlainStep:
    """A step that sampled nothing, kept as it was made until the next drain turns it into a record."""

    step: int
    lr: float
    t_wall_s: float
    window: Window
    """Its timed window, with the loss (and on a scaled step the scale after it) sent."""
    samples: int | None
    """The batch's size (for samples/s)."""
    probe_s: float = 0.0
    """Host seconds the driver's caller spent on the step outside its window (a Monitor's own)."""


def send_figures(meter: Meter, window: Window, result: StepResult, loss: torch.Tensor | float,
                 scaler: torch.amp.GradScaler | None, found_inf: torch.Tensor | None,
                 norms: tuple[torch.Tensor, torch.Tensor] | None, norm_names: list[str] | None) -> None:
    """Queue a closed window's figures for the host: the loss; on a scaled step the scale after it; a fused
    optimizer's found-inf flag while the skip is not known; the gradient norm and each parameter's, when measured.
    Where the meter has them on the host at once (a CPU) they are filled in now, so the step's forensics see them."""
    values = [loss]
    if result.scaled:
        values.append(scale_tensor(scaler))
        if result.skipped is None:
            values.append(found_inf)
            result.skip_sent = True
    if norms is not None:
        per_param, total = norms
        values += (total, per_param)
        result.norm_names = norm_names
    meter.send(window, values)
    attach_window(meter, window, result)


def attach_window(meter: Meter, window: Window, result: StepResult) -> None:
    """Give `result` the window its figures were sent in (`send_figures`'s layout); where the meter has them on the
    host already (a CPU), they are filled in now."""
    result.window = window
    there = meter.on_host(window)
    if there is not None:
        _fill(result, *there)
        result.filled = True


def _fill(result: StepResult, scale_before: float | None, values: list[float]) -> None:
    """The figures of `send_figures`'s layout into the result."""
    result.loss = values[0]
    at = 1
    if result.scaled:
        if scale_before is not None:
            result.scale = scale_before
        result.scale_after = values[1]
        at = 2
        if result.skip_sent:
            result.skipped = values[2] > 0
            at = 3
    if result.norm_names is not None:
        result.grad_norm = values[at]
        if (result.skipped or not math.isfinite(result.grad_norm)) and not result.bad_params:
            result.bad_params = [{"param": name, "grad_norm": str(norm)}
                                 for name, norm in zip(result.norm_names, values[at + 1:], strict=True)
                                 if not math.isfinite(norm)]


def peek_scale_and_skip(meter: Meter, result: StepResult) -> None:
    """Fill in the scale a scaled step began with and whether it skipped, before the step resolves: waits for its
    figures (a host sync on CUDA: sampled probes only, which need them at once)."""
    if result.window is None or not result.scaled:
        return
    meter.wait(result.window)
    scale_before, values = meter.peek(result.window)
    if scale_before is not None:
        result.scale = scale_before
    if result.skip_sent:
        result.skipped = values[2] > 0


def resolve_step(meter: Meter, result: StepResult, *, wait: bool = False) -> StepResult:
    """Fill in the figures of a step whose window is ready (`wait`: wait for it, a host sync on CUDA).

    A step that skipped or whose gradient norm is not finite names the parameters whose norm was inf/NaN when its
    gradients were long gone (counts of inf and NaN elements need the gradients themselves)."""
    window = result.window
    if window is None:
        return result
    if wait:
        meter.wait(window)
    result.step_ms, scale_before, values = meter.receive(window)
    result.window = None
    if not result.filled:
        _fill(result, scale_before, values)
    return result


def record_step_events(sink: RecordSink, lane: int, result: StepResult) -> None:
    """What a step leaves beside its StepRecord: faults that fired, sampled gradient statistics, a skipped step with
    the parameters that overflowed, scale growth or backoff, inf/NaN gradients applied, a non-finite loss."""
    if not (result.fired_faults or result.grad_stats or result.skipped or result.bad_params
            or result.scale_after != result.scale or not math.isfinite(result.loss)):
        return  # most steps: nothing to say
    step = result.step
    for fired_step, fault in result.fired_faults:
        sink.event("fault", f"fault injected: {fault.describe()}", lane, fired_step, fault=fault.kind)
    if result.grad_stats:
        sink.add_grad_stats(lane, step, result.grad_stats)
    if result.skipped:
        sink.event("skipped_step", f"optimizer step skipped: inf/NaN gradients in "
                   f"{', '.join(p['param'] for p in result.bad_params) or 'the gradients'}",
                   lane, step, params=result.bad_params, scale_before=result.scale, scale_after=result.scale_after)
    if result.scale is not None and result.scale_after != result.scale:
        grew = result.scale_after > result.scale
        if grew == result.skipped:
            sink.event("warning", "scale change disagrees with the skip flag", lane, step)
        sink.event("scale_growth" if grew else "scale_backoff", f"scale {result.scale:g} -> {result.scale_after:g}",
                   lane, step, scale_before=result.scale, scale_after=result.scale_after)
    elif result.skipped:
        sink.event("warning", "step skipped but the scale did not back off", lane, step)
    if (not result.skipped and result.grad_norm is not None and not math.isfinite(result.grad_norm)
            and result.bad_params):
        sink.event("nonfinite_grads", "the optimizer stepped with inf/NaN gradients (no scaler to catch them)",
                   lane, step, params=result.bad_params)
    if not math.isfinite(result.loss):
        sink.event("nonfinite_loss", f"loss is {result.loss}", lane, step)


@dataclass(slots=True, eq=False)
class LaneTrack:
    """One recorded lane (a run's lane, or a Monitor's loop): its meter, its records, and the memory figures carried
    from its last measurement to the steps in between."""

    lane: int
    meter: Meter
    records: TrackRecords
    held: tuple[int, int, int] = (0, 0, 0)
    """(parameters, gradients, optimizer state) bytes at the last measurement."""
    activations_bytes: int = 0
    """Bytes saved for backward at the last measurement (0 where it is not measured: a Monitor)."""
    peak_above_start_bytes: int | None = None
    peak_bytes: int | None = None
    """The allocator-measured lane peak at the last measurement (CUDA)."""
    dropped: bool = False
    """Its lane stopped (StepRecorder.drop): steps of it that arrive later are not recorded."""

    def carried(self) -> tuple:
        """The memory figures a record carries from the last measurement, in STEP_COLUMNS order: parameters,
        gradients, optimizer state, activations, the allocator's peak above the step's start, the lane's peak."""
        params_bytes, grads_bytes, optim_bytes = self.held
        return (params_bytes, grads_bytes, optim_bytes, self.activations_bytes, self.peak_above_start_bytes,
                self.meter.lane_peak_bytes(params_bytes + grads_bytes + optim_bytes + self.activations_bytes,
                                           self.peak_bytes))


def _row(step: int, t_wall_s: float, loss: float, step_ms: float, samples: int | None, lr: float, scale: float,
         skipped: bool, grad_norm: float, carried: tuple, probe_ms: float) -> tuple:
    """One record's values in STEP_COLUMNS order (NaN for a figure not measured; samples/s from the batch's size)."""
    return (step, t_wall_s, loss, step_ms, samples / (step_ms / 1e3) if samples and step_ms > 0 else math.nan, lr,
            scale, skipped, grad_norm, *carried, probe_ms)


@dataclass(slots=True)
class StepRecorder:
    """Steps -> records and events for every LaneTrack of one sink (see the module's docstring).

    `on_record`: called with (track, result) after each step's record and events are written (in step order per
    lane) — the runner's lane bookkeeping (steps done, divergence) hangs here.
    """

    sink: RecordSink
    on_record: list[Callable[[LaneTrack, StepResult], None]] = field(default_factory=list)
    _in_flight: deque = field(default_factory=deque)
    _resolve_at: float = 0.0
    _adding: tuple[LaneTrack, int] | None = None
    """While `add_plain` adds a batch: its track and how many of its steps come after the one being added."""

    def track(self, lane: int, mode: str, meter: Meter) -> LaneTrack:
        """The LaneTrack of lane `lane` (its records: the sink's track of this lane)."""
        return LaneTrack(lane, meter, self.sink.track(lane, mode))

    def add(self, track: LaneTrack, result: StepResult, samples: int | None) -> None:
        """A measured step: recorded now when nothing is waiting before it and its figures are there (a CPU step
        always), else queued (`samples`: the batch's size, for samples/s)."""
        if not self._in_flight and track.meter.ready(result.window):
            resolve_step(track.meter, result)
            self._record(track, result, samples)
            return
        self._in_flight.append((track, result, samples))
        if len(self._in_flight) >= RESOLVE_BATCH or time.monotonic() >= self._resolve_at:
            self.resolve()

    def add_plain(self, track: LaneTrack, plain: list[PlainStep], scaled: bool = False) -> None:
        """Plain steps kept by a StepDriver (a step that sampled nothing, was not skipped and whose loss was finite as
        far as the host knew), oldest first, as `add` takes a full step, their figures sent through `track.meter`.
        Made here, in a batch, where the caches hold this code, rather than right after each step, where they hold
        the model."""
        meter = track.meter

        def results() -> Iterator[tuple[StepResult, int | None]]:
            for kept in plain:
                result = StepResult(step=kept.step, lr=kept.lr, t_wall_s=kept.t_wall_s, scaled=scaled, skipped=False,
                                    probe_ms=kept.probe_s * 1e3)
                attach_window(meter, kept.window, result)
                yield result, kept.samples

        self._add_batch(track, results(), len(plain))

    def add_host(self, track: LaneTrack, kept: list[tuple]) -> None:
        """`add_plain` for the steps a driver kept on the host (HOST_KEPT tuples: a CPU, no scaler), whose figures
        are all there: each becomes its StepResult, filled in, with no window to resolve. Their wall-clock time is
        their window's end on the meter's clock, moved to the wall clock as it reads now (one `time.time()` per
        drain, not per step)."""
        wall = time.time() - track.meter.clock()

        def result(step: int, lr: float, start: float, end: float, value: float, probe_s: float) -> StepResult:
            return StepResult(step=step, lr=lr, t_wall_s=end + wall, scaled=False, step_ms=(end - start) * 1e3,
                              loss=value, skipped=False, probe_ms=probe_s * 1e3, filled=True)

        if self._in_flight or track.dropped:  # steps wait before these (CUDA's, never beside a host meter's)
            self._add_batch(track, ((result(step, lr, start, end, value, probe_s), samples)
                                    for step, lr, start, end, value, samples, probe_s in kept), len(kept))
            return
        # What `add` and `_record` do for each, written for these steps: their figures are there (no window), their
        # loss is finite and nothing was sampled or skipped, so no event is due (record_step_events) and the memory
        # figures carried are the same for the whole batch.
        carried, append, hooks, nan = track.carried(), track.records.append_row, self.on_record, math.nan
        for left, (step, lr, start, end, value, samples, probe_s) in enumerate(kept, 1 - len(kept)):
            append(_row(step, end + wall, value, (end - start) * 1e3, samples, lr, nan, False, nan, carried,
                        probe_s * 1e3))
            if hooks:
                self._adding = (track, -left)  # the steps after this one, for `drop`
                done = result(step, lr, start, end, value, probe_s)
                for hook in hooks:
                    hook(track, done)
                if track.dropped:
                    break
        self._adding = None

    def _add_batch(self, track: LaneTrack, results: Iterable[tuple[StepResult, int | None]], count: int) -> None:
        """`count` steps of `track`, oldest first, each (result, samples) as `add` takes it; the rest are left out
        when one of them stops the lane (CUDA: a loss seen not finite as it arrived)."""
        for left, (result, samples) in enumerate(results, 1 - count):
            self._adding = (track, -left)  # the steps after this one, for `drop`
            self.add(track, result, samples)
            if track.dropped:
                break
        self._adding = None

    @property
    def waiting(self) -> int:
        """Steps whose figures are still on their way."""
        return len(self._in_flight)

    def resolve(self, wait: bool = False) -> None:
        """Steps whose figures reached the host become records, oldest first, stopping at the first still on its way;
        `wait` waits for all of them (a host sync: a flush, a pause, the end). Past MAX_IN_FLIGHT the oldest is
        waited for."""
        in_flight = self._in_flight
        while in_flight:
            track, result, samples = in_flight[0]
            ready = track.meter.ready(result.window)
            if not (ready or wait or len(in_flight) >= MAX_IN_FLIGHT):
                break
            in_flight.popleft()
            resolve_step(track.meter, result, wait=not ready)
            self._record(track, result, samples)
        self._resolve_at = time.monotonic() + RESOLVE_EVERY_S

    def drop(self, track: LaneTrack) -> int:
        """Forget the steps of `track` still on their way (a lane stopped), and the rest of a batch of its plain
        steps being added; returns how many steps that left out."""
        track.dropped = True
        kept = [entry for entry in self._in_flight if entry[0] is not track]
        dropped = len(self._in_flight) - len(kept)
        if self._adding is not None and self._adding[0] is track:
            dropped += self._adding[1]  # the rest of a batch of plain steps, which `add_plain` leaves out
        self._in_flight.clear()  # in place: `resolve` may be recording the step that stopped the lane
        self._in_flight.extend(kept)
        return dropped

    def _record(self, track: LaneTrack, result: StepResult, samples: int | None) -> None:
        """One resolved step -> its record (a row appended: ~1 us) with the memory figures carried, and its events."""
        if result.held is not None:
            track.held = result.held
        if result.activations_bytes is not None:
            track.activations_bytes = result.activations_bytes
        if result.peak_above_start_bytes is not None:
            track.peak_above_start_bytes, track.peak_bytes = result.peak_above_start_bytes, result.lane_peak_bytes
        track.records.append_row(_row(
            result.step, result.t_wall_s, result.loss, result.step_ms, samples, result.lr,
            math.nan if result.scale is None else result.scale, bool(result.skipped),
            math.nan if result.grad_norm is None else result.grad_norm, track.carried(), result.probe_ms))
        record_step_events(self.sink, track.lane, result)
        for hook in self.on_record:
            hook(track, result)
