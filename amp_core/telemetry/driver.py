"""The step driver: how one track's steps (a race lane's, a Monitor's loop's) are measured around their training work,
written once for both. It opens and closes a step's timed window, decides from the sampling schedule whether a step
is plain or full, keeps plain steps (PlainStep) until they are drained into the recorder in a batch, assembles a full
step (gradient norms, figures sent, sampled probes closed) and hands it to the StepRecorder.

What the timed window holds is decided here and nowhere else: `begin` opens the sampled probes (outside the window)
and then the window, as the last thing before the training work; `end` closes it, as the first thing after
(`host_plain` does the same inline, for a race lane's plain steps on a CPU). Between the two is the training work
only: `step.train_step` / `step.plain_work` for a race lane, the user's own loop between two `Monitor.step` calls.
A gradient norm measured as a figure only, the figures' copies and the sampled probes come after `end` (`finish`),
their host time being the step's probe_ms.

A per-step diagnostic is written once, as a SampledProbe (amp_core.probes.sampled), and carried by the driver of a
race lane or of a Monitor's loop alike (`carry`): the driver asks it which steps it needs full, calls it after each
full step (`after_step`), has it read what it kept (`read_probes`) and lets it go (`end_probes`); its owner only
chooses which probes a track carries and says when a step ended or a read is due.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch

from amp_core.probes.sampled import ProbeTrack, SampledProbe
from amp_core.telemetry.meters import Meter, Window
from amp_core.telemetry.recorder import LaneTrack, PlainStep, StepRecorder, StepResult, send_figures
from amp_core.telemetry.sampled import NOTHING_OPENED, GradFigures, StepProbes, named_grad_norms
from amp_core.telemetry.watch import OptimizerWatch
from amp_core.torch_private import scale_tensor

PlainWork = Callable[[tuple], tuple[float, torch.Tensor]]
"""A plain step's training work on its batch: returns (the LR it stepped with, the loss tensor)."""
HostPlain = Callable[[int, tuple, "int | None"], "tuple[Window, float, torch.Tensor, bool] | None"]
"""A plain step (`host_plain`, `device_plain`): (step, batch, samples) -> None when kept, else (window, lr, loss,
skipped) of a step that takes the full path from its closed window (`finish`): a loss known not to be finite, or a
step the scaler skipped."""
HOST_KEPT = ("step", "lr", "start", "end", "loss", "samples", "probe_s")
"""The fields of a step kept on the host (`host_kept`), in order: its window's start and end on the meter's clock, its
loss as a float, the batch's size, and the caller's own host time on it outside the window (a Monitor's). No
wall-clock time: the drain gives each its window's end moved to the wall clock (StepRecorder.add_host)."""
FullStepAt = Callable[[int], int]
"""What else watches a driver's steps: given a step, the first step from it on that must take the full path (the step
itself: this one; a large number: none soon)."""


def _finite(loss: torch.Tensor | float) -> bool:
    """Whether a loss on the host is finite (a tensor's read: call it only where reading waits for nothing)."""
    return math.isfinite(loss.item() if isinstance(loss, torch.Tensor) else float(loss))


