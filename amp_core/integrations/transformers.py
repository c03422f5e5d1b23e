"""AMP Lab for a Hugging Face `Trainer`: one callback, every optimizer step recorded (needs the `hf` extra).

    from amp_core.integrations.transformers import AmpLabCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[AmpLabCallback(name="my fine-tune")])
    trainer.train()

One record per optimizer step (gradient accumulation folded in) through a Monitor (amp_core.attach.monitor): the loss
the Trainer computed for the step (what it logs with logging_steps=1: the sum of its micro-batches' losses, each as the
Trainer scales it for accumulation; a non-finite one is recorded as it was, where the Trainer's logging_nan_inf_filter
would log an average instead), the LR the optimizer used, the gradient norm (fp32, every `grad_norm_every` steps, after
the Trainer's clipping to max_grad_norm), the scale and skipped steps of the Trainer's own GradScaler (fp16), memory.
Under torchrun every rank's callback measures its rank and rank 0 writes, as a Monitor does.

What really ran is recorded, not what was asked: the mode comes from the dtypes the model's layers produced in the
first forward and the scaler really present, and an event says so when the Trainer was asked for another (with
transformers 5.23 / accelerate 1.15, `fp16=True, use_cpu=True` applies no autocast: every op runs in fp32).
The callback adds no host sync: the loss stays a device tensor until the Monitor's flush.

Replays (MonitorConfig.replay, e.g. `AmpLabCallback(replay=True)`): the step's micro-batches are the inputs the model
was handed (a forward pre-hook), its loss `model(**inputs).loss` weighted as the Trainer weighs it, its clipping
`max_grad_norm`; a failed step is replayed from the Monitor's copy of the state before it (amp_core.probes.
attached_replay).
"""

from __future__ import annotations

import math
import os

import torch

from amp_core.attach.monitor import Monitor
from amp_core.imports import heavy_import
from amp_core.integrations.shared import USAGE_ERRORS, OpDtypes, callback_failed, note_what_ran

# Through the import gate: transformers imports torch's compiler stack, whose cycles two threads must not enter at once.
TrainerCallback = heavy_import("transformers").TrainerCallback

INTEGRATION = "Hugging Face Trainer"
TRAINER = "Hugging Face Trainer"
"""How a failure of this callback's own names it (amp_core.integrations.callback_failed)."""


def _asked_mode(args) -> str:
    """The mode the TrainingArguments ask for, in Lightning's names."""
    if args.fp16:
        return "16-mixed"
    if args.bf16:
        return "bf16-mixed"
    return "32-true"


