"""The race's block-scaled numerics over sampled steps as a run hook: on the steps a run samples its layers
(RunConfig.amax_every), after a block-scaled lane's step (`+mxfp8`, `+nvfp4`, `+fp8-blockwise`...), each Linear's GEMM
operands quantised in the lane's format on a shadow copy of the lane (probes.block_watch), a `block_sample` event
per lane and sample. Lanes of other recipes have no block-scaled GEMM to measure and are passed by."""

from __future__ import annotations

import time
from typing import Any

from amp_core.probes.block_watch import BLOCK_SAMPLE_EVENT, BlockSampler, sample_data


class BlockNumericsHook:
    """An after_lane_step hook (RunHooks) acting every `every` steps on block-scaled lanes; `lane_end` lets a lane's
    shadow copy go. Its `run` and `lane` are a runner.Run and its lanes.Lane (not imported: the runner imports the
    module that imports this one)."""

    def __init__(self, every: int):
        self.every = every
        self._samplers: dict[int, BlockSampler] = {}
        """Per lane, the shadow copy it is sampled on (one more copy of the weights while the lane lives)."""

    def __call__(self, run: Any, lane: Any, step: int) -> None:
        """After the timed step: its cost is reported in the event as sample_ms and never enters step_ms."""
        state = lane.state
        if step % self.every or state is None or lane.status not in ("running", "finished"):
            return
        option = state.precision.block_scaled
        if option is None:
            return
        start = time.perf_counter()
        try:
            sampler = self._samplers.get(lane.index)
            if sampler is None:
                sampler = self._samplers[lane.index] = BlockSampler(state.model, state.precision,
                                                                    state.workload.loss, (option.name,))
            message, data = sample_data(sampler.sample(run.batch_of(lane)))
        except Exception as exc:  # a failed sample must not stop the lane
            run.sink.event("warning", f"block numerics sampling failed: {type(exc).__name__}: {exc}", lane.index,
                           step)
            return
        run.sink.event(BLOCK_SAMPLE_EVENT, message, lane.index, step, **data,
                       sample_ms=(time.perf_counter() - start) * 1e3)

    def lane_end(self, run: Any, lane: Any) -> None:
        self._samplers.pop(lane.index, None)
