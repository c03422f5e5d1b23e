"""The race's layer amax sampling (RunConfig.amax_every) as a sampled probe (probes.sampled): every N steps, after a
lane's step, each module's output and output-gradient abs max on a shadow copy of the lane (a `layer_amax` event per
lane). It needs the step's batch, so it runs where the track owns one (a race lane); the layer watch
(probes.layerwatch.LayerWatchProbe) measures the same figures in a user's own loop."""

from __future__ import annotations

import time

from amp_core.probes.layerwatch import layer_sampler
from amp_core.probes.numerics import LAYER_AMAX_EVENT, LayerAmaxSampler
from amp_core.probes.sampled import SampledProbe


class LayerAmaxProbe(SampledProbe):
    """Samples its track's layers every `every` steps on a shadow copy (see the module's docstring)."""

    name = "layer amax sampling"

    def __init__(self, every: int):
        super().__init__()
        self.every = every
        """Steps between two samples: the steps in between may be plain ones."""
        self._sampler: LayerAmaxSampler | None = None
        """The shadow copy layer amax is sampled on (one more copy of the weights while the lane lives)."""

    def after_step(self, step: int) -> None:
        """Per-module abs max on the shadow copy (the lane's weights after this step, this step's batch), after the
        timed step: its cost is reported in the event as sample_ms and never enters step_ms."""
        track = self.track
        # (A lane's last step has made it "finished" by now: the recorder counted that step before this call.)
        if step % self.every or not track.active():
            return
        start = time.perf_counter()
        try:
            scale = track.scale()  # a device sync: sampled steps only
            if self._sampler is None:
                self._sampler = layer_sampler(track.model, track.precision, track.loss)
            sample = self._sampler.sample(track.batch(), scale)
        except Exception as exc:  # a failed sample must not stop the lane
            track.event("warning", f"layer amax sampling failed: {type(exc).__name__}: {exc}", step)
            return
        data = sample.event_data()
        track.event(LAYER_AMAX_EVENT, sample.message(), step, **data, sample_ms=(time.perf_counter() - start) * 1e3)
        try:
            self.forecast(step, data)
        except Exception as exc:  # a failed forecast must not stop the lane either
            track.event("warning", f"forecast failed: {type(exc).__name__}: {exc}", step)

    def end(self) -> None:
        self._sampler = None