class AmpLabCallback(TrainerCallback):
    """Records a Trainer's run into the AMP Lab store (see the module's docstring). `name`: the run's label; `store`:
    a RunStore or path (default $AMP_LAB_STORE); `settings`: MonitorConfig's fields (grad_norm_every, ...)."""

    def __init__(self, name: str = "", store=None, **settings):
        self.name, self.store, self.settings = name, store, settings
        self.monitor: Monitor | None = None
        self._losses: list[torch.Tensor] = []
        """The micro-batches' losses of the optimizer step under way, as the model returned them (device tensors)."""
        self._scaled_for_accumulation: list[bool] = []
        """Per micro-batch: the model was handed `num_items_in_batch`, so its loss is already normalised over the whole
        accumulated batch (the Trainer then does not divide it by the accumulation steps)."""
        self._samples = 0
        self._inputs: list[tuple[tuple, dict]] = []
        """The step's micro-batches (the model's positional and keyword inputs), kept for a replay when it is on."""
        self._handles: list = []
        self._op_dtypes: OpDtypes | None = None
        self._args = None
        self._optimizer = None
        self.off = False
        """The callback failed twice (or could not start): it records nothing more, the training goes on
        (amp_core.integrations.callback_failed)."""

    # --- the Trainer's events ----------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        try:
            self._begin(args, state, model, optimizer, lr_scheduler)
        except USAGE_ERRORS:
            raise
        except Exception as exc:
            callback_failed(self, exc, TRAINER)

    def _begin(self, args, state, model, optimizer, lr_scheduler) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the user's
        scaler = getattr(optimizer, "scaler", None)
        settings = {"total_steps": int(state.max_steps or 0), "integration": INTEGRATION, **self.settings}
        self.monitor = Monitor(model, inner, scaler, lr_scheduler, name=self.name, store=self.store,
                               loss_fn=_replayed_loss, **settings)
        self.monitor.grad_clip = float(args.max_grad_norm or 0.0)
        self._args, self._optimizer = args, optimizer
        self._op_dtypes = OpDtypes(model)
        self._handles = [model.register_forward_pre_hook(self._see_inputs, with_kwargs=True),
                         model.register_forward_hook(self._see_loss)]

    def on_optimizer_step(self, args, state, control, **kwargs):
        """After the optimizer's step (or the scaler's skip), before the scheduler and zero_grad: the gradients are
        still there for the Monitor's figures."""
        if self.monitor is None or self.off:
            return
        try:
            self._step(args)
        except Exception as exc:
            callback_failed(self, exc, TRAINER)
        self._losses, self._scaled_for_accumulation, self._samples, self._inputs = [], [], 0, []

    def _step(self, args) -> None:
        monitor = self.monitor
        if monitor.steps_done == 0:
            note_what_ran(monitor, _asked_mode(args), self._op_dtypes, getattr(self._optimizer, "scaler", None)
                          is not None)
            self._op_dtypes.remove()
        batch = None
        if monitor.replay_on:  # the step's micro-batches as the model was handed them, with their loss factors
            batch = [(args_, kwargs, factor) for (args_, kwargs), factor in zip(self._inputs, self._factors(),
                                                                                 strict=False)]
        monitor.step(self._step_loss(), samples=self._samples or None, batch=batch)

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.monitor is None:
            return
        self._op_dtypes.remove()
        self.monitor.close()  # raises nothing; after `off`, closed already

    # --- what the model is handed and returns --------------------------------------------------------------------
    def _see_inputs(self, module, args, kwargs) -> None:
        if self.off or not (module.training and torch.is_grad_enabled()):
            return
        try:
            self._keep_inputs(args, kwargs)
        except Exception as exc:  # inside the model's forward: never into it
            callback_failed(self, exc, TRAINER)

    def _keep_inputs(self, args, kwargs) -> None:
        self._scaled_for_accumulation.append(kwargs.get("num_items_in_batch") is not None)
        if self.monitor is not None and self.monitor.replay_on:
            self._inputs.append((args, kwargs))  # references: the Trainer is done with them after the step
        first = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
        self._samples += int(first.shape[0]) if first is not None and first.dim() else 0

    def _see_loss(self, module, args, output) -> None:
        if self.off or not (module.training and torch.is_grad_enabled()):
            return
        try:
            loss = output.get("loss") if isinstance(output, dict) else None
            if isinstance(loss, torch.Tensor):
                self._losses.append(loss.detach())
        except Exception as exc:  # inside the model's forward: never into it
            callback_failed(self, exc, TRAINER)

    def _step_loss(self) -> torch.Tensor | float:
        """The step's loss as the Trainer computes it (Trainer.training_step / compute_loss): a micro-batch's loss is
        divided by the micro-batches of the step unless the model normalised it over the accumulated batch, which is
        multiplied by the processes when the Trainer averages tokens across devices. Device ops only."""
        losses = self._losses
        if not losses:
            return math.nan  # the model returned no loss (the Trainer computed it from the outputs)
        return sum(loss.float() * factor for loss, factor in zip(losses, self._factors(), strict=True))

    def _factors(self) -> list[float]:
        """Per micro-batch of the step, what the Trainer multiplies its loss by (see `_step_loss`)."""
        args, count = self._args, max(len(self._losses), len(self._inputs))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        factors = [(world if args.average_tokens_across_devices else 1) if scaled else 1 / count
                   for scaled in self._scaled_for_accumulation[:count]]
        return factors + [1 / count] * (count - len(factors))


def _replayed_loss(model, micro_batches) -> torch.Tensor:
    """A replay's loss of one optimizer step: the model's loss on each micro-batch, weighted as the Trainer does."""
    return sum(model(*args, **kwargs).loss.float() * factor for args, kwargs, factor in micro_batches)
