"""Replay in attach mode: a Monitor (and the Trainer and Lightning callbacks built on it) keeps a host copy of the
user's weights, buffers, optimizer state and loss scale before each step, and when a step fails (skipped by the
scaler, a non-finite loss, or a loss above the robust band) replays it from that copy with the step's batch and the
user's loss closure in the run's own mode, 32-true, the mixed 16-bit modes and float64, in the same process after the
step and outside its timed window, through the race's replay machinery (diagnostics.replay: `replay_modes`, `judge`).

What it costs, and when it is on (`MonitorConfig.replay`):
- "auto" (the default): skipped steps are replayed, at no cost to the other steps. A step the GradScaler skipped left
  the weights and the optimizer's state as they were before it (its optimizer step never ran): the state is copied
  then, and only then, and the scale it began with is the one after the back-off undone. On when the Monitor has a
  loss closure (the callbacks give theirs; a plain loop passes `loss_fn=`: without one nothing could be replayed) and
  the state is at most REPLAY_AUTO_MAX_BYTES (64 MiB: about 5M parameters with Adam's two fp32 moments: a replay
  forks it once per mode); off otherwise, with the reason and the bytes. A failure after which the optimizer did
  step (a loss that is not finite without a scaler, a loss above the robust band) needs the state from before the
  step, which "auto" does not keep: its event says so, and what replay=True would cost.
- True: the state before every step is copied, between `monitor.step()` and the next step's timed window, into host
  buffers allocated once (a memcpy of the state: on a CPU a few ms per 64 MiB; from a GPU into pinned memory without
  a wait), and every failed step (skipped, a loss not finite or above the band) is replayed. Its host time is said in
  the `replay_on` event and summed in each `replayed` event; the step's loss is read on the host each step to see a
  failure (free on a CPU; on CUDA a host sync, the one this setting adds). False: off.
- A failed step's replay forks the kept copy once per mode (a few forward + backward passes of the model): at most
  `replay_max` per run, and one per run of consecutive failed steps. The band's history is the run's recorded losses
  (read as records are made: nothing per step on the training path).
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from amp_core.config import ConfigError
from amp_core.diagnostics.replay_modes import (
    REPLAYED_EVENT,
    Fork,
    ReplayReport,
    ReplaySubject,
    judge,
    named_first,
    replay_modes,
    replay_targets,
    report_data,
)
from amp_core.imports import compiler_ready
from amp_core.precision import Precision, is_kept, keep_in_fp32
from amp_core.probes.numerics import prepare_batch, probe_step
from amp_core.probes.spikes import SpikeRule, loss_band
from amp_core.torch_private import foreach_copy_, scale_tensor, scaler_settings

REPLAY_AUTO_MAX_BYTES = 64 * 2**20
"""`replay="auto"` replays the skipped steps of a state (weights, buffers, optimizer state) at most this size."""
REPLAY_SETTINGS = ("auto", True, False)
ATTACHED_MODES = ("16-mixed", "bf16-mixed")
"""Besides the run's own mode (and the references 32-true and float64), what an attached step is replayed in: the
mixed modes a loop switches to with an autocast line (its weights and optimizer stay as they are)."""
REPLAY_ON_EVENT, REPLAY_OFF_EVENT, REPLAY_COST_EVENT = "replay_on", "replay_off", "replay_cost"
LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""The user's loss as a function of a model and a batch: `lambda model, batch: loss_fn(model(batch[0]), batch[1])`,
`lambda model, inputs: model(**inputs).loss`."""

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
               "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def detached_copy(model: nn.Module, without: tuple = ()) -> nn.Module:
    """A deep copy of `model` without its hooks (the Monitor's, a trainer callback's: they would copy their owners)
    and with None in place of the objects in `without` (a Lightning module's trainer: a copy must neither copy it
    nor log into it)."""
    memo: dict[int, Any] = {id(thing): None for thing in without if thing is not None}
    for module in model.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if isinstance(hooks, dict):
                memo[id(hooks)] = type(hooks)()
    return copy.deepcopy(model, memo)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, bool]:
    """(bytes of the weights, buffers and optimizer state, measured): an optimizer that has no state yet (Adam before
    its first step) is counted as two copies of the parameters it holds (Adam's moments), an estimate."""
    tensors = [*model.parameters(), *model.buffers()]
    held = sum(t.numel() * t.element_size() for t in tensors)
    state = [value for entry in optimizer.state.values() for value in entry.values() if isinstance(value, torch.Tensor)]
    if state:
        return held + sum(t.numel() * t.element_size() for t in state), True
    params = sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
    return held + 2 * params, False


