"""A Monitor's diagnostics below the surface, attached to its loop as hooks: the layer watch (amp_core.probes.
layerwatch: each module's ranges on sampled steps, the first inf/NaN module of a failed step), the dashboard's
requests (amp_core.records.requests: "layer numerics at the next step", "trace the next step") and the op traces
that answer them. The Monitor calls it between steps; it tells the Monitor's step driver which steps it watches."""

from __future__ import annotations

import math
import time
from typing import Any

from amp_core.probes.layerwatch import FIRST_NONFINITE_EVENT, LayerWatch
from amp_core.probes.nonfinite import sentinel_for
from amp_core.records.requests import LAYERS, TRACE, Desk
from amp_core.records.store import RunStore
from amp_core.telemetry import LaneTrack, StepResult

NOT_SOON = 2**62
"""A FullStepAt answer: nothing here needs a full step."""


class MonitorDesk:
    """The layer watch, the requests and op traces of one Monitor (see the module's docstring): `monitor` is the
    amp_core.monitor.Monitor it serves (not imported: the Monitor imports this module)."""

    def __init__(self, monitor: Any, store: RunStore | None):
        config = monitor.config
        self.monitor = monitor
        self.layers = LayerWatch(monitor.inner_model, config.layers_every, config.probe_share())
        self.layers.between_steps(-1, 0)
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
        """The driver's FullStepAt: the first step from `step` on that is watched or arms the watch for the next
        (`step` itself while a trace, a layer request or a failure is being answered)."""
        layers = self.layers
        if not layers.idle(step, self.monitor.loop_s) or self.trace_asked or self.trace is not None:
            return step
        if not layers.every:
            return NOT_SOON
        watched = -(-(step + 1) // layers.every) * layers.every
        return watched - 1  # the step before a watched one arms it

    def recorded(self, track: LaneTrack, result: StepResult) -> None:
        """The recorder's on_record hook: a step that failed (skipped, or a loss or gradient norm not finite) has the
        first module that held inf/NaN named: by the layer watch when it watched the step (with its ranges), else by
        the sentinel's device flags of that same step, else (failing_step off) by the layer watch at the next step."""
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
        if self.trace is not None:
            self._answer_trace(result.step)
        self.layers.between_steps(result.step, result.step + 1, self.monitor.loop_s)
        if time.monotonic() >= self.read_at:
            self.answer()
        if self.trace_asked and self.trace is None:
            self._start_trace()

    def answer(self) -> None:
        """The watched steps' figures as events (one host transfer each: it waits for those steps on CUDA, which a
        flush may); answer what the layer watch read; take the page's new requests."""
        self.read_at = time.monotonic() + self.half_flush_s
        note = self.monitor.note
        for kind, message, step, data in self.layers.read():
            note(kind, message, at_step=step, **data)
        for request_id, answer in self.layers.answers:
            self.requests.answer(request_id, f"layer numerics of step {answer['step']}", answer)
        self.layers.answers = []
        for request_id, kind in self.requests.take():
            if kind == LAYERS:
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
        self.layers.close()
        if self.sentinel is not None:
            self.sentinel.close()
        if self.trace is not None:
            self.trace.stop()
            self.trace = None
