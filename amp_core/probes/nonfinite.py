"""The failing step itself, in attach mode: the first inf/NaN module of the step that failed is named in that step, not
the next one (in bf16 the failed step has already poisoned the weights, so the next one is useless). Two ways, chosen
by cost (`sentinel_for`):

- **Replayed before the update** (ForwardReplaySentinel: a device whose figures are on the host at once, a CPU, and
  one process). Only the outermost module calls of a step are watched (the model as the loop calls it; learnt during
  the first step, with hooks on every module; from then on by a wrapper of each outermost module's `forward`, or by
  two hooks where that forward is an instance attribute not bound to the module, as torch.compile's wrapper's is):
  before each, the inputs are kept by reference and the RNG state copied; after it, its floating outputs are summed
  and read (on a CPU a read waits for nothing). Only when an output holds inf/NaN is that forward run again at once,
  still inside the user's step, before backward and the optimizer change anything, with the same inputs, RNG state
  and autocast, under no_grad, with a hook on every leaf module (one with no children: the modules that compute) that
  finds the first whose output is not finite; it updates copies of the module buffers. A step costs one wrapper call
  (what two hook calls did, with no hook on the module, so `nn.Module.__call__` keeps its fast path), an RNG copy and
  a sum of the model's output, not a reduction per leaf. A model whose output holds inf/NaN on steps that do not fail
  (a masked logit) stops being replayed after a few such steps, and says so.
  Where the loop skips its failed steps (a GradScaler: `skips_failed_steps`), nothing is summed or read at all: a
  failed step is skipped, so the weights stay as its forward saw them, and each watched call is only kept as it began
  (inputs by reference, RNG state, autocast); when the Monitor records a skipped step, its calls are replayed in order,
  each under its autocast, and the first whose output is not finite is searched as above (a step whose outputs were
  all finite is left to the layer watch, as it would have got no replay). A step the optimizer took is not replayed
  there (the update changed the weights): a scaled step whose loss is not finite but whose gradients were is rare.
- **Device flags** (NonfiniteSentinel: CUDA, where a read is a sync, or a job of several ranks, whose forwards hold
  collectives a rank cannot replay alone). A forward hook on each leaf module reduces its floating output to one fp32
  sum on the device and keeps the 0-d tensor: one reduction kernel and a Python call per leaf per forward, no sync,
  no copy. Nothing is read until a step is known to have failed; then that step's sums are stacked and copied to the
  host once (a sync on CUDA, when the Monitor reads its figures anyway). The sums of the last `keep_steps` steps are
  kept (0-d tensors: a few hundred bytes per leaf and step). A false alarm needs a finite output whose fp32 sum
  overflows (|sum| > 3.4e38), which only a step that failed anyway reads.

Both check forward outputs only: a module whose forward stays finite while its gradient overflows (fp16's usual
skip) is left to the layer watch and the replay of the skipped step, which keep the state.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class FirstNonFinite:
    """The first leaf module, in the order their forwards finished, whose output held inf/NaN in a step."""

    step: int
    module: str
    forward_index: int
    """Its position among the step's leaf forwards (0: the first to finish)."""
    leaves_seen: int
    """Leaf forwards recorded in that step."""
    held: str
    """What its output held, read from the sum: "nan", or "inf" (a sum is inf only when an element is, or the sum of
    finite fp32 values passed 3.4e38)."""


def leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module with no children (the modules that compute), in registration order."""
    return [(name or "(root)", module) for name, module in model.named_modules()
            if not any(True for _ in module.children())]


def _held(value: float) -> str:
    return "nan" if math.isnan(value) else "inf"


class _Sentinel:
    """What both ways share: naming a failed step's first inf/NaN leaf once per streak of failed steps."""

    source = ""
    """How the module was found, for the event's data."""

    def __init__(self) -> None:
        self._last_failed: int | None = None
        self._streak_named = False

    def first(self, step: int, skipped: bool = False) -> FirstNonFinite | None:
        raise NotImplementedError

    def failed(self, step: int, why: str, skipped: bool = False) -> tuple[str, dict] | None:
        """Step `step` failed (`why`; `skipped`: the optimizer did not step, so the weights are as its forward saw
        them): (message, data) of the `first_nonfinite` event naming its first inf/NaN leaf; ("", {}) when it
        continues a run of failed steps already named (a model whose weights went NaN fails every step); None when
        nothing of that step is kept or no leaf's output held inf/NaN (the layer watch takes over)."""
        consecutive = self._last_failed is not None and step == self._last_failed + 1
        self._last_failed = step
        if consecutive and self._streak_named:
            return "", {}
        found = self.first(step, skipped)
        if found is None:
            self._streak_named = False
            return None
        self._streak_named = True
        message = (f"first inf/NaN: {found.module} (forward output) in the failing step itself (step {step}: {why}; "
                   f"leaf forward {found.forward_index + 1} of {found.leaves_seen}, {self.source})")
        return message, {"failed_step": step, "watched_step": step, "failure": why, "same_step": True,
                         "module": found.module, "phase": "forward", "source": self.source,
                         "after_amax": found.held}

    def did_not_fail(self, step: int) -> None:
        """Step `step` ended well."""

    def take_stopped(self) -> str:
        """Why the sentinel stopped looking, once (then ""); "" while it looks."""
        return ""

    def close(self) -> None:
        raise NotImplementedError


class NonfiniteSentinel(_Sentinel):
    """Per-leaf non-finite flags of the last few steps of `model` (the device flags: see the module's docstring).
    `step_of()` says which step a forward belongs to (a Monitor's steps_done); `close()` takes the hooks off."""

    source = "flagged on the device during the step"

    def __init__(self, model: nn.Module, step_of: Callable[[], int], keep_steps: int = 64):
        super().__init__()
        self._step_of = step_of
        self._keep = keep_steps
        self._steps: OrderedDict[int, list[tuple[int, torch.Tensor]]] = OrderedDict()
        leaves = leaf_modules(model)
        self.names = [name for name, _ in leaves]
        self._handles = [module.register_forward_hook(self._hook(index)) for index, (_, module) in enumerate(leaves)]

    def _hook(self, index: int):
        def record(module: nn.Module, args: tuple, output) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                step = self._step_of()
                sums = self._steps.get(step)
                if sums is None:
                    sums = self._steps[step] = []
                    while len(self._steps) > self._keep:
                        self._steps.popitem(last=False)
                # Kept on the device: read only if this step fails.
                sums.append((index, torch.sum(output.detach(), dtype=torch.float32)))
        return record

    def first(self, step: int, skipped: bool = False) -> FirstNonFinite | None:
        """The first leaf whose output held inf/NaN in `step` (None: none did, or the step is no longer kept). One
        host copy of the step's sums (a sync on CUDA): call it only for a step that failed."""
        sums = self._steps.get(step)
        if not sums:
            return None
        values = torch.stack([value for _, value in sums]).tolist()
        for position, ((index, _), value) in enumerate(zip(sums, values, strict=True)):
            if not math.isfinite(value):
                return FirstNonFinite(step=step, module=self.names[index], forward_index=position,
                                      leaves_seen=len(sums), held=_held(value))
        return None

    def held(self, step: int) -> bool:
        """Whether the sums of `step` are still kept."""
        return step in self._steps

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._steps.clear()


_rng_state = torch.default_generator.get_state
"""torch.get_rng_state without its Python frame (it returns this): the CPU generator's state, copied."""
RECHECK_DRAWS = 64
"""A sentinel whose watched calls drew no random numbers in the first step copies no RNG state before them, but
looks again (a copy before, a comparison after) every this many calls: a model set to train, or a dropout switched on,
later."""
_NONE = object()
"""A module with no instance `forward` (its class's runs)."""


def _finite_on_host(output) -> bool:
    """Whether every floating tensor in a forward's output (a tensor, or tuples, lists and dicts of them: a Hugging
    Face ModelOutput is a dict) holds only finite values: one sum each, read at once (a CPU waits for nothing). An
    fp16 output is summed in fp32, where a sum of finite fp16 values cannot overflow; any other in its own dtype (bf16
    has fp32's range: a cast to fp32 first would be a copy and two more ops each step, for sums within 0.4 % of the
    largest float; those read as a false alarm). `.data`: the alias a sum needs, made without the dispatcher (a
    `detach()` is an op of its own); `.item()`: a tensor's `__float__` takes more Python on the way to the same read."""
    if isinstance(output, torch.Tensor):
        if not output.is_floating_point():
            return True
        return math.isfinite((output.data.sum(dtype=torch.float32) if output.dtype is torch.float16 else
                              output.data.sum()).item())
    if isinstance(output, (tuple, list)):
        return all(_finite_on_host(item) for item in output)
    if isinstance(output, dict):
        return all(_finite_on_host(item) for item in output.values())
    return True