def _mib(count: int) -> str:
    return f"{count / 2**20:.3g} MiB"


def optimizer_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """Each optimizer group's parameters as indices into the model's; ConfigError when the optimizer holds a
    parameter the model does not (a replay could not rebuild it)."""
    where = {id(p): index for index, p in enumerate(model.parameters())}
    missing = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in where]
    if missing:
        raise ConfigError("replay", f"the optimizer holds {len(missing)} parameters the model does not: a replay "
                                    "could not rebuild it")
    return [[where[id(p)] for p in group["params"]] for group in optimizer.param_groups]


class KeptState:
    """The loop's state before its next step, on the host: a copy of the model (hooks left out) whose tensors are
    overwritten each step, the optimizer's state tensors in buffers allocated once, its hyperparameters, the loss
    scale. `keep()` copies (no allocation once the optimizer's state exists); `fork(precision)` builds a model,
    optimizer and scaler from it in any precision."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                 without: tuple = ()):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.groups = optimizer_groups(model, optimizer)
        self.template = detached_copy(model, without).to("cpu")
        self.kept_fp32 = [name for name, module in self.template.named_modules() if is_kept(module)]
        """The modules the user's loop keeps in fp32 (`amp_core.fixes.keep_in_fp32`): their model's, kept in every
        replay of it."""
        self._cuda = any(t.is_cuda for t in model.parameters())
        targets = [*self.template.parameters(), *self.template.buffers()]
        if self._cuda:  # pinned: the device-to-host copies then need no wait
            for tensor in targets:
                tensor.data = tensor.data.pin_memory()
        self._targets = [t.detach() for t in targets]
        self._optimizer_buffers: dict[tuple[int, str], torch.Tensor] = {}
        self.optimizer_state: dict[int, dict[str, Any]] = {}
        self.hyper: list[dict[str, Any]] = []
        self.scale: torch.Tensor | float | None = None
        self.copy_s = 0.0
        self.copies = 0
        self.backed_off = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._targets) + sum(
            t.numel() * t.element_size() for t in self._optimizer_buffers.values())

    def keep(self, backed_off: bool = False) -> None:
        """Copy the state now (between two steps, outside the timed window). No host sync: on CUDA the copies are
        queued before the next step's work on the same stream, so they read the state before it. `backed_off`: the
        scaler has just backed off for a skipped step; the scale kept is the one the step began with."""
        started = time.perf_counter()
        self.backed_off = backed_off
        sources = [t.detach() for t in (*self.model.parameters(), *self.model.buffers())]
        self._copy(self._targets, sources)
        state: dict[int, dict[str, Any]] = {}
        pairs: tuple[list, list] = ([], [])
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            entry = self.optimizer.state.get(param)
            if not entry:
                continue
            kept = state[index] = {}
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    kept[key] = copy.copy(value)
                    continue
                buffer = self._optimizer_buffers.get((index, key))
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                    self._optimizer_buffers[(index, key)] = buffer
                pairs[0].append(buffer)
                pairs[1].append(value.detach())
                kept[key] = buffer
        self._copy(*pairs)
        self.optimizer_state = state
        self.hyper = [{key: value for key, value in group.items() if key != "params"}
                      for group in self.optimizer.param_groups]
        scale = scale_tensor(self.scaler)
        self.scale = scale.detach().to("cpu", non_blocking=True) if isinstance(scale, torch.Tensor) else scale
        self.copy_s += time.perf_counter() - started
        self.copies += 1

    def _copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        if not targets:
            return
        if self._cuda:
            for target, source in zip(targets, sources, strict=True):
                target.copy_(source, non_blocking=True)
        else:
            foreach_copy_(targets, sources)

    def scale_value(self) -> float | None:
        if self.scale is None:
            return None
        value = float(self.scale)  # a host read of the copy (on CUDA it waits for it: the replay's, after the step)
        # GradScaler.update multiplied a skipped step's scale by its backoff factor: undone, it is the step's own.
        return value / self.scaler.get_backoff_factor() if self.backed_off else value

    def fork(self, precision: Precision, scale: float | None) -> tuple[nn.Module, torch.optim.Optimizer,
                                                                       torch.amp.GradScaler]:
        """The kept state in `precision`: the model cast and moved to the device, an optimizer of the user's class
        with the same groups, hyperparameters and state (cast to the parameters' dtype), a scaler at `scale`."""
        if self._cuda:
            torch.cuda.synchronize()  # the kept copies have landed (the replay's wait, after the step)
        model = precision.prepare_module(copy.deepcopy(self.template))
        # Preparing for a recipe drops the keeps it does not name: the loop's own are put back, but not in the float64
        # reference (a keep computes in fp32, below what the reference computes in).
        if self.kept_fp32 and precision.param_dtype != torch.float64:
            keep_in_fp32(model, [*self.kept_fp32, *precision.keep_patterns])
        params = list(model.parameters())
        groups = [{**hyper, "params": [params[index] for index in indices]}
                  for hyper, indices in zip(self.hyper, self.groups, strict=True)]
        compiler_ready()  # torch's Optimizer imports torch._dynamo itself on a first build: through the gate instead
        optimizer = type(self.optimizer)(groups)
        numbered, start = [], 0
        for hyper, indices in zip(self.hyper, self.groups, strict=True):
            numbered.append({**hyper, "params": list(range(start, start + len(indices)))})
            start += len(indices)
        state = {index: {key: value.clone() if isinstance(value, torch.Tensor) else value
                         for key, value in entry.items()} for index, entry in self.optimizer_state.items()}
        optimizer.load_state_dict({"state": state, "param_groups": numbered})
        settings = scaler_settings(self.scaler) if self.scaler is not None else {}
        scaler = precision.make_scaler(**{**settings, **({"init_scale": scale} if scale is not None else {})})
        return model, optimizer, scaler


class AttachedSubject(ReplaySubject):
    """A Monitor's failed step: the kept state, the step's batch and the user's loss closure."""

    def __init__(self, kept: KeptState, batch: Any, loss_fn: LossFn, own_mode: str, device: str, grad_clip: float):
        self.kept, self.batch, self.loss_fn, self.grad_clip = kept, batch, loss_fn, grad_clip
        self.own_mode, self.device = own_mode, device
        self.own_scale = kept.scale_value()

    def fork(self, name: str, precision: Precision) -> Fork:
        scale = self.own_scale if precision.uses_scaler else None
        source = ("" if not precision.uses_scaler else "the loop's own scaler" if scale is not None
                  else "a new GradScaler's initial scale")
        model, optimizer, scaler = self.kept.fork(precision, scale)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        batch = prepare_batch(precision, self.batch)

        def step() -> tuple[float, bool, float | None, float | None]:
            with precision.step_context():
                optimizer.zero_grad(set_to_none=True)
                with precision.forward_context():
                    loss = self.loss_fn(model, batch)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                finite = all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
                if self.grad_clip and finite:  # the loop's clipping (a non-finite norm is left: the step skips)
                    torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
                used = scaler.get_scale() if scaler.is_enabled() else None
                scaler.step(optimizer)
                scaler.update()
                after = scaler.get_scale() if scaler.is_enabled() else None
            return float(loss.detach().float()), scaler.is_enabled() and not finite, used, after

        return Fork(model, params, step, source)

    def first_nonfinite(self, precision: Precision, scale: float | None) -> tuple[str, str]:
        weights = copy.deepcopy(self.kept.template).float()
        return named_first(probe_step(weights, precision, None, self.batch, scale=scale, closure=self.loss_fn,
                                 copy_model=False).first_nonfinite)


class AttachedReplay:
    """A Monitor's replays: whether they are on (and why), the kept state, the loss history for the band, and the
    replay of a failed step. See the module's docstring."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                 setting: str | bool, max_replays: int, rule: SpikeRule | None = None, without: tuple = (),
                 has_loss_fn: bool = True):
        self.rule = rule or SpikeRule()
        self.max_replays = max_replays
        self.bytes, measured = state_bytes(model, optimizer)
        size = _mib(self.bytes) + ("" if measured else ", estimated: the optimizer has no state yet")
        self.kept: KeptState | None = None
        """The host copy (replay=True: from the start; "auto": from the first skipped step)."""
        self._on = False
        self._make: Callable[[], KeptState] | None = None
        if setting is False:
            self.why = f"replay is off (replay=False); keeping the state before each step would copy {size} each step"
        elif setting == "auto" and not has_loss_fn:
            self.why = (f"replay is off: replay='auto' keeps the state before each step ({size}) only for a loop that "
                        "gives the Monitor a loss_fn (without one no step could be replayed); "
                        "Monitor(..., loss_fn=...) turns it on")
        elif setting == "auto" and self.bytes > REPLAY_AUTO_MAX_BYTES:
            self.why = (f"replay is off: the model's state ({size}) is above replay='auto''s limit of "
                        f"{_mib(REPLAY_AUTO_MAX_BYTES)} (each step would copy it to the host); replay=True turns it on")
        else:
            try:
                if setting is True:
                    self.kept = KeptState(model, optimizer, scaler, without)
                else:  # "auto": the host copy is made at the first skipped step, not held all run long
                    optimizer_groups(model, optimizer)
                    self._make = lambda: KeptState(model, optimizer, scaler, without)
                self._on = True
            except Exception as exc:  # a diagnostic never stops the user's training: it says why it is off
                self.why = f"replay is off: the loop's state could not be copied for replays ({exc})"
        self.every_step = self.kept is not None
        """The state before every step is kept (replay=True); else only a skipped step's, when it skips ("auto")."""
        modes = f"its mode, 32-true, {', '.join(ATTACHED_MODES)} and float64"
        if self.every_step:
            self.why = (f"replay is on (replay=True): the state before each step ({size}) is copied to the host "
                        f"between steps, outside the timed window; a failed step is replayed in {modes}")
        elif self._on:
            self.why = (f"replay is on for skipped steps (replay=auto): a skipped step left the state ({size}) as it "
                        f"was before it, so it is copied then, and only then, and the step replayed in {modes}; a "
                        "loss not finite or above the band after the optimizer stepped needs the state from before "
                        f"the step: replay=True keeps it, copying {size} each step")
        self.setting = setting
        self.history: deque[tuple[int, float]] = deque(maxlen=self.rule.window + 1)
        """(step, loss) of the last recorded steps (the band's window), fed by `recorded`."""
        self.replays = 0
        self.last_failed: int | None = None
        self.missing_said = False

    @property
    def on(self) -> bool:
        return self._on

    def switch_off(self, why: str) -> None:
        """Off for the rest of the run (its own failure, amp_core.attach.guard): nothing more is kept or replayed."""
        self._on = self.every_step = False
        self.kept = self._make = None
        self.why = why

    def keep_skipped(self) -> None:
        """A skipped step left the state as it was before it: copy it now ("auto"; the copy is made the first time)."""
        if self.kept is None:
            self.kept = self._make()
        self.kept.keep(backed_off=True)

    def describe(self) -> dict[str, Any]:
        """What the run's config says of it."""
        return {"setting": self.setting, "on": self.on, "bytes": self.bytes, "auto_max_bytes": REPLAY_AUTO_MAX_BYTES,
                "max_replays": self.max_replays, "why": self.why}

    def keep(self) -> None:
        """Before each step: the state, when every step's is kept (replay=True)."""
        if self.every_step:
            self.kept.keep()

    def recorded(self, step: int, loss: float) -> None:
        """A step became a record (the Monitor's recorder: no read on the training path): its loss, for the band."""
        self.history.append((step, loss))

    def band_before(self, step: int):
        return loss_band([loss for recorded, loss in self.history if recorded < step], self.rule)

    def failure(self, step: int, loss: float | None, skipped: bool) -> str:
        """Why step `step` failed ('' if it did not; `loss` None: not read, only a skip can tell)."""
        if skipped:
            return "skipped by the scaler"
        if loss is None:
            return ""
        if not math.isfinite(loss):
            return f"loss {loss}"
        band = self.band_before(step)
        if band is not None and loss > band.upper:
            return f"loss {loss:.4g} above the band ({band.upper:.4g})"
        return ""

    def due(self, step: int) -> bool:
        """A failed step is replayed unless the run has had `max_replays`, or it continues a run of failed steps."""
        consecutive = self.last_failed is not None and step == self.last_failed + 1
        self.last_failed = step
        return not consecutive and self.replays < self.max_replays

    def replay(self, *, run_id: str, mode: str, step: int, loss: float, batch: Any, loss_fn: LossFn, device: str,
               grad_clip: float = 0.0) -> ReplayReport:
        """Step `step` (its batch, the user's loss closure) replayed from the kept state in every mode."""
        began = time.perf_counter()
        self.replays += 1
        notes: list[str] = []
        band = self.band_before(step)
        subject = AttachedSubject(self.kept, batch, loss_fn, mode, device, grad_clip)
        devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the replay's draws leave the loop's RNG as it was
            rows = replay_modes(subject, replay_targets((mode, *ATTACHED_MODES), device, notes), band, devices)
        if self.every_step:
            notes.append(f"the state before the step was kept by the Monitor ({_mib(self.kept.nbytes())} on the "
                         f"host, {self.kept.copy_s / max(self.kept.copies, 1) * 1e3:.3g} ms per step's copy)")
        else:
            notes.append(f"the step was skipped, so the state after it was the state before it: the Monitor copied "
                         f"it then ({_mib(self.kept.nbytes())} on the host, "
                         f"{self.kept.copy_s / max(self.kept.copies, 1) * 1e3:.3g} ms)")
        return ReplayReport(run_id=run_id, lane=0, mode=mode, step=step,
                            source="the Monitor's host copy of the loop's state before the step, in its process",
                            start_step=step, rows=rows, recorded_loss=loss, band=band, rule=self.rule, faults=[],
                            verdict=judge(rows, band, self.rule, []), notes=notes,
                            replay_s=time.perf_counter() - began)


class ReplayOnFailure:
    """A Monitor's replays as a hook of its loop: before each step's window, the state kept (replay=True); as each
    step is recorded, its loss for the band; after each step, a failed one replayed from the state kept before it, on
    the loop's thread between two windows, its report a `replayed` event.

    `event(kind, message, step, **data)` records an event of the run; `settle()` makes every step measured so far a
    record (a host sync on CUDA: only before a skipped step's replay, whose band is the losses before it)."""

    def __init__(self, replay: AttachedReplay, event: Callable[..., None], settle: Callable[[], None]):
        self.replay = replay
        self._event = event
        self._settle = settle

    def before_window(self) -> None:
        self.replay.keep()

    def say_setting(self) -> None:
        """As the run opens: its `replay_on` or `replay_off` event (the setting, why, what a kept copy costs)."""
        replay, kept = self.replay, self.replay.kept
        data = replay.describe()
        if kept is not None:
            data |= {"copy_ms": kept.copy_s / max(kept.copies, 1) * 1e3, "kept_bytes": kept.nbytes()}
        self._event(REPLAY_ON_EVENT if replay.on else REPLAY_OFF_EVENT, replay.why, None, **data)

    def say_cost(self) -> None:
        """As the run closes, when it kept any copy: what keeping the state before each step cost (`replay_cost`)."""
        replay, kept = self.replay, self.replay.kept
        if kept is not None and kept.copies:
            self._event(REPLAY_COST_EVENT, f"replay kept the state before each step: {kept.copies} host copies of "
                                           f"{kept.nbytes() / 2**20:.3g} MiB, {kept.copy_s / kept.copies * 1e3:.3g} ms "
                                           "each, outside the timed window", None, copies=kept.copies,
                        kept_bytes=kept.nbytes(), copy_ms=kept.copy_s / kept.copies * 1e3, replays=replay.replays)

    def recorded(self, track, result) -> None:
        """The recorder's on_record hook: the losses as they are recorded (no read on the training path)."""
        self.replay.recorded(result.step, result.loss)

    def after_step(self, *, run_id: str, mode: str, device: str, grad_clip: float, step: int, loss,
                   skipped: bool | None, batch: Any, loss_fn: LossFn | None, loss_on_host: float | None) -> None:
        """Step `step` ended (`loss_on_host`: its loss where the host has it at once, else None): replay it if it
        failed (skipped, a non-finite loss, a loss above the band)."""
        replay = self.replay
        if not replay.every_step and not skipped:
            # replay="auto": only a skipped step (known on the host) can be replayed without a copy before each step.
            if loss_on_host is not None and not math.isfinite(loss_on_host) and not replay.missing_said:
                replay.missing_said = True
                self._event(REPLAY_OFF_EVENT, f"step {step}'s loss is {loss_on_host} after the optimizer stepped: "
                                              "replaying it needs the state from before the step, which "
                                              "replay='auto' does not keep (replay=True: a copy before each step)",
                            step)
            return
        # The loss on the host: free on a CPU; on CUDA a host sync, made only with replay=True (its one cost beyond
        # the copy: a failure must be seen before the kept state is overwritten by the next step's) or on a skip.
        value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
        failure = replay.failure(step, value, bool(skipped))
        if not failure or not replay.due(step):
            return
        if batch is None or loss_fn is None:
            if not replay.missing_said:
                replay.missing_said = True
                self._event(REPLAY_OFF_EVENT, f"step {step} failed ({failure}) and was not replayed: pass the step's "
                                              "batch and a loss closure (monitor.step(loss, batch=..., "
                                              "loss_fn=...))", step)
            return
        try:
            if not replay.every_step:
                # The band is the recorded losses before this step: on CUDA the records still on their way are
                # waited for (a sync, on this skipped step only). The skip left the state as it was before the step.
                self._settle()
                replay.keep_skipped()
            report = replay.replay(run_id=run_id, mode=mode, step=step, loss=value, batch=batch, loss_fn=loss_fn,
                                   device=device, grad_clip=grad_clip)
        except Exception as exc:  # a diagnostic never stops the user's training: the event says what went wrong
            self._event(REPLAY_OFF_EVENT, f"step {step} failed ({failure}) and its replay failed: "
                                          f"{type(exc).__name__}: {exc}", step)
            return
        self._event(REPLAYED_EVENT, f"step {step} failed ({failure}), replayed in every mode: "
                                    f"{report.verdict.line()}", step, report=report_data(report))
