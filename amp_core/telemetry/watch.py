"""What an optimizer tells about its step, read through its step hooks (no host sync): the LR it used, whether
GradScaler let it step, and a fused optimizer's found-inf flag."""

from __future__ import annotations

from collections.abc import Callable

import torch

from amp_core.torch_private import found_inf_flag, supports_amp_scaling


class OptimizerWatch:
    """Hooks on one optimizer and its scaler (None or disabled: no scaler).

    Skips: GradScaler calls `optimizer.step()` only when the gradients were finite, so a step that the pre-hook did
    not see was skipped, known on the host with no read of found-inf. A fused optimizer (`supports_amp_scaling`) is
    always called and skips on the device: its found-inf flag (a device tensor) is kept for the step's figures and
    the skip is known when they reach the host (`skipped` answers None), or now at the cost of a sync
    (`skipped_now`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, *,
                 unscaled_too: bool = True, see_update: bool = False):
        """`unscaled_too=False`: with no scaler, hook nothing (an unscaled optimizer steps every time; `stepped` and
        `lr_used` then stay as they are: for a caller that reads neither, the runner's lanes). `see_update`: see
        GradScaler's `update` too (`_hook_update`: a Monitor, which does not know where in the iteration the loop
        clears its gradients)."""
        self.optimizer = optimizer
        self.scaled = scaler is not None and scaler.is_enabled()
        self.fused = self.scaled and supports_amp_scaling(optimizer)
        self.stepped = False
        """The optimizer stepped since `begin`."""
        self.found_inf: torch.Tensor | None = None
        """A fused optimizer's found-inf flag of the last step (a device tensor)."""
        self.lr_used = float(optimizer.param_groups[0]["lr"])
        """The LR the optimizer held as its last step began."""
        # One pre-hook, no post-hook: a hook is a Python call inside the user's step (cold caches: microseconds), and
        # the step it sees begin is the step taken (GradScaler calls step() only to take it; an exception in the step
        # reaches the user's loop anyway).
        self._handles = [optimizer.register_step_pre_hook(self._before)] if self.scaled or unscaled_too else []
        self.capture: Callable[[bool], None] | None = None
        """Set by the owner for a step whose gradient figures it samples: called with `skipped` where the gradients
        surely exist (`_before`: after `unscale_`, before the update; on a step GradScaler skipped, as its `update`
        begins), whatever the loop does to them afterwards; None (every other step): nothing more is done."""
        self.on_skip: Callable[[bool], None] | None = None
        """Called (with True) as GradScaler's `update` begins on a step it skipped, when `capture` is not set."""
        self.skipped_seen = False
        """GradScaler's `update` ran on a step the optimizer did not take (a skip seen where it happened)."""
        self.steps_seen = 0
        """Optimizer steps seen in the run, taken or skipped (compared with the steps recorded, at a flush)."""
        self._scaler = scaler
        self._seen_update = None
        self._seen_at_update = 0
        if see_update and self.scaled and not self.fused:
            self._hook_update(scaler)

    def _before(self, optimizer, args, kwargs) -> None:
        self.stepped = True
        self.steps_seen += 1
        self.lr_used = float(optimizer.param_groups[0]["lr"])
        if self.fused:
            self.found_inf = found_inf_flag(optimizer)
        # `args` holds the optimizer, then step()'s own: a closure optimizer (LBFGS) computes its gradients inside
        # the step, so the owner reads them after it.
        if self.capture is not None and (args[1] if len(args) > 1 else kwargs.get("closure")) is None:
            self.capture(False)

    def _hook_update(self, scaler: torch.amp.GradScaler) -> None:
        """GradScaler's `update`, seen first: a step it skipped (the optimizer's pre-hook did not fire) still has its
        gradients there (the loop clears them after `update`), and the LR it would have stepped with. One Python call
        more per step in a scaled loop (bench.monitor_overhead's digits_mlp:16-mixed measures it with the rest)."""
        update = scaler.update

        def seen_update(new_scale=None):
            # No optimizer step since the last update: GradScaler skipped this one (counted, not read from the
            # `stepped` flag, which a Monitor.step between the scaler's step and its update would have reset).
            if self.steps_seen == self._seen_at_update:
                self.skipped_seen = True
                self.steps_seen += 1
                self.lr_used = float(self.optimizer.param_groups[0]["lr"])
                take = self.capture or self.on_skip
                if take is not None:
                    take(True)
            self._seen_at_update = self.steps_seen
            return update(new_scale)

        scaler.update = self._seen_update = seen_update  # an instance attribute over the method: `remove` takes it off

    def begin(self) -> None:
        """A new step begins: forget what the last one told."""
        self.stepped = False
        self.skipped_seen = False
        self.found_inf = None

    def skipped(self) -> bool | None:
        """Whether the step since `begin` was skipped; None when a fused optimizer decided on the device (read
        `found_inf` with the step's figures)."""
        if not self.scaled:
            return False
        if not self.fused:
            return not self.stepped
        return None if self.found_inf is not None else not self.stepped

    def skipped_now(self) -> bool:
        """`skipped`, reading a fused optimizer's flag now: on CUDA a host sync, made only where the host must know
        at once (an LR schedule follows only the steps really taken)."""
        skipped = self.skipped()
        return bool(self.found_inf.item() > 0) if skipped is None else skipped

    def remove(self) -> None:
        self.capture = self.on_skip = None
        if self._scaler is not None and vars(self._scaler).get("update") is self._seen_update:
            del self._scaler.update
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