class StepDriver:
    """The measured steps of one track (see the module's docstring). `plain`: the steps the schedule leaves unsampled
    may be plain ones (the owner decides whether anything else needs every step); `also_every`: what else acts every
    N steps (a run's replay snapshots); `watchers`: FullStepAt callables of the owner's own diagnostics."""

    __slots__ = ("also_every", "always_norm", "contain", "end", "failing_since", "host_kept", "kept", "meter",
                 "open_plain", "opened", "plain", "plain_until", "probes", "recorder", "sampled", "scaler", "schedule",
                 "track", "watch", "watchers")

    def __init__(self, meter: Meter, probes: StepProbes, watch: OptimizerWatch,
                 scaler: torch.amp.GradScaler | None, *, always_norm: bool = False):
        self.meter = meter
        self.probes = probes
        self.schedule = probes.schedule
        self.watch = watch
        self.scaler = scaler
        self.always_norm = always_norm
        """Measure the gradient norm on every full step (clipping, planned faults, a mode that overflows)."""
        self.recorder: StepRecorder | None = None
        self.track: LaneTrack | None = None
        self.plain = False
        self.also_every: tuple[int, ...] = ()
        self.watchers: list[FullStepAt] = []
        self.sampled: list[SampledProbe] = []
        """The per-step diagnostics this track carries (`carry`)."""
        self.plain_until = 0
        """Steps before this one are plain (`plan`)."""
        self.contain: Callable[[str, Exception, int], object] | None = None
        """`contain(what, exc, step)`: a sampled figure that failed is told there and the step recorded without it
        (a Monitor's: its diagnostics never stop the user's loop); None: the failure is raised (a race lane's)."""
        self.failing_since = -2
        """The last step whose loss was known not to be finite (`_first_nonfinite_loss`)."""
        self.kept: list[PlainStep] = []
        self.host_kept: list[tuple] = []
        """`host_plain`'s kept steps (and a Monitor's on a CPU without a scaler), as HOST_KEPT tuples: made records at
        the drain (StepRecorder.add_host), where the caches hold this code."""
        self.opened = NOTHING_OPENED
        self.end: Callable[[Window], None] = meter.close
        """`end(window)` closes the timed window: the first thing after the training work (the meter's own close,
        bound here: a plain step's window makes one call less)."""
        self.open_plain: Callable[[torch.Tensor | float | None], Window] = meter.open
        """`open_plain(scale)`: `begin(step, scale, plain=True)` with one call less (the meter's own open, bound here):
        a plain step's Python runs with cold caches right after the training work, where each call counts."""

    def attach(self, recorder: StepRecorder, track: LaneTrack) -> None:
        """Where the steps' records go."""
        self.recorder, self.track = recorder, track

    # --- the sampled probes ------------------------------------------------------------------------------------------
    def carry(self, probes: list[SampledProbe], track: ProbeTrack) -> None:
        """The sampled probes this track carries: each is handed the track and joins the watchers (the steps it needs
        on the full path)."""
        for probe in probes:
            probe.attach(track)
            self.watchers.append(probe.full_at)
        self.sampled = [*self.sampled, *probes]

    def after_step(self, step: int) -> None:
        """After full step `step` was recorded, each sampled probe's own work; one that raises is told to its track,
        which may have it switched off (a Monitor's guard: the loop never sees it)."""
        for probe in self.sampled:
            try:
                probe.after_step(step)
            except Exception as exc:
                if not probe.track.failed(probe.name, exc, step):
                    probe.switch_off()

    def _unwatched(self, measure: Callable[[], int]) -> Callable[[], int]:
        """`measure` (a forward of the track's own, outside the step: the saved-tensor bytes) run with the sampled
        probes set aside, so a probe watching the step sees the step's forward alone."""

        def unwatched() -> int:
            with contextlib.ExitStack() as aside:
                for probe in self.sampled:
                    aside.enter_context(probe.aside())
                return measure()

        return unwatched

    def read_probes(self) -> None:
        """What the sampled probes kept on the device becomes events (the owner calls it when a read is due)."""
        for probe in self.sampled:
            probe.read()

    def end_probes(self) -> None:
        """The track ended: the sampled probes let go of what they hold."""
        for probe in self.sampled:
            probe.end()

    # --- plain or full --------------------------------------------------------------------------------------------
    def is_plain(self, step: int) -> bool:
        """Whether `step` is a plain one: it samples no figure and nothing watches it. Decided once for the steps up
        to the next full one (`replan` decides again, when a watcher may have changed its mind)."""
        if step < self.plain_until:
            return True
        until = self.schedule.next_full_step(step, self.also_every) if self.plain else step
        for full_at in self.watchers:
            if until <= step:
                break
            until = min(until, full_at(step))
        self.plain_until = until
        return step < until

    def replan(self, step: int) -> bool:
        """`is_plain`, deciding again from `step` (a watcher may have been asked for something: a request, a
        failure)."""
        self.plain_until = 0
        return self.is_plain(step)

    # --- the timed window ---------------------------------------------------------------------------------------
    def begin(self, step: int, scale: torch.Tensor | float | None = None, *, plain: bool = False,
              memory: bool = False, grad_stats: bool = False, saved_bytes: Callable[[], int] | None = None) -> Window:
        """Open step `step`: on a full step the sampled probes first (outside the window: the bytes saved for
        backward, parameter copies, the allocator's window), then the timed window, which takes `scale` (the scale
        the step begins with) before it starts."""
        if not plain:
            if saved_bytes is not None and self.sampled:
                saved_bytes = self._unwatched(saved_bytes)
            self.opened = self.probes.open(step, memory, grad_stats, saved_bytes)
        return self.meter.open(scale)

    # --- after the window ---------------------------------------------------------------------------------------
    def keep(self, window: Window, step: int, lr: float, loss: torch.Tensor | float, samples: int | None,
             probe_s: float = 0.0) -> bool:
        """A plain step: send its loss (and on a scaled step the scale after it) and keep it for the next drain.
        False, with nothing kept, when its loss is known at once not to be finite (a host meter): the caller then
        takes the full path with the same window (`finish`), so a divergence or a failure is seen at this step."""
        meter = self.meter
        meter.send(window, [loss, scale_tensor(self.scaler)] if self.watch.scaled else [loss])
        there = meter.on_host(window)
        if there is not None and not math.isfinite(there[1][0]):
            return False
        self.kept.append(PlainStep(step, lr, time.time(), window, samples, probe_s))
        return True

    def host_plain(self, work: PlainWork) -> HostPlain:
        """A plain step's whole measured path as one call, where the meter has the figures on the host at once (a
        CPU) and no scaler runs: `begin(plain=True)`, `work(batch)`, `end` and `keep` with their calls made inline
        (a plain step's Python runs with cold caches right after the training work, where each call costs a
        microsecond or more; the race's own plain steps take this path). The window is the meter's own: two reads of
        its clock around the work, as `open` and `close` take them. The returned step(step, batch, samples) keeps a
        step whose loss is finite (`host_kept`, made records at the next `drain`) and returns None; for any other it
        returns (window, lr, loss), for the caller's `finish`, as `keep` answers False."""
        meter = self.meter
        if not meter.at_once or self.watch.scaled:
            raise ValueError("host_plain: a meter with the figures on the host at once and no scaler")
        clock, kept, isfinite = meter.clock, self.host_kept, math.isfinite

        def plain(step: int, batch: tuple, samples: int | None) -> tuple[Window, float, torch.Tensor, bool] | None:
            start = clock()
            lr, loss = work(batch)
            end = clock()
            value = loss.item()
            if isfinite(value):
                kept.append((step, lr, start, end, value, samples, 0.0))  # HOST_KEPT
                return None
            return Window(start, end, values=[value]), lr, loss, False

        return plain

    def device_plain(self, work: PlainWork, context: Callable[[], object]) -> HostPlain:
        """A plain step's measured path where the figures reach the host later (CUDA): inside `context()` (the lane's
        step context: the step lock and its TF32 flags) the window opens (with the scaler's scale, copied behind the
        step), `work(batch)` runs, the window closes and the loss is sent (with the scale after the step, where a
        scaler runs): copies to pinned memory and an event, no host sync; the step is kept (`kept`) and becomes a
        record at a drain, once its window is ready. It returns None; a loss that is not finite is seen when its
        figures arrive (StepRecorder), as a full step's is on CUDA. A step the scaler skipped (known on the host at
        once: an unfused optimizer; `work` calls the watch's `begin`) returns (window, lr, loss, True) for `finish`,
        which names its parameters. What it adds to the work: the events and copies a full step's window takes with
        nothing sampled, without a full step's Python (the probes' open and close, the figures' assembly)."""
        meter, kept, now, scaler, watch = self.meter, self.kept, time.time, self.scaler, self.watch
        scaled = watch.scaled
        if meter.at_once or watch.fused:
            raise ValueError("device_plain: a meter whose figures reach the host later, and no fused scaled step")

        def plain(step: int, batch: tuple, samples: int | None) -> tuple[Window, float, torch.Tensor, bool] | None:
            with context():
                window = meter.open(scale_tensor(scaler) if scaled else None)
                lr, loss = work(batch)
                meter.close(window)
                if scaled and not watch.stepped:
                    return window, lr, loss, True
                # With a scaler, the scale after the step (update() wrote it) goes with the loss.
                meter.send(window, [loss, scale_tensor(scaler)] if scaled else [loss])
                del loss  # the step's tensors die inside the context (see step.train_step)
            kept.append(PlainStep(step, lr, now(), window, samples))
            return None

        return plain

    def plain_step(self, work: PlainWork, context: Callable[[], object]) -> HostPlain:
        """The plain step of a race lane: `host_plain(work)` where the meter has the figures at once (a CPU: the lane
        holds no step context there), else `device_plain(work, context)`."""
        return self.host_plain(work) if self.meter.at_once else self.device_plain(work, context)

    def finish(self, window: Window, step: int, lr: float, loss: torch.Tensor | float, *, skipped: bool | None,
               found_inf: torch.Tensor | None = None,
               norms: tuple[tuple[torch.Tensor, torch.Tensor], list[str]] | None = None,
               memory: bool = False, grad_stats: bool = False, fired_faults: list | tuple = (),
               loop_s: float = 0.0, taken: GradFigures | None = None) -> StepResult:
        """A full step after its window closed: the gradient norm (fp32) where a figure needs it (every step with
        `always_norm`, on gradient-statistics, skipped and the schedule's grad-norm steps; `norms`: measured already,
        by clipping, with the parameters' names), its figures sent through the meter, the sampled probes closed.
        `taken`: the gradient figures taken during the step, where the gradients surely existed (a Monitor's: the
        loop may have cleared them since); without it they are read now. Returns its StepResult (probe_ms: the probes'
        host time), not yet recorded (`record`)."""
        t_wall_s = time.time()
        first_failed = self._first_nonfinite_loss(step, loss)  # every full step: a run of failed steps is told whole
        if taken is not None:
            norms = taken.norms if norms is None else norms
        elif norms is None and (self.always_norm or grad_stats or skipped or self.schedule.grad_norm(step)
                                or first_failed):
            # A figure only, so after the window: the optimizer leaves the gradients as they were.
            try:
                norms = named_grad_norms(self.probes.names, self.probes.params)
            except Exception as exc:
                if self.contain is None:
                    raise
                self.contain("the gradient norm", exc, step)
                norms = None
            if norms is not None and not norms[1]:  # no parameter has a gradient (none got one, or it was cleared)
                norms = None
        result = StepResult(step=step, lr=lr, t_wall_s=t_wall_s, scaled=self.watch.scaled, skipped=skipped,
                            fired_faults=fired_faults)
        send_figures(self.meter, window, result, loss, self.scaler, found_inf, *(norms or (None, None)))
        opened, self.opened = self.opened, NOTHING_OPENED
        try:
            result.probe_ms = self.probes.close(result, opened, memory, grad_stats, loop_s, taken) * 1e3
        except Exception as exc:
            if self.contain is None:
                raise
            self.contain("the sampled probes", exc, step)
        return result

    def _first_nonfinite_loss(self, step: int, loss: torch.Tensor | float) -> bool:
        """Whether `step` is the first of a run of steps whose loss is known on the host not to be finite (a host
        meter's: read for free): its gradient norm is measured, so the inf/NaN gradients an unscaled optimizer applied
        are counted and named (a nonfinite_grads event) rather than left "not measured"; once per run of such steps (a
        loop that goes on with NaN weights fails every step)."""
        if not self.meter.at_once or _finite(loss):
            return False
        first, self.failing_since = step != self.failing_since + 1, step
        return first

    def record(self, result: StepResult, samples: int | None) -> None:
        """Hand a full step to the recorder, after the plain steps kept before it (records stay in step order)."""
        self.drain()
        self.recorder.add(self.track, result, samples)

    def drain(self) -> None:
        """The kept plain steps become records (StepRecorder.add_host, add_plain), oldest first. Both lists are
        emptied in place: `host_plain`'s and `device_plain`'s steps append to the lists they were made with."""
        kept, host_kept = self.kept, self.host_kept
        if host_kept and not kept:  # the usual case on a CPU: the host's steps alone, made records directly
            steps = host_kept[:]
            host_kept.clear()
            self.recorder.add_host(self.track, steps)
            return
        if host_kept:  # both kinds (a window opened full for a step that turned out plain): merged in step order
            wall = time.time() - self.meter.clock()
            host = [PlainStep(step, lr, end + wall, Window(start, end, values=[value]), samples, probe_s)
                    for step, lr, start, end, value, samples, probe_s in host_kept]
            host_kept.clear()
            kept[:] = sorted(kept + host, key=lambda plain: plain.step)
        if kept:
            steps = kept[:]
            kept.clear()
            self.recorder.add_plain(self.track, steps, self.watch.scaled)
