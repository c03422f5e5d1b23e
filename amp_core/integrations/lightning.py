"""AMP Lab for a Lightning `Trainer`: one callback, every optimizer step recorded (needs the `lightning` extra).

    from amp_core.integrations.lightning import AmpLabCallback

    trainer = L.Trainer(max_steps=500, callbacks=[AmpLabCallback(name="my module")])
    trainer.fit(module, loader)

One record per optimizer step (accumulate_grad_batches folded in) through a Monitor (amp_core.attach.monitor): the loss
(the sum of the step's batches' losses as Lightning backpropagates them, each divided by accumulate_grad_batches),
the LR the optimizer used, the gradient norm (fp32, every `grad_norm_every` steps, after Lightning's gradient
clipping), the scale and skipped steps of the precision plugin's GradScaler when it has one, memory. The callback
reads the precision plugin (its mode, its scaler) and records the mode the ops really ran in: an event says so when
it differs from the plugin's, and when fp16 runs without loss scaling (no GradScaler: e.g. "16-true"). Lightning
2.6 itself turns precision="16-mixed" on a CPU into "bf16-mixed" (with a warning) before any callback sees it, so such
a run is recorded as the bf16-mixed it is. No host sync is added: the loss stays a device tensor until a flush.

Replays (MonitorConfig.replay, e.g. `AmpLabCallback(replay=True)`): the step's batches come from
`on_train_batch_start`, its loss from `training_step` on the replay's copy of the module (which has no trainer: a
`self.log` there warns and logs nothing), its clipping from `gradient_clip_val`.
"""

from __future__ import annotations

import torch

from amp_core.attach.guard import reason
from amp_core.attach.monitor import Monitor
from amp_core.imports import heavy_import
from amp_core.integrations.shared import USAGE_ERRORS, OpDtypes, callback_failed, note_what_ran

# Through the import gate: Lightning imports torch's compiler stack, whose cycles two threads must not enter at once.
Callback = heavy_import("lightning.pytorch.callbacks").Callback

INTEGRATION = "Lightning"
TRAINER = "Lightning"
"""How a failure of this callback's own names it (amp_core.integrations.callback_failed)."""


class AmpLabCallback(Callback):
    """Records a Lightning run into the AMP Lab store (see the module's docstring). `name`: the run's label; `store`:
    a RunStore or path (default $AMP_LAB_STORE); `settings`: MonitorConfig's fields (grad_norm_every, ...)."""

    def __init__(self, name: str = "", store=None, **settings):
        self.name, self.store, self.settings = name, store, settings
        self.monitor: Monitor | None = None
        self._losses: list[torch.Tensor] = []
        """The batches' losses of the optimizer step under way (device tensors, as Lightning returned them)."""
        self._samples = 0
        self._batches: list = []
        """(batch, batch_idx) of the optimizer step under way, kept for a replay when replays are on."""
        self._stepping = False
        self._op_dtypes: OpDtypes | None = None
        self._plugin = None
        self.off = False
        """The callback failed twice (or could not start): it records nothing more, the training goes on
        (amp_core.integrations.callback_failed)."""

    def on_train_start(self, trainer, pl_module) -> None:
        try:
            self._start(trainer, pl_module)
        except USAGE_ERRORS:
            raise
        except Exception as exc:
            callback_failed(self, exc, TRAINER)

    def _start(self, trainer, pl_module) -> None:
        plugin = trainer.precision_plugin
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        settings = {"total_steps": max(int(trainer.max_steps), 0), "integration": INTEGRATION, **self.settings}
        self.monitor = Monitor(pl_module, trainer.optimizers[0], getattr(plugin, "scaler", None), scheduler,
                               name=self.name, store=self.store, loss_fn=_replayed_loss, replay_without=(trainer,),
                               **settings)
        if trainer.gradient_clip_algorithm in (None, "norm"):
            self.monitor.grad_clip = float(trainer.gradient_clip_val or 0.0)
        self._plugin = plugin
        self._op_dtypes = OpDtypes(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.monitor is not None and not self.off and self.monitor.replay_on:
            self._batches.append((batch, batch_idx))  # a reference: kept for a replay of this step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepping = True  # this batch ends an optimizer step (the scaler may still skip it)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.monitor is None or self.off:
            return
        try:
            self._batch_end(outputs, batch)
        except Exception as exc:
            callback_failed(self, exc, TRAINER)
            self._losses, self._samples, self._stepping, self._batches = [], 0, False, []

    def _batch_end(self, outputs, batch) -> None:
        monitor = self.monitor
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        first = next((value for value in (batch if isinstance(batch, (list, tuple)) else [batch])
                      if isinstance(value, torch.Tensor)), None)
        self._samples += int(first.shape[0]) if first is not None and first.dim() else 0
        if not self._stepping:
            return
        if monitor.steps_done == 0:
            note_what_ran(monitor, str(getattr(self._plugin, "precision", "")), self._op_dtypes,
                          getattr(self._plugin, "scaler", None) is not None)
            self._op_dtypes.remove()
        step_loss = sum(self._losses) if self._losses else float("nan")
        monitor.step(step_loss, samples=self._samples or None, batch=self._batches or None)
        self._losses, self._samples, self._stepping, self._batches = [], 0, False, []

    def on_train_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self._op_dtypes.remove()
            self.monitor.close()  # raises nothing; after `off`, closed already

    def on_exception(self, trainer, pl_module, exception) -> None:
        """The training stopped with an exception (Lightning raises it on): interrupted for a KeyboardInterrupt,
        failed otherwise, with the reason."""
        if self.monitor is not None:
            self._op_dtypes.remove()
            if isinstance(exception, KeyboardInterrupt):
                self.monitor.close("interrupted", "the training was interrupted (KeyboardInterrupt)")
            else:
                self.monitor.close("failed", f"the Trainer raised {reason(exception)}")


def _replayed_loss(module, batches) -> torch.Tensor:
    """A replay's loss of one optimizer step: the module's training_step on each of its batches (on the replay's copy
    of the module, which has no trainer to log into), averaged as Lightning accumulates them."""
    losses = [module.training_step(batch, batch_idx) for batch, batch_idx in batches]
    losses = [loss["loss"] if isinstance(loss, dict) else loss for loss in losses]
    return sum(loss.float() for loss in losses) / len(losses)
