"""The failing step itself in attach mode: the Monitor names the first inf/NaN module of the step that failed (on a CPU
by replaying the step's forward before the update when its output was not finite; elsewhere by device flags read only
on failure), in bf16 and fp16 loops, a training_step that calls a submodule, and a Hugging Face Trainer bf16 job."""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import math
import subprocess
import sys
import types

import pytest
import torch
from bisect_workloads import OVERFLOW, SAFE, Amplify
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_core.attach.monitor import Monitor
from amp_core.probes import nonfinite
from amp_core.probes.layerwatch import FIRST_NONFINITE_EVENT
from amp_core.probes.nonfinite import RECHECK_DRAWS, ForwardReplaySentinel, NonfiniteSentinel, sentinel_for
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store


class PlantedAt(nn.Module):
    """Amplify(OVERFLOW) from the `at`-th forward on, the identity before."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls, self.planted = at, 0, Amplify(OVERFLOW)

    def forward(self, x):
        self.calls += 1
        return self.planted(x) if self.calls > self.at else x


def planted_loop(store, dtype: torch.dtype, scaled: bool, at: int, steps: int, **settings) -> str:
    """A user's autocast loop, a Monitor watching it, whose module "3.planted" overflows (past bf16's range too) from
    step `at`; returns the run's id."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Amplify(SAFE), nn.Linear(32, 32), PlantedAt(at), nn.LayerNorm(32),
                          nn.Linear(32, 4))
    if dtype == torch.bfloat16:  # bf16 has fp32's range: make the planted factor overflow it too
        model[3].planted.factor = 1e39
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=scaled)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with Monitor(model, optimizer, scaler, store=store, layers_every=0, **settings) as monitor:
        for _ in range(steps):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            monitor.step(loss)
    return monitor.run_id


@pytest.mark.parametrize(("dtype", "scaled", "norm_every"),
                         [(torch.bfloat16, False, 25), (torch.float16, True, 25), (torch.bfloat16, False, 3)])
def test_a_monitor_names_the_planted_module_in_the_failing_step_itself(fresh_store, dtype, scaled, norm_every):
    run_id = planted_loop(fresh_store, dtype, scaled, at=3, steps=7, grad_norm_every=norm_every)
    events = RunManager(open_store(fresh_store)).events(run_id)
    named = events[events["kind"] == FIRST_NONFINITE_EVENT]
    assert len(named) == 1, named["message"].tolist()  # steps 4 and 5 fail too (a streak named once)
    data = named["data"].iloc[0]
    assert data["failed_step"] == 3 and data["same_step"] and data["module"] == "3.planted"
    assert "in the failing step itself (step 3" in named["message"].iloc[0]
    if not scaled:  # the NaN gradients the optimizer applied at that step are counted and named, once per streak
        applied = events[events["kind"] == "nonfinite_grads"]  # (and on the steps sampled anyway: every 3rd)
        assert applied["step"].tolist() == ([3] if norm_every == 25 else [3, 6]), applied["step"].tolist()
        assert {p["param"] for p in applied["data"].iloc[0]["params"]} >= {"0.weight", "5.weight"}
        frame = open_store(fresh_store).steps(run_id).set_index("step")
        assert not math.isfinite(frame.loc[3, "grad_norm"]) and math.isnan(frame.loc[4, "grad_norm"])


def test_the_sentinel_reads_nothing_until_asked_and_forgets_old_steps():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    step = [0]
    sentinel = NonfiniteSentinel(model, lambda: step[0], keep_steps=2)
    for value in (1.0, float("inf"), 1.0):
        model(torch.full((2, 4), value))
        step[0] += 1
    assert sentinel.first(0) is None and not sentinel.held(0)  # older than the two kept
    assert sentinel.first(1).module == "0" and sentinel.first(2) is None
    sentinel.close()
    model(torch.ones(2, 4))
    assert not sentinel.held(3)


