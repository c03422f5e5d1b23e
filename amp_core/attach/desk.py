"""A Monitor's diagnostics below the surface, attached to its loop as hooks: the layer watch (amp_core.probes.
layerwatch: each module's ranges on sampled steps, the first inf/NaN module of a failed step), the dashboard's
requests (amp_core.records.requests: "layer numerics at the next step", "trace the next step") and the op traces
that answer them. The Monitor calls it between steps; it tells the Monitor's step driver which steps it watches. Each
of them that fails is told through the Monitor's guard (amp_core.attach.guard) and, failing again, switched off: the
user's loop never sees it.

The layer watch is a sampled probe (amp_core.probes.sampled), as a race lane's layer amax is: the Monitor's step
driver carries it, calls it after each full step and has it read when a read is due; this desk only configures it
(MonitorConfig.layers_every) and answers the page's requests with what it read. Its block-scaled watch
(MonitorConfig.block_formats, probes.block_sampling.BlockWatchProbe) is another, carried beside it."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

from amp_core.probes.block_sampling import BlockWatchProbe
from amp_core.probes.layerwatch import FIRST_NONFINITE_EVENT, LayerWatchProbe
from amp_core.probes.nonfinite import sentinel_for
from amp_core.probes.sampled import NOT_SOON, ProbeTrack
from amp_core.records.requests import LAYERS, TRACE, Desk
from amp_core.records.store import RunStore
from amp_core.telemetry import LaneTrack, StepDriver, StepResult
from amp_core.torch_private import scale_tensor

LAYER_WATCH = LayerWatchProbe.name
SENTINEL = "the failing-step sentinel"
REQUESTS = "the page's requests"
TRACE_NAME = "the op trace"


class MonitorDesk:
    """The layer watch, the requests and op traces of one Monitor (see the module's docstring): `monitor` is the
    amp_core.attach.monitor.Monitor it serves (not imported: the Monitor imports this module)."""

    def __init__(self, monitor: Any, store: RunStore | None, driver: StepDriver):
        config = monitor.config
        self.monitor = monitor
        self.driver = driver
        probe = LayerWatchProbe(config.layers_every, config.probe_share())
        # Block-scaled numerics (MonitorConfig.block_formats) ride on the layer watch's steps: carried after it.
        blocks = [BlockWatchProbe(probe, config.block_formats)] if config.block_formats else []
        driver.carry([probe, *blocks], monitor_probe_track(monitor))
        self.layers = probe.watch
        """The layer watch the probe made: its requests, answers and failures are this desk's to handle."""
        self.requests = Desk(store, monitor.run_id)  # a page's requests, rank 0 only
        self.half_flush_s = config.flush_every_s / 2
        self.read_at = time.monotonic() + self.half_flush_s
        """When (`time.monotonic()`) the watched steps' figures are read and the requests taken next."""
        self.trace_asked: list[int] = []
        self.trace = None
        self.sentinel = sentinel_for(monitor.inner_model, lambda: monitor.steps_done,
                                     host_reads_free=monitor.host_reads_free, ranks=monitor.world_size,
                                     skips_failed_steps=monitor.scaler is not None) \
            if config.failing_step else None
        """What names a failed step's first inf/NaN module in that step (MonitorConfig.failing_step)."""

    def full_at(self, step: int) -> int:
        """The driver's FullStepAt: `step` itself while an op trace is asked for or under way (the layer watch says
        which steps it needs itself: LayerWatchProbe.full_at)."""
        return step if self.trace_asked or self.trace is not None else NOT_SOON

    def recorded(self, track: LaneTrack, result: StepResult) -> None:
        """The recorder's on_record hook: a step that failed (skipped, or a loss or gradient norm not finite) has the
        first module that held inf/NaN named: by the layer watch when it watched the step (with its ranges), else by
        the sentinel's device flags of that same step, else (failing_step off) by the layer watch at the next step."""
        try:
            self._recorded(result)
        except Exception as exc:  # the sentinel's (the layer watch's own hooks are told by `after_step`)
            if not self.monitor.guard.failed(SENTINEL, exc, result.step) and self.sentinel is not None:
                self.sentinel.close()
                self.sentinel = None

    def _recorded(self, result: StepResult) -> None:
        failure = ("skipped by the scaler" if result.skipped else "loss not finite" if not math.isfinite(result.loss)
                   else "gradient norm not finite" if result.grad_norm is not None
                   and not math.isfinite(result.grad_norm) else "")
        if self.sentinel is not None:
            if not failure:
                self.sentinel.did_not_fail(result.step)
            stopped = self.sentinel.take_stopped()
            if stopped:
                self.monitor.note("failing_step_off", stopped, at_step=result.step)
        if not failure:
            return
        named = self.sentinel.failed(result.step, failure, bool(result.skipped)) if self.sentinel is not None \
            and not self.layers.watches(result.step) else None
        if named is not None:
            if named[0]:
                self.monitor.note(FIRST_NONFINITE_EVENT, named[0], at_step=result.step, **named[1])
        else:
            self.layers.failed(result.step, failure)

    def after_step(self, result: StepResult) -> None:
        """After a full step: its op trace to the pages that asked; the layer hooks off the step that ended (on for the
        next when it is watched); every half flush interval, the watched steps' figures become events and the page's
        requests are answered and taken; an op trace a page asked for starts here, before the next step's window."""
        guard, step = self.monitor.guard, result.step
        if self.trace is not None:
            try:
                self._answer_trace(step)
            except Exception as exc:
                self.trace = None
                self._refuse_traces(guard, exc, step)
        self.driver.after_step(step)  # the layer watch's hooks off the step that ended, on for the next when watched
        if time.monotonic() >= self.read_at:
            self.answer()
        if self.trace_asked and self.trace is None:
            try:
                self._start_trace()
            except Exception as exc:
                self.trace = None
                self._refuse_traces(guard, exc, step)

    def failed(self, exc: Exception, step: int) -> None:
        """What `after_step` did not catch (a failure of its own): told, and on a second one every diagnostic here
        is switched off."""
        if not self.monitor.guard.failed("the layer watch and the page's requests", exc, step):
            self.layers.switch_off()
            self.requests.store = None

    def _refuse_traces(self, guard, exc: Exception, step: int) -> None:
        """An op trace failed: the pages that asked are told why; a second failure switches traces off."""
        asked, self.trace_asked = self.trace_asked, []
        for request_id in asked:
            with contextlib.suppress(Exception):  # the store's own failure is told by the flush
                self.requests.answer(request_id, f"the op trace failed: {exc}", status="refused")
        guard.failed(TRACE_NAME, exc, step)

    def answer(self) -> None:
        """The watched steps' figures as events (one host transfer each: it waits for those steps on CUDA, which a
        flush may); answer what the layer watch read; take the page's new requests."""
        self.read_at = time.monotonic() + self.half_flush_s
        monitor = self.monitor
        guard = monitor.guard
        self.driver.read_probes()
        if not guard.on(REQUESTS):
            return
        try:
            self._take_requests()
        except Exception as exc:
            guard.failed(REQUESTS, exc, monitor.steps_done)

    def _take_requests(self) -> None:
        """Answer what the layer watch read; take the page's new requests (refused, with the reason, where the
        diagnostic that answers them is off)."""
        guard = self.monitor.guard
        for request_id, answer in self.layers.answers:
            self.requests.answer(request_id, f"layer numerics of step {answer['step']}", answer)
        self.layers.answers = []
        for request_id, kind in self.requests.take():
            if (kind == LAYERS and self.layers.off) or (kind == TRACE and not guard.on(TRACE_NAME)):
                self.requests.answer(request_id, f"{LAYER_WATCH if kind == LAYERS else TRACE_NAME} is off in this "
                                                 "process: it failed twice (the run's events say why)",
                                     status="refused")
            elif kind == LAYERS:
                self.layers.requests.append(request_id)
            elif kind == TRACE:
                self.trace_asked.append(request_id)
            else:
                self.requests.answer(request_id, f"this process does not know the request {kind!r}",
                                     status="refused")

    def _start_trace(self) -> None:
        from amp_core.probes.steptrace import StepTrace  # the op tracer only when a page asks for it

        monitor = self.monitor
        label = f"{monitor.config.name or monitor.run_id} · step {monitor.steps_done}"
        self.trace = StepTrace(monitor.inner_model, label, monitor.mode or "?", str(monitor.device))
        self.trace.start()

    def _answer_trace(self, step: int) -> None:
        """The op trace of the step that ended (started before its window: the step's time includes the tracer's)."""
        from amp_core.probes.steptrace import to_answer

        trace, self.trace = self.trace.stop(), None
        asked, self.trace_asked = self.trace_asked, []
        self.monitor.note("traced", f"step {step} was traced on request: its step time includes the tracer's",
                          at_step=step)
        for request_id in asked:
            self.requests.answer(request_id, f"every op of step {step} ({len(trace.records)} ops)", to_answer(trace))

    def close(self) -> None:
        self.driver.end_probes()
        if self.sentinel is not None:
            self.sentinel.close()
        if self.trace is not None:
            self.trace.stop()
            self.trace = None


def monitor_probe_track(monitor: Any) -> ProbeTrack:
    """What the user's loop under `monitor` (an amp_core.attach.monitor.Monitor) offers its sampled probes: the
    user's model, the mode (learned at the loop's first step where not given), the scale without a host sync, the
    loop's own time; events are the Monitor's, and a probe's failure goes through its guard (a second one switches it
    off). No batch: the loop is the user's."""

    def event(kind: str, message: str, step: int, **data) -> None:
        monitor.note(kind, message, at_step=step, **data)

    return ProbeTrack(lane=0, mode=lambda: monitor.mode or "", model=monitor.inner_model, event=event,
                      failed=monitor.guard.failed, steps_done=lambda: monitor.steps_done,
                      scale=lambda: scale_tensor(monitor.scaler), loop_s=lambda: monitor.loop_s)