class ForwardReplaySentinel(_Sentinel):
    """The first inf/NaN leaf of a failed step, found by running the step's forward again, before the update, when
    its output was not finite (see the module's docstring). `step_of()`: which step a forward belongs to."""

    source = "its forward replayed in the step, before the update"
    FALSE_ALARMS = 3
    """False alarms (replays that named no module, or of steps that did not fail) before replaying stops: a model
    whose output holds inf/NaN by design."""

    def __init__(self, model: nn.Module, step_of: Callable[[], int], keep_steps: int = 64, *,
                 skips_failed_steps: bool = False):
        super().__init__()
        self._step_of, self._keep, self._model = step_of, keep_steps, model
        self.skips_failed_steps = skips_failed_steps
        """The loop skips its failed steps (a GradScaler's: the optimizer does not step), so after one the weights
        are still those its forward saw: each watched call is only kept as it began (inputs by reference, RNG state,
        autocast) and replayed when the step is known to have been skipped (`first(step, skipped=True)`); nothing is
        summed or read on a step. False: each watched call's output is summed and read at once, and replayed before
        the update when it is not finite (in bf16 or fp32 a failed step updates the weights with NaN)."""
        self._kept_step: int | None = None
        self._kept: list[tuple] = []
        """With skips_failed_steps, the watched calls of step `_kept_step` as they began: (module, args, kwargs, RNG
        state, autocast on, autocast dtype); dropped at the next step's first call, or by its replay."""
        self._device_type = next((p.device.type for p in model.parameters()), "cpu")
        """Whose autocast state a kept call takes (a replay after the step runs outside the loop's autocast)."""
        self._found: OrderedDict[int, FirstNonFinite | None] = OrderedDict()
        """The replays' answers by step (None: the output was not finite, but no leaf's was)."""
        self.false_alarms = 0
        """Replays that named no module, or of steps that did not fail."""
        self.stopped = self._unsaid = ""
        """Why replaying stopped (empty while it goes on)."""
        self._depth = 0
        """Watched module calls under way (the wrapper's try/finally, or a forward hook that always runs even when
        the forward raises, keeps it), plus one while a replay runs: nothing is watched while it is not 0."""
        self.draws = False
        """The watched calls draw random numbers (dropout): each copies the RNG state as it begins, for its replay.
        Learnt in the first step (the state compared before and after each outermost call) and looked at again every
        RECHECK_DRAWS calls; while False no state is copied (a cold copy of the CPU generator's 5 KB costs ~10 us a
        step) and a replay runs from the state as it finds it: the same numbers, as the call drew none."""
        self._calls = 0
        self._drew_from: torch.Tensor | None = None
        """The RNG state before the outermost call under way, while it is being compared (first step, rechecks)."""
        self._first_step: int | None = None
        self._tops: set[int] = set()
        """The modules the loop calls outermost, learnt during the first step (every module hooked meanwhile): the
        model itself, or the modules a Lightning training_step calls; from the next step only they are watched."""
        self._pending: tuple | None = None
        self._wrapped: list[tuple[nn.Module, object, types.MethodType]] = []
        """(module, the instance `forward` it had before, or _NONE, the wrapper) of every wrapped module."""
        self._leftover = None
        """The post-hook of the call during which the wrappers were put on (`_settle`), until that call ends."""
        self._handles = self._hook(model.modules(), self._learn)

    def _hook(self, modules, before) -> list:
        handles = []
        for module in modules:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(self._after, with_kwargs=True, always_call=True))
        return handles

    def _learn(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The first step's pre-hook, on every module: which are called outermost, and whether they draw random
        numbers (`draws`: the RNG state compared at the end of the call, `_after`)."""
        if self._depth == 0:
            step = self._step_of()
            if self._first_step is None:
                self._first_step = step
            self._tops.add(id(module))
            if step != self._first_step:
                self._settle(module)
            elif not self.draws:
                self._drew_from = _rng_state()
        self._before(module, args, kwargs)

    def _rng_before(self) -> torch.Tensor | None:
        """The RNG state an outermost watched call begins with, copied where it draws random numbers (or to look
        again whether it does, every RECHECK_DRAWS calls); None where it draws none. (Inline in the wrappers.)"""
        if self.draws:
            return _rng_state()
        self._calls += 1
        return None if self._calls % RECHECK_DRAWS else self._recheck()

    def _recheck(self) -> torch.Tensor:
        """Every RECHECK_DRAWS calls of a sentinel that copies no RNG state: the state before this call, copied, to
        compare at its end (`_drew`)."""
        self._drew_from = _rng_state()
        return self._drew_from

    def _drew(self) -> None:
        """At the end of an outermost call whose RNG state before it was kept to compare: did it draw?"""
        before, self._drew_from = self._drew_from, None
        if before is not None and not torch.equal(before, _rng_state()):
            self.draws = True

    def _settle(self, calling: nn.Module) -> None:
        """After the first step: the outermost modules only, each through a wrapper of its `forward` (`_wrap`), or
        hooked where its forward cannot be wrapped. Called from the pre-hook of `calling`, one of them, whose call has
        already taken its forward: a wrapped `calling` gets back a post-hook for the end of this call (a post-hook
        registered now runs then), which `_after` removes."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._model.modules():
            if id(module) in self._tops and not self._wrap(module):
                self._handles += self._hook((module,), self._before)
        if any(owner is calling for owner, _, _ in self._wrapped):
            self._leftover = calling.register_forward_hook(self._after, with_kwargs=True, always_call=True)

    def _wrap(self, module: nn.Module) -> bool:
        """Watch `module`'s calls by an instance `forward` that calls the one it had (the class's, or an instance
        forward bound to it, as accelerate's fp32-output wrapper is); False, wrapping nothing, for any other instance
        forward. Why not hooks: a module with a forward hook leaves `nn.Module.__call__`'s fast path for ~60 lines of
        Python per call, run with cold caches right after the last step's work: most of what the sentinel cost a
        plain step. Bound with types.MethodType, so `copy.deepcopy` binds the copy's to the copy, which then runs its
        own forward and reports nothing (the attached replay and the bisect copy the user's model)."""
        previous = module.__dict__.get("forward", _NONE)
        if previous is _NONE:  # the class's own function (not a staticmethod, a property or a callable object)
            inner = inspect.getattr_static(type(module), "forward", None)
        elif isinstance(previous, types.MethodType) and previous.__self__ is module:
            inner = previous.__func__
        else:
            return False
        if not isinstance(inner, types.FunctionType):
            return False
        sentinel, rng_state, finite, isfinite, tensor = self, _rng_state, _finite_on_host, math.isfinite, torch.Tensor
        recheck, bf16, fp32, step_of, device_type = self._recheck, torch.bfloat16, torch.float32, self._step_of, \
            self._device_type
        autocast_on, autocast_dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

        if self.skips_failed_steps:
            @functools.wraps(inner)  # __wrapped__: inspect.signature(module.forward) is the real one (HF Trainer)
            def forward(self, *args, **kwargs):
                if self is not module or sentinel._depth or sentinel.stopped:  # a copy, a nested call, a replay
                    return inner(self, *args, **kwargs)
                # `_keep_call` inline (a call less per step): the call as it began, nothing summed or read.
                step = step_of()
                if step != sentinel._kept_step:
                    sentinel._kept_step, sentinel._kept = step, []
                if sentinel.draws:  # `_rng_before` inline
                    rng = rng_state()
                else:
                    sentinel._calls = calls = sentinel._calls + 1
                    rng = None if calls % RECHECK_DRAWS else recheck()
                sentinel._kept.append((self, args, kwargs, rng, autocast_on(device_type), autocast_dtype(device_type)))
                sentinel._depth = 1
                try:
                    return inner(self, *args, **kwargs)
                finally:
                    sentinel._depth = 0
                    if sentinel._drew_from is not None:
                        sentinel._drew()
        else:
            @functools.wraps(inner)  # __wrapped__: inspect.signature(module.forward) is the real one (HF Trainer)
            def forward(self, *args, **kwargs):
                if self is not module or sentinel._depth:  # a copy, a nested call, a replay
                    return inner(self, *args, **kwargs)
                # By reference: the loop holds its batch for the step anyway. The RNG state is what dropout draws from
                # (copied only where the calls draw: `draws`; `_rng_before` inline).
                if sentinel.draws:
                    rng = rng_state()
                else:
                    sentinel._calls = calls = sentinel._calls + 1
                    rng = None if calls % RECHECK_DRAWS else recheck()
                sentinel._depth = 1
                try:
                    output = inner(self, *args, **kwargs)
                finally:
                    sentinel._depth = 0
                    if sentinel._drew_from is not None:
                        sentinel._drew()
                if sentinel.stopped:
                    return output
                # `_finite_on_host`, its usual case (one plain fp32 or bf16 tensor) inline: a call less per step.
                if type(output) is tensor and ((dtype := output.dtype) is fp32 or dtype is bf16):
                    if not isfinite(output.data.sum().item()):
                        sentinel._nonfinite(self, args, kwargs, rng)
                elif not finite(output):
                    sentinel._nonfinite(self, args, kwargs, rng)
                return output

        module.forward = wrapper = types.MethodType(forward, module)
        self._wrapped.append((module, previous, wrapper))
        return True

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._depth == 0:
            if self.skips_failed_steps:
                self._keep_call(module, args, kwargs)
            else:
                # By reference: the loop holds its batch for the step anyway. The RNG state is what dropout draws from.
                self._pending = (args, kwargs, self._drew_from if self._drew_from is not None else self._rng_before())
        self._depth += 1

    def _keep_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A watched call as it begins, for a replay after a skipped step (skips_failed_steps): its inputs by
        reference (held until the next step's first call: the loop holds its batch for the step anyway), the RNG
        state (what dropout draws from) and the autocast around it."""
        if self.stopped:
            return
        step = self._step_of()
        if step != self._kept_step:
            self._kept_step, self._kept = step, []
        device_type = self._device_type
        rng = self._drew_from if self._drew_from is not None else self._rng_before()
        self._kept.append((module, args, kwargs, rng, torch.is_autocast_enabled(device_type),
                           torch.get_autocast_dtype(device_type)))

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._drew_from is not None:
            self._drew()
        if self._leftover is not None:
            self._leftover.remove()
            self._leftover = None
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        if self.stopped or _finite_on_host(output):
            return
        self._nonfinite(module, *pending)

    def _nonfinite(self, module: nn.Module, args: tuple, kwargs: dict, rng: torch.Tensor | None) -> None:
        """A watched call's output held inf/NaN: replay it (once per step) to find the first leaf that did."""
        step = self._step_of()
        if step in self._found:  # a later forward of the same step (gradient accumulation): the first one counts
            return
        self._answer(step, self._replay(module, args, kwargs, rng)[0])

    def _answer(self, step: int, found: FirstNonFinite | None) -> None:
        """What the replay of `step`'s first non-finite call found (None: no leaf's output was not finite)."""
        self._found[step] = found
        if found is None:
            self._false_alarm()
        while len(self._found) > self._keep:
            self._found.popitem(last=False)

    def _replay_kept(self, step: int) -> None:
        """A skipped step's kept calls replayed in order, each under the autocast it ran in (the Monitor calls this
        outside the loop's), up to the first whose output is not finite, which is answered as `_nonfinite` would
        have at once; a step whose outputs were all finite gets no answer (the layer watch takes over), as it would
        have got no replay."""
        kept, self._kept, self._kept_step = self._kept, [], None
        for module, args, kwargs, rng, autocast_on, autocast_dtype in kept:
            with torch.autocast(self._device_type, dtype=autocast_dtype, enabled=autocast_on):
                found, output_finite = self._replay(module, args, kwargs, rng)
            if not output_finite:
                self._answer(step, found)
                return

    def _replay(self, module: nn.Module, args: tuple, kwargs: dict,
                rng: torch.Tensor | None) -> tuple[FirstNonFinite | None, bool]:
        """`module`'s forward again, as it ran (inputs, RNG, the autocast around it), no graph, with a hook on each
        leaf: the first leaf whose output is not finite, and whether the call's output was finite. The RNG and module
        buffers are put back afterwards."""
        leaves = leaf_modules(module)
        seen: list[tuple[int, float]] = []

        def watch(index: int):
            def record(_module: nn.Module, _args: tuple, output) -> None:
                if isinstance(output, torch.Tensor) and output.is_floating_point():
                    seen.append((index, output.detach().sum(dtype=torch.float32).item()))
            return record

        handles = [leaf.register_forward_hook(watch(index)) for index, (_, leaf) in enumerate(leaves)]
        # The replay updates copies of the buffers (BatchNorm's statistics): the originals are not even written to,
        # since the step's backward may still need them at the version it saved.
        buffers = [(owner, name, buffer) for owner in module.modules() for name, buffer in
                   owner.named_buffers(recurse=False)]
        after = torch.get_rng_state()
        depth = self._depth
        self._depth = depth + 1  # nothing is watched while the replay runs
        try:
            for owner, name, buffer in buffers:
                setattr(owner, name, buffer.clone())
            if rng is not None:  # None: the call drew no random numbers (`draws`), so any state gives its numbers
                torch.set_rng_state(rng)
            with torch.no_grad():
                output_finite = _finite_on_host(module(*args, **kwargs))
        finally:
            self._depth = depth
            torch.set_rng_state(after)
            for owner, name, buffer in buffers:
                setattr(owner, name, buffer)
            for handle in handles:
                handle.remove()
        prefix = self._prefix(module)
        for position, (index, value) in enumerate(seen):
            if not math.isfinite(value):
                name = leaves[index][0]
                return FirstNonFinite(step=self._step_of(), module=prefix + name if name != "(root)" else
                                      (prefix.rstrip(".") or "(root)"), forward_index=position,
                                      leaves_seen=len(seen), held=_held(value)), output_finite
        return None, output_finite

    def _prefix(self, module: nn.Module) -> str:
        """`module`'s name in the model, with a dot ("" for the model itself)."""
        for name, candidate in self._model.named_modules():
            if candidate is module:
                return f"{name}." if name else ""
        return ""

    def first(self, step: int, skipped: bool = False) -> FirstNonFinite | None:
        """The first leaf whose output held inf/NaN in `step`, if its forward's output did (None otherwise, or the
        step is no longer kept). With skips_failed_steps, a `skipped` step's kept calls are replayed now (the
        weights are still those they saw); a step the optimizer took has nothing to replay."""
        if skipped and step == self._kept_step and step not in self._found and not self.stopped:
            self._replay_kept(step)
        return self._found.get(step)

    def did_not_fail(self, step: int) -> None:
        """Step `step` ended well: a replay of it that named a module was a false alarm (one that named none is
        counted when it ran)."""
        if self._found.get(step) is not None:
            self._false_alarm()

    def _false_alarm(self) -> None:
        self.false_alarms += 1
        if self.false_alarms == self.FALSE_ALARMS:
            self.stopped = self._unsaid = (
                f"the model's output held inf/NaN in {self.false_alarms} steps where no module's did or that did not "
                "fail (a masked value?): the failing step's first inf/NaN module is no longer looked for in the step "
                "itself; the layer watch names it at the next step")

    def take_stopped(self) -> str:
        said, self._unsaid = self._unsaid, ""
        return said

    def held(self, step: int) -> bool:
        """Whether a replay's answer for `step` is kept."""
        return step in self._found

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._leftover is not None:
            self._leftover.remove()
            self._leftover = None
        for module, previous, wrapper in self._wrapped:
            if module.__dict__.get("forward") is wrapper:  # not replaced since by someone else: theirs stays
                if previous is _NONE:
                    del module.forward
                else:
                    module.forward = previous
        self._wrapped = []
        self._found.clear()
        self._kept, self._kept_step = [], None


def sentinel_for(model: nn.Module, step_of: Callable[[], int], *, host_reads_free: bool, ranks: int,
                 skips_failed_steps: bool = False) -> _Sentinel:
    """The cheaper way for this loop (the module's docstring): replayed where reading a sum costs no sync and one
    process can run a forward alone (after the step where the loop skips its failed steps, else before the update),
    else device flags."""
    if host_reads_free and ranks == 1:
        return ForwardReplaySentinel(model, step_of, skips_failed_steps=skips_failed_steps)
    return NonfiniteSentinel(model, step_of)
