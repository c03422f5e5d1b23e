"""What an optimizer tells about its step, read through its step hooks (no host sync): the LR it used, whether
GradScaler let it step, and a fused optimizer's found-inf flag."""

from __future__ import annotations

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
                 unscaled_too: bool = True):
        """`unscaled_too=False`: with no scaler, hook nothing (an unscaled optimizer steps every time; `stepped` and
        `lr_used` then stay as they are: for a caller that reads neither, the runner's lanes)."""
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

    def _before(self, optimizer, args, kwargs) -> None:
        self.stepped = True
        self.lr_used = float(optimizer.param_groups[0]["lr"])
        if self.fused:
            self.found_inf = found_inf_flag(optimizer)

    def begin(self) -> None:
        """A new step begins: forget what the last one told."""
        self.stepped = False
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
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