@pytest.mark.timeout(900)  # a Trainer in a process of its own: imports its framework, slow on a loaded machine
@pytest.mark.parametrize(("trainer", "arguments", "planted"), [
    pytest.param("hf", ["--bf16"], "transformer.h.1.mlp.act", marks=pytest.mark.extra("hf"), id="hf"),
    # Its training_step calls module.net, not the module: the Monitor learns which module the step calls outermost.
    pytest.param("lightning", ["--precision", "bf16-mixed"], "net.1", marks=pytest.mark.extra("lightning"),
                 id="lightning"),
])
def test_a_trainer_bf16_job_names_the_planted_module_at_the_failing_step(fresh_store, trainer, arguments, planted):
    from test_integrations import ENV, SCRIPT

    proc = subprocess.run([sys.executable, str(SCRIPT), trainer, *arguments, "--steps", "6", "--overflow-at", "3",
                           "--store", str(fresh_store)], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = open_store(fresh_store).runs()["run_id"].iloc[0]
    events = RunManager(open_store(fresh_store)).events(run_id)
    named = events[events["kind"] == FIRST_NONFINITE_EVENT]
    assert len(named) >= 1, events["message"].tolist()
    data = named["data"].iloc[0]
    assert data["failed_step"] == 3 and data["same_step"] and data["module"] == planted, named["message"].tolist()


def test_the_replay_way_on_a_cpu_and_the_device_flags_where_a_read_syncs_or_ranks_are_several():
    model = nn.Sequential(nn.Linear(4, 4))
    for reads_free, ranks, kind in ((True, 1, ForwardReplaySentinel), (False, 1, NonfiniteSentinel),
                                    (True, 2, NonfiniteSentinel)):
        sentinel = sentinel_for(model, lambda: 0, host_reads_free=reads_free, ranks=ranks)
        assert type(sentinel) is kind
        sentinel.close()


class WithDropoutAndNorm(nn.Module):
    """Dropout (draws from the RNG) and BatchNorm (running statistics): what a replay must leave as it found."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 1))
        self.planted = PlantedAt(4)

    def forward(self, x):
        return self.planted(self.body(x))


def test_a_replay_leaves_training_as_it_found_it(fresh_store):
    """The same seeded loop with dropout and BatchNorm, a planted overflow at step 4 (replayed), watched with and
    without the failing-step sentinel: equal losses, weights and running statistics at every step."""
    results = []
    for failing_step in (True, False):
        torch.manual_seed(0)
        model = WithDropoutAndNorm()
        model.planted.planted.factor = 1e39
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1)
        losses = []
        with Monitor(model, optimizer, store=fresh_store, layers_every=0, replay=False,
                     failing_step=failing_step) as monitor:
            for _ in range(7):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                loss.backward()
                optimizer.step()
                monitor.step(loss)
                losses.append(loss.item())
        named = RunManager(open_store(fresh_store)).events(monitor.run_id)
        named = named[named["kind"] == FIRST_NONFINITE_EVENT]
        results.append((losses, [t.clone() for t in model.state_dict().values()], named))
    (on_losses, on_state, on_named), (off_losses, off_state, _) = results
    assert on_losses[:4] == off_losses[:4] and all(math.isnan(v) for v in on_losses[4:] + off_losses[4:])
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
               for a, b in zip(on_state, off_state, strict=True))  # the weights are NaN after step 4 in both
    assert on_named["data"].iloc[0]["failed_step"] == 4 and on_named["data"].iloc[0]["module"] == "planted.planted"
    assert "replayed in the step, before the update" in on_named["message"].iloc[0]


def test_the_rng_state_is_copied_only_where_the_watched_calls_draw_random_numbers(monkeypatch):
    """A model that draws nothing costs no RNG copy per step; one that starts drawing later (set to train after a
    first step in eval) is noticed within RECHECK_DRAWS calls, and from then on every call keeps its state, so a
    replay of a failed call draws the dropout mask the call drew and names the planted module."""
    copies = [0]
    real = nonfinite._rng_state

    def counting():
        copies[0] += 1
        return real()

    monkeypatch.setattr(nonfinite, "_rng_state", counting)
    step = [0]
    x = torch.randn(4, 8)
    quiet = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    sentinel = ForwardReplaySentinel(quiet, lambda: step[0])
    for _ in range(3 * RECHECK_DRAWS):
        quiet(x)
        step[0] += 1
    assert not sentinel.draws and copies[0] <= 2 + 2 * 3, copies  # the first step's and the rechecks' only
    sentinel.close()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), PlantedAt(10 ** 9), nn.Linear(16, 1)).eval()
    model[2].planted.factor = 1e39
    sentinel, step[0] = ForwardReplaySentinel(model, lambda: step[0]), 0
    model(x)  # the first step, in eval: nothing drawn
    step[0] += 1
    assert not sentinel.draws
    model.train()
    for _ in range(RECHECK_DRAWS):
        model(x)
        step[0] += 1
    assert sentinel.draws
    copies[0] = 0
    model(x)
    assert copies[0] == 1  # each call's own state, from now on
    step[0] += 1
    model[2].at = model[2].calls  # the next call overflows
    model(x)
    found = sentinel.first(step[0])
    assert found is not None and found.module == "2.planted", found
    sentinel.close()


class Wrapper(nn.Module):
    """A training_step-like module that calls its child, never itself (a LightningModule's usual shape)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), PlantedAt(2), nn.Linear(8, 1))

    def step_loss(self, x):
        return self.net(x).float().pow(2).mean()


def test_the_outermost_module_a_step_calls_is_learnt_and_named_with_its_path():
    model, step = Wrapper(), [0]
    model.net[1].planted.factor = 1e39
    sentinel = ForwardReplaySentinel(model, lambda: step[0])
    for _ in range(4):
        model.step_loss(torch.randn(2, 4))
        step[0] += 1
    assert sentinel.first(0) is None and sentinel.first(1) is None
    assert sentinel.first(2).module == "net.1.planted" and sentinel.first(2).step == 2
    # After the first step only what the loop calls outermost is watched, by a wrapper of its forward: no hook left.
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in model.modules())
    assert [name for name, module in model.named_modules() if "forward" in vars(module)] == ["net"]
    sentinel.close()
    assert not any(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
                   for module in model.modules())


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, scale: float = 1.0):
        return self.linear(x) * scale


