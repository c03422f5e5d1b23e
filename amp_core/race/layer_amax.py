"""The race's layer amax sampling (RunConfig.amax_every) as a run hook: every N steps, after a lane's step, each
module's output and output-gradient abs max on a shadow copy of the lane (a `layer_amax` event per lane)."""

from __future__ import annotations

import time
from typing import Any

from amp_core.probes.headroom import FORECAST_EVENT, Forecaster
from amp_core.probes.layerwatch import layer_sampler
from amp_core.probes.numerics import LAYER_AMAX_EVENT, LayerAmaxSampler


class LayerAmaxHook:
    """An after_lane_step hook (RunHooks) acting every `every` steps; `lane_end` lets a lane's shadow copy go. Its
    `run` and `lane` are a runner.Run and its lanes.Lane (not imported: the runner imports this module)."""

    def __init__(self, every: int):
        self.every = every
        """Steps between two samples: the steps in between may be plain ones (RunHooks.plain_steps)."""
        self._samplers: dict[int, LayerAmaxSampler] = {}
        """Per lane, the shadow copy layer amax is sampled on (one more copy of the weights while the lane lives)."""
        self.forecaster = Forecaster()
        """Each sample's headroom and trend: a `forecast` event when a lane's earliest forecast appears or moves."""

    def __call__(self, run: Any, lane: Any, step: int) -> None:
        """Per-module abs max on the shadow copy (the lane's weights after this step, this step's batch), after the
        timed step: its cost is reported in the event as sample_ms and never enters step_ms."""
        state = lane.state
        # (A lane's last step has made it "finished" by now: the recorder counted that step before this hook.)
        if step % self.every or state is None or lane.status not in ("running", "finished"):
            return
        start = time.perf_counter()
        try:
            scale = state.scaler.get_scale() if state.scaler.is_enabled() else None  # a device sync: sampled steps only
            sampler = self._samplers.get(lane.index)
            if sampler is None:
                sampler = self._samplers[lane.index] = layer_sampler(state.model, state.precision,
                                                                      state.workload.loss)
            sample = sampler.sample(run.batch_of(lane), scale)
        except Exception as exc:  # a failed sample must not stop the lane
            run.sink.event("warning", f"layer amax sampling failed: {type(exc).__name__}: {exc}", lane.index, step)
            return
        data = sample.event_data()
        run.sink.event(LAYER_AMAX_EVENT, sample.message(), lane.index, step, **data,
                       sample_ms=(time.perf_counter() - start) * 1e3)
        try:
            told = self.forecaster.observe(lane.index, step, data, state.precision.mode)
        except Exception as exc:  # a failed forecast must not stop the lane either
            run.sink.event("warning", f"forecast failed: {type(exc).__name__}: {exc}", lane.index, step)
            return
        if told is not None:
            run.sink.event(FORECAST_EVENT, told[0], lane.index, step, **told[1])

    def lane_end(self, run: Any, lane: Any) -> None:
        self._samplers.pop(lane.index, None)
