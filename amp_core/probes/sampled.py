"""The one extension point for a per-step diagnostic: a SampledProbe is written once and runs in a race lane and in an
attached job (a Monitor) alike.

The step driver (amp_core.telemetry.driver.StepDriver.carry) calls it: `full_at` joins the driver's watchers (the
steps it needs taken on the full path), `after_step` follows each full step the driver records, `read` turns what it
kept on the device into events when its owner says a read is due (a race: at each flush; a Monitor: every half flush
interval), and `end` lets it go. The race (RunConfig.amax_every) and the Monitor (MonitorConfig.layers_every) only
choose which probes a track carries, and hand each a ProbeTrack: what it may use of the lane or the loop it watches.

A probe's `layer_amax` samples go through `tell`, which also feeds the headroom forecaster (probes.headroom): the
`forecast` events are the same whichever track the samples came from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_core.probes.headroom import FORECAST_EVENT, Forecaster
from amp_core.probes.numerics import LAYER_AMAX_EVENT

NOT_SOON = 2**62
"""A `full_at` answer: nothing here needs a full step."""


def _always() -> bool:
    return True


def _none() -> None:
    return None


def _zero() -> float:
    return 0.0


@dataclass(frozen=True, slots=True)
class ProbeTrack:
    """What a probe may use of the track it watches: a race lane, or the user's loop under a Monitor."""

    lane: int
    """The lane's index (a Monitor's loop: 0): what the events and the forecaster are keyed by."""
    mode: Callable[[], str]
    """The precision mode the track trains in (the formats the forecaster reads headroom against; a Monitor may learn
    it at the loop's first step)."""
    model: nn.Module
    """The model the track trains (a race lane's own; the user's, unwrapped)."""
    event: Callable[..., None]
    """`event(kind, message, step, **data)`: an event of the track, at `step`."""
    failed: Callable[[str, Exception, int], bool]
    """`failed(what, exc, step)`: the probe failed; False when it must switch itself off (a Monitor's guard: the
    second failure), True when it may go on."""
    steps_done: Callable[[], int]
    """The steps the track has recorded (a failure outside a step is told at this step)."""
    active: Callable[[], bool] = _always
    """Whether the track still trains after the step just recorded (a race lane that diverged there is not sampled)."""
    batch: Callable[[], tuple] | None = None
    """The step's batch, where the track owns it (a race lane's); None in a user's loop."""
    precision: Any = None
    """The track's Precision (amp_core.precision), where it has one (a race lane's); None in a user's loop."""
    loss: Callable | None = None
    """The workload's loss function (a race lane's); None in a user's loop."""
    scale: Callable[[], torch.Tensor | float | None] = _none
    """The loss scale now, without a host sync where the track can (None: no scaler)."""
    loop_s: Callable[[], float] = _zero
    """The track's own time so far (a Monitor's loop outside its steps' bookkeeping), for a probe's budget."""


class SampledProbe:
    """A per-step diagnostic (see the module's docstring). A subclass sets `name` (how a failure is told) and `every`,
    and writes `after_step` (and `read` where it keeps figures on the device until a read is due)."""

    name = "a sampled probe"
    every = 0
    """Steps between two samples (0: none on a schedule)."""

    def __init__(self) -> None:
        self.track: ProbeTrack | None = None
        self.forecaster = Forecaster()
        """Each layer sample's headroom and trend: a `forecast` event when the track's earliest forecast appears or
        moves."""

    def attach(self, track: ProbeTrack) -> None:
        """The track the probe watches, handed over by the driver (StepDriver.carry)."""
        self.track = track

    def full_at(self, step: int) -> int:
        """The first step from `step` on that the probe needs on the full path (its `every`-th ones)."""
        if not self.every:
            return NOT_SOON
        return -(-step // self.every) * self.every

    def after_step(self, step: int) -> None:
        """After full step `step` was recorded."""

    def read(self) -> None:
        """What the probe kept on the device becomes events (a read may wait for those steps on CUDA)."""

    def aside(self) -> contextlib.AbstractContextManager:
        """A context in which the track's model runs a forward that is not the step's (a race lane's saved-tensor
        measure): a probe hooked on the model stands aside there."""
        return contextlib.nullcontext()

    def switch_off(self) -> None:
        """The probe failed past what its track tolerates: it samples nothing more."""
        self.every = 0

    def end(self) -> None:
        """The track ended (a race lane failed, diverged or its run ended; the Monitor closed): let go of what the
        probe holds."""

    def tell(self, kind: str, message: str, step: int, data: dict[str, Any]) -> None:
        """An event of the track; a `layer_amax` sample also feeds the forecaster (`forecast`)."""
        self.track.event(kind, message, step, **data)
        if kind == LAYER_AMAX_EVENT:
            self.forecast(step, data)

    def forecast(self, step: int, data: dict[str, Any]) -> None:
        """Feed a `layer_amax` sample's data to the forecaster; its news is a `forecast` event."""
        track = self.track
        told = self.forecaster.observe(track.lane, step, data, track.mode())
        if told is not None:
            track.event(FORECAST_EVENT, told[0], step, **told[1])