def doubled(forward):
    """An instance forward of the kind accelerate puts on a model (a function bound to it, `__wrapped__` kept)."""
    @functools.wraps(forward)
    def twice(self, *args, **kwargs):
        return 2 * forward(self, *args, **kwargs)
    return twice


def test_the_wrapped_forward_keeps_signature_copies_errors_and_whatever_forward_the_module_had():
    torch.manual_seed(0)
    model, step = Scaled(), [0]
    theirs = model.forward = types.MethodType(doubled(Scaled.forward), model)
    sentinel = ForwardReplaySentinel(model, lambda: step[0])
    ones, infs = torch.ones(2, 4), torch.full((2, 4), float("inf"))
    for _ in range(2):
        model(ones)
        step[0] += 1
    assert vars(model)["forward"] is not theirs and not model._forward_hooks  # wrapped, not hooked
    assert list(inspect.signature(model.forward).parameters) == ["x", "scale"]  # what HF Trainer reads
    assert torch.equal(model(ones, scale=3.0), 6 * model.linear(ones))  # their forward still runs
    with pytest.raises(RuntimeError):
        model(torch.ones(2, 3))  # a forward that raises leaves the depth count as it was
    copied = copy.deepcopy(model)
    nn.init.zeros_(copied.linear.weight)
    assert torch.equal(copied(ones), 2 * copied.linear.bias.expand(2, 4))  # the copy's own forward, theirs around it
    copied(infs)
    assert not sentinel.held(step[0])  # a copy reports nothing
    model(infs)
    assert sentinel.first(step[0]).module == "linear"
    sentinel.close()
    assert vars(model)["forward"] is theirs


def test_a_forward_that_is_not_bound_to_its_module_is_hooked_instead_and_left_as_it_was():
    """An instance forward that is a plain function (as torch.compile's wrapper module has): no wrapper around it."""
    model, step = Scaled(), [0]
    theirs = model.forward = functools.partial(Scaled.forward, model)
    sentinel = ForwardReplaySentinel(model, lambda: step[0])
    for batch in (torch.ones(2, 4), torch.ones(2, 4), torch.full((2, 4), float("inf"))):
        model(batch)
        step[0] += 1
    assert vars(model)["forward"] is theirs and model._forward_hooks and model._forward_pre_hooks
    assert sentinel.first(2).module == "linear"
    sentinel.close()
    assert vars(model)["forward"] is theirs and not model._forward_hooks and not model._forward_pre_hooks


class MaskedLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x).masked_fill(torch.tensor([False, False, True]), float("-inf"))


def test_an_output_that_holds_inf_by_design_stops_the_replays_and_says_so(fresh_store):
    torch.manual_seed(0)
    model = MaskedLogits()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with Monitor(model, optimizer, store=fresh_store, layers_every=0, replay=False) as monitor:
        for _ in range(6):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)  # finite: the masked class is never the target
            loss.backward()
            optimizer.step()
            monitor.step(loss)
    events = RunManager(open_store(fresh_store)).events(monitor.run_id)
    off = events[events["kind"] == "failing_step_off"]
    assert len(off) == 1 and "held inf/NaN in 3 steps where no module's did" in off["message"].iloc[0]
    assert events[events["kind"] == FIRST_NONFINITE_EVENT].empty


class Spiky(nn.Module):
    """Overflows fp16 on the steps whose RNG draw is below `share`: a replay reproduces that only from the RNG state
    its step's forward began with."""

    def __init__(self, share: float):
        super().__init__()
        self.share = share

    def forward(self, x):
        return x * (1e6 if torch.rand(()) < self.share else 1.0)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_a_scaled_loop_sums_nothing_per_step_and_replays_a_skipped_step_from_its_own_rng_state(fresh_store):
    """With a GradScaler a failed step is skipped, so the sentinel keeps each step's call and replays it after the
    skip (weights untouched): no reduction on a step that does not fail, and the replay draws what the step drew."""
    def loop(share: float, failing_step: bool, steps: int):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), Spiky(share), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0, growth_interval=1000)
        x, y = torch.ones(4, 8), torch.zeros(4, 2)
        with CountOps() as ops, Monitor(model, optimizer, scaler, store=fresh_store, layers_every=0, replay=False,
                                        failing_step=failing_step) as monitor:
            for _ in range(steps):
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                monitor.step(loss)
        frame = open_store(fresh_store).steps(monitor.run_id)
        return ops.counts["aten.sum"], RunManager(open_store(fresh_store)).events(monitor.run_id), frame

    assert loop(0.0, True, 8)[0] == loop(0.0, False, 8)[0]  # the sentinel on adds no sum to a loop that never fails
    _, events, frame = loop(0.3, True, 16)
    skipped = set(frame.loc[frame["skipped"].astype(bool), "step"])
    streaks = sorted(step for step in skipped if step - 1 not in skipped)  # a run of failed steps is named once
    named = events[events["kind"] == FIRST_NONFINITE_EVENT]
    assert len(streaks) >= 2 and named["step"].tolist() == streaks, (streaks, named["message"].tolist())
    assert all(d["same_step"] and d["module"] == "1" for d in named["data"]), named["message"].tolist()
