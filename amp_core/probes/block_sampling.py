"""Block-scaled numerics over sampled steps as sampled probes (probes.sampled), written once on probes.block_watch's
recorder: a race's block-scaled lane (`+mxfp8`, `+nvfp4`, `+fp8-blockwise`...) on RunConfig.amax_every's steps, on a
shadow copy (BlockSampleProbe), and a Monitor's loop on the steps its layer watch watches, by hooks in the user's own
step (BlockWatchProbe, MonitorConfig.block_formats). Each records a `block_sample` event per sample: each Linear's
GEMM operands quantised in the format."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from amp_core.probes.block_watch import BLOCK_SAMPLE_EVENT, BlockSampler, BlockWatch, sample_data
from amp_core.probes.layerwatch import LayerWatchProbe
from amp_core.probes.sampled import NOT_SOON, ProbeTrack, SampledProbe


class BlockSampleProbe(SampledProbe):
    """A race lane's block-scaled numerics every `every` steps (the layer amax's steps), measured in `format` (the
    lane's block-scaled option's name) on a shadow copy of the lane after its timed step."""

    name = "block numerics sampling"

    def __init__(self, every: int, format_name: str):
        super().__init__()
        self.every = every
        self.format = format_name
        self._sampler: BlockSampler | None = None
        """The shadow copy it is sampled on (one more copy of the weights while the lane lives)."""

    def after_step(self, step: int) -> None:
        """After the timed step: its cost is reported in the event as sample_ms and never enters step_ms."""
        track = self.track
        if step % self.every or not track.active():
            return
        start = time.perf_counter()
        try:
            if self._sampler is None:
                self._sampler = BlockSampler(track.model, track.precision, track.loss, (self.format,))
            message, data = sample_data(self._sampler.sample(track.batch()))
        except Exception as exc:  # a failed sample must not stop the lane
            track.event("warning", f"{self.name} failed: {type(exc).__name__}: {exc}", step)
            return
        track.event(BLOCK_SAMPLE_EVENT, message, step, **data, sample_ms=(time.perf_counter() - start) * 1e3)

    def end(self) -> None:
        self._sampler = None


def block_sample_probe(every: int, lane) -> BlockSampleProbe | None:
    """The probe a race lane (a lanes.Lane, its state set) carries when it trains a block-scaled recipe; None for a
    lane of another recipe: it has no block-scaled GEMM to measure."""
    option = lane.state.precision.block_scaled
    return None if option is None else BlockSampleProbe(every, option.name)


class BlockWatchProbe(SampledProbe):
    """A Monitor's block-scaled numerics in `formats`, riding on its layer watch (`layers`, carried before this probe
    by the same driver): armed on the steps the layer watch arms (sampled, requested, after a failure), measured by
    hooks in the user's own step, read at the layer watch's read. It asks for no step of its own (the layer watch's are
    full), and its hooks' host time counts in the layer watch's, so the probe budget and the step-time exclusion count
    it."""

    name = "the block-scaled watch"

    def __init__(self, layers: LayerWatchProbe, formats: Sequence[str]):
        super().__init__()
        self.layers = layers
        self.formats = tuple(formats)
        self.watch: BlockWatch | None = None
        self.off = False

    def attach(self, track: ProbeTrack) -> None:
        super().attach(track)
        self.watch = BlockWatch(track.model, self.formats, self.layers.watch)
        self.watch.follow(-1)

    def full_at(self, step: int) -> int:
        return NOT_SOON

    def after_step(self, step: int) -> None:
        """The hooks off the step that ended, on for the next when the layer watch armed it; a hook that failed in the
        step is raised to the driver, which tells the track."""
        if self.off:
            return
        self.watch.follow(step)
        error = self.watch.take_error()
        if error is not None:
            raise error

    def read(self) -> None:
        """The watched steps' figures as `block_sample` events (one host transfer each)."""
        watch, track = self.watch, self.track
        try:
            for kind, message, step, data in watch.read():
                self.tell(kind, message, step, data)
        except Exception as exc:
            watch.pending = []
            if not track.failed(self.name, exc, track.steps_done()):
                self.switch_off()

    @contextlib.contextmanager
    def aside(self):
        """The watched step's hooks off while the model runs a forward that is not the step's, then on again."""
        current = self.watch.current
        if current is None:
            yield
            return
        recorder = current[2]
        recorder.__exit__()
        try:
            yield
        finally:
            recorder.__enter__()

    def switch_off(self) -> None:
        self.off = True
        self.watch.close()

    def end(self) -> None:
        self.watch.close()
