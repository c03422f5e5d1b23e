"""Which steps take the sampled figures (memory, gradient norm, gradient statistics, layer amax): one schedule for
the lane race and a Monitor, so the same settings sample the same steps in both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingSchedule:
    """Every N steps of each sampled figure (RunConfig's and MonitorConfig's fields of the same names)."""

    grad_norm_every: int = 1
    """The gradient norm (fp32) every N steps (besides the steps whose figures need it: clipping, a skip)."""
    gradstats_every: int = 0
    """Gradient range histograms every N steps (and on skipped steps); 0: never."""
    memory_every: int = 25
    """Memory on steps 0, 1 and every N steps; the figures are carried between."""
    amax_every: int = 0
    """Per-layer abs max on a shadow copy every N steps; 0: never."""
    probe_budget: float = 0.0
    """Gradient statistics are taken only while they have cost at most this share of the loop's own time; 0: no
    limit."""

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

    def within_budget(self, probe_s: float, loop_s: float, next_s: float = 0.0) -> bool:
        """Whether a costly sampled probe may run, having taken `probe_s` of the loop's `loop_s` so far and being
        expected to take `next_s` (what it took last time): with it, still within the budget. (Judging by what was
        spent alone, each probe would overshoot by its own cost: a 24 ms probe in a 10 s loop is 0.24 %.)"""
        return not self.probe_budget or probe_s + next_s <= self.probe_budget * loop_s
