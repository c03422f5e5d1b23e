"""Which steps take the sampled figures (memory, gradient norm, gradient statistics, layer amax) and, from that, up
to which step a driver's steps may be plain ones: one schedule for the lane race and a Monitor, so the same settings
sample the same steps in both."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from amp_core.config import SamplingSettings


def next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` (> 0) at or after `step`."""
    return -(-step // every) * every


@dataclass(kw_only=True, frozen=True, slots=True)
class SamplingSchedule(SamplingSettings):
    """The shared settings (SamplingSettings: grad_norm_every, gradstats_every, memory_every) and what only one driver
    samples: `amax_every` the race's layer amax, `probe_budget` the Monitor's limit on costly probes."""

    amax_every: int = 0
    """Per-layer abs max on a shadow copy every N steps (RunConfig.amax_every); 0: never."""
    probe_budget: float = 0.0
    """Gradient statistics are taken only while they have cost at most this share of the loop's own time
    (MonitorConfig.probe_budget); 0: no limit."""

    @classmethod
    def of(cls, settings: SamplingSettings, **extra) -> SamplingSchedule:
        """The schedule of a RunConfig or MonitorConfig (`extra`: amax_every, probe_budget)."""
        shared = {f.name: getattr(settings, f.name) for f in dataclasses.fields(SamplingSettings)}
        return cls(**shared, **extra)

    def memory(self, step: int) -> bool:
        return step <= 1 or step % self.memory_every == 0

    def memory_window(self, step: int) -> bool:
        """The allocator's window is opened from step 1: step 0's first-call allocations (cuBLAS's workspace, the
        optimizer's state) belong to the process, not to the step."""
        return step >= 1 and self.memory(step)

    def grad_norm(self, step: int) -> bool:
        return step % self.grad_norm_every == 0

    def grad_stats(self, step: int) -> bool:
        return self.gradstats_every > 0 and step % self.gradstats_every == 0

    def amax(self, step: int) -> bool:
        return self.amax_every > 0 and step % self.amax_every == 0

    def next_full_step(self, step: int, also_every: Iterable[int] = ()) -> int:
        """The first step from `step` on that samples a figure (memory, gradient norm or statistics, layer amax), or
        acts every N steps of `also_every` (a run's replay snapshots): the steps before it may be plain ones."""
        if step <= 1:
            return step  # memory on steps 0 and 1
        everies = (self.memory_every, self.grad_norm_every, self.gradstats_every, self.amax_every, *also_every)
        return min(next_multiple(step, every) for every in everies if every > 0)

    def within_budget(self, probe_s: float, loop_s: float, next_s: float = 0.0) -> bool:
        """Whether a costly sampled probe may run, having taken `probe_s` of the loop's `loop_s` so far and being
        expected to take `next_s` (what it took last time): with it, still within the budget. (Judging by what was
        spent alone, each probe would overshoot by its own cost: a 24 ms probe in a 10 s loop is 0.24 %.)"""
        return not self.probe_budget or probe_s + next_s <= self.probe_budget * loop_s
