"""The Monitor in the loop shapes users write, each a real CPU training loop whose records are compared with the loop's
own figures (loss, LR, skipped steps, the gradient norm the optimizer got): zero_grad before or after the Monitor's
step (None and zeroed gradients) with the scheduler before or after it (nanoGPT's train.py order among them),
gradient accumulation with DDP's no_sync, a closure optimizer (LBFGS), parameters frozen and unfrozen and a param
group added mid-run, a step with no gradient at all, a disabled scaler and one asked for on a device that is not there,
the Monitor's step called twice or skipped for one optimizer step, a float loss and losses it must refuse, an exception
and a KeyboardInterrupt in the `with` block, and diagnostics that fail on purpose without stopping the loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from amp_core.attach.guard import EXTRA_CALL_EVENT, FAILED_EVENT, MISSED_CALL_EVENT
from amp_core.attach.monitor import Monitor
from amp_core.probes import layerwatch
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore

ACCUM = 2
CLIP = 1.0


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))


def batch(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 10, generator=generator), torch.randn(n, 1, generator=generator) * 5 + 10


@pytest.fixture
def store(fresh_store) -> RunStore:
    return open_store(fresh_store)


def records(store: RunStore, monitor: Monitor):
    frame = store.steps(monitor.run_id)
    return frame.sort_values("step").reset_index(drop=True)


def events_of(store: RunStore, monitor: Monitor, kind: str):
    events = store.events(monitor.run_id)
    return events[events["kind"] == kind]


def assert_clean_finish(store: RunStore, monitor: Monitor) -> None:
    assert store.run(monitor.run_id)["status"] == "finished"
    assert events_of(store, monitor, FAILED_EVENT).empty, events_of(store, monitor, FAILED_EVENT)["message"].tolist()


def nanogpt_loop(store: RunStore, *, zero_grad: str, set_to_none: bool, lr_by: str, steps: int = 12,
                 overflow_at: tuple[int, ...] = (4, 9), **settings) -> tuple[Monitor, dict[str, list]]:
    """nanoGPT's train.py shape on a CPU: fp16 autocast, a GradScaler, ACCUM micro-steps, unscale_ and clipping, the
    LR set by hand each iteration (or by a scheduler stepped before or after the Monitor's step); `zero_grad` is
    where the loop clears the gradients: "start" of the iteration, "before" or "after" monitor.step."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: 1 / (1 + it)) if lr_by != "hand" else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = batch()
    xs, ys = x.chunk(ACCUM), y.chunk(ACCUM)
    loop: dict[str, list] = {"loss": [], "lr": [], "skipped": [], "norm": []}
    with Monitor(model, optimizer, scaler, scheduler, store=store, grad_norm_every=3, **settings) as monitor:
        for it in range(steps):
            if lr_by == "hand":
                for group in optimizer.param_groups:
                    group["lr"] = 1e-3 * (it + 1) / steps
            if zero_grad == "start":
                optimizer.zero_grad(set_to_none=set_to_none)
            for micro in range(ACCUM):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(xs[micro]), ys[micro]) / ACCUM
                blow_up = 1e30 if it in overflow_at and micro == ACCUM - 1 else 1.0
                scaler.scale(loss * blow_up).backward()
            scaler.unscale_(optimizer)
            total = float(nn.utils.clip_grad_norm_(model.parameters(), CLIP))
            loop["norm"].append(total * min(1.0, CLIP / (total + 1e-6)))  # what the optimizer got
            loop["lr"].append(optimizer.param_groups[0]["lr"])
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            loop["skipped"].append(scaler.get_scale() < before)
            if lr_by == "scheduler before":
                scheduler.step()
            if zero_grad == "before":
                optimizer.zero_grad(set_to_none=set_to_none)
            loop["loss"].append(loss.item() * ACCUM)
            monitor.step(loss * ACCUM, samples=len(x))
            if lr_by == "scheduler after":
                scheduler.step()
            if zero_grad == "after":
                optimizer.zero_grad(set_to_none=set_to_none)
    return monitor, loop


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
@pytest.mark.parametrize("lr_by", ["hand", "scheduler before", "scheduler after"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads None", "grads zeroed"])
@pytest.mark.parametrize("zero_grad", ["start", "before", "after"])
def test_the_order_of_zero_grad_and_the_scheduler_does_not_change_the_records(store, zero_grad, set_to_none, lr_by):
    """nanoGPT's own order is zero_grad="before" with grads None: it made the Monitor raise (issue 57)."""
    monitor, loop = nanogpt_loop(store, zero_grad=zero_grad, set_to_none=set_to_none, lr_by=lr_by)
    frame = records(store, monitor)
    assert frame["step"].tolist() == list(range(12))
    assert frame["loss"].tolist() == pytest.approx(loop["loss"], rel=1e-6)
    assert frame["lr"].tolist() == pytest.approx(loop["lr"], rel=1e-12)
    assert frame["skipped"].tolist() == loop["skipped"] and loop["skipped"][4] and loop["skipped"][9]
    for step in range(0, 12, 3):  # the sampled steps (grad_norm_every=3): the norm the optimizer got
        if not loop["skipped"][step]:
            assert frame["grad_norm"][step] == pytest.approx(loop["norm"][step], rel=1e-4), step
    for step in (4, 9):  # a skipped step: its gradients' norm, and the parameters that overflowed, named
        assert not math.isfinite(frame["grad_norm"][step])
        skip = events_of(store, monitor, "skipped_step")
        params = skip[skip["step"] == step]["data"].iloc[0]["params"]
        assert params and {p["param"] for p in params} <= {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert_clean_finish(store, monitor)


def test_gradient_statistics_are_taken_before_nanogpts_zero_grad(store):
    monitor, _ = nanogpt_loop(store, zero_grad="before", set_to_none=True, lr_by="hand", gradstats_every=2,
                              probe_budget=0)
    sampled = store.grad_stat_steps(monitor.run_id, 0)
    assert set(sampled) >= {0, 2, 6, 8, 10}  # every sampled step, though the loop cleared the gradients first
    stats = store.grad_stats(monitor.run_id, 0, step=2)
    assert {s.param for s in stats} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(s.zeros < s.numel for s in stats)  # real gradients, not the cleared ones
    assert_clean_finish(store, monitor)


def test_gradient_accumulation_with_ddp_no_sync_micro_steps(store, tmp_path):
    """DDP (gloo, one rank) with no_sync on every micro-step but the last, as a multi-GPU loop writes it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(mlp())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = batch()
        xs, ys = x.chunk(4), y.chunk(4)
        losses, norms = [], []
        with Monitor(model, optimizer, store=store, mode="32-true", grad_norm_every=1) as monitor:
            for _ in range(6):
                total = 0.0
                for micro in range(4):
                    sync = micro == 3
                    with (model.no_sync() if not sync else torch.enable_grad()):
                        loss = nn.functional.mse_loss(model(xs[micro]), ys[micro]) / 4
                        loss.backward()
                    total += loss.item()
                norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(total)
                monitor.step(total)
    finally:
        dist.destroy_process_group()
    frame = records(store, monitor)
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-6)  # records hold float32
    assert frame["grad_norm"].tolist() == pytest.approx(norms, rel=1e-5)
    assert frame["lr"].tolist() == [0.01] * 6
    assert_clean_finish(store, monitor)


def test_a_closure_optimizer_lbfgs(store):
    model = mlp()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = batch()
    losses, norms = [], []

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with Monitor(model, optimizer, store=store, mode="32-true", grad_norm_every=1) as monitor:
        for _ in range(5):
            loss = optimizer.step(closure)
            losses.append(loss.item())
            # The gradients LBFGS left: its last closure's (the pre-hook ran before any of them).
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
            monitor.step(loss)
    frame = records(store, monitor)
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-6)  # records hold float32 and losses[-1] < losses[0]
    assert frame["grad_norm"].tolist() == pytest.approx(norms, rel=1e-5)
    assert frame["lr"].tolist() == [0.5] * 5
    assert_clean_finish(store, monitor)


def test_frozen_parameters_unfrozen_and_a_param_group_added_mid_run(store):
    """The first layer frozen, unfrozen at step 3 in a param group of its own (fine-tuning's shape): its gradients
    count from then on; the LR recorded is the first group's."""
    model = mlp()
    first, last = model[0], model[2]
    for p in first.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.Adam(last.parameters(), lr=1e-3)
    x, y = batch()
    losses, norms, lrs = [], [], []
    with Monitor(model, optimizer, store=store, mode="32-true", grad_norm_every=1) as monitor:
        for step in range(6):
            if step == 3:
                for p in first.parameters():
                    p.requires_grad_(True)
                optimizer.add_param_group({"params": list(first.parameters()), "lr": 1e-4})
            for group in optimizer.param_groups:
                group["lr"] *= 0.9
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms.append((len(grads), float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))))
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            monitor.step(loss)
    frame = records(store, monitor)
    assert [count for count, _ in norms] == [2, 2, 2, 4, 4, 4]
    assert frame["grad_norm"].tolist() == pytest.approx([norm for _, norm in norms], rel=1e-5)
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-6)  # records hold float32
    assert frame["lr"].tolist() == pytest.approx(lrs, rel=1e-12)
    assert_clean_finish(store, monitor)


def test_a_step_where_no_parameter_got_a_gradient(store):
    """Step 2's batch is empty: the loop skips backward, the optimizer steps with no gradient at all."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    losses = []
    with Monitor(model, optimizer, store=store, mode="32-true", grad_norm_every=1) as monitor:
        for step in range(5):
            optimizer.zero_grad(set_to_none=True)
            if step == 2:
                loss = torch.zeros(())
            else:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
            optimizer.step()
            losses.append(loss.item())
            monitor.step(loss)
    frame = records(store, monitor)
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-6)  # records hold float32
    norms = frame["grad_norm"].tolist()
    assert math.isnan(norms[2]) and all(math.isfinite(norm) and norm > 0 for i, norm in enumerate(norms) if i != 2)
    assert_clean_finish(store, monitor)


def _absent_device() -> str:
    return next(device for device in ("cuda", "xpu", "mps") if not getattr(torch, device).is_available())


@pytest.mark.filterwarnings("ignore::UserWarning")  # GradScaler's own: the device is not there, so it is disabled
@pytest.mark.parametrize("scaler_device", ["disabled", "absent device"])
def test_a_scaler_that_does_nothing(store, scaler_device):
    """A scaler built disabled, and one asked for on a device the machine does not have (GradScaler disables itself
    with a warning): every call goes straight through, and the Monitor records an unscaled loop."""
    if scaler_device == "disabled":
        scaler = torch.amp.GradScaler("cpu", enabled=False)
    else:
        scaler = torch.amp.GradScaler(_absent_device())
    assert not scaler.is_enabled()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    losses = []
    with Monitor(model, optimizer, scaler, store=store) as monitor:
        for _ in range(5):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
            monitor.step(loss)
    frame = records(store, monitor)
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-6)  # records hold float32
    assert not frame["skipped"].any() and monitor.mode == "32-true"
    assert_clean_finish(store, monitor)


@pytest.mark.parametrize("fp16", [False, True], ids=["unscaled", "GradScaler"])
def test_the_monitors_step_called_twice_for_one_optimizer_step(store, fp16, capfd):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16, init_scale=2.0**10)
    x, y = batch()
    losses = []
    with Monitor(model, optimizer, scaler, store=store) as monitor:
        for _ in range(6):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
            monitor.step(loss)
            monitor.step(loss)  # a second call for the same optimizer step: not a step
    frame = records(store, monitor)
    assert frame["step"].tolist() == list(range(6))
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-6)
    assert not frame["skipped"].any()
    extra = events_of(store, monitor, EXTRA_CALL_EVENT)
    assert len(extra) == 1 and "not recorded" in extra["message"].iloc[0]
    assert capfd.readouterr().err.count("AMP Lab Monitor") == 1
    assert_clean_finish(store, monitor)


def test_the_monitors_step_skipped_for_one_optimizer_step(store):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    called = []
    with Monitor(model, optimizer, store=store, mode="32-true", grad_norm_every=1) as monitor:
        for step in range(8):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if step != 3:  # the loop forgets the Monitor once
                called.append(loss.item())
                monitor.step(loss)
    frame = records(store, monitor)
    assert frame["loss"].tolist() == pytest.approx(called, rel=1e-9) and len(frame) == 7
    missed = events_of(store, monitor, MISSED_CALL_EVENT)
    assert len(missed) == 1 and missed["data"].iloc[0]["missed"] == 1
    assert_clean_finish(store, monitor)


@pytest.mark.parametrize("kind", ["python float", "float64 tensor of shape [1]", "a loss that still needs grad"])
def test_losses_of_every_usable_kind(store, kind):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    losses = []
    with Monitor(model, optimizer, store=store, mode="32-true", grad_norm_every=2) as monitor:
        for _ in range(5):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            handed = {"python float": loss.item(), "float64 tensor of shape [1]": loss.detach().double().reshape(1),
                      "a loss that still needs grad": loss}[kind]
            monitor.step(handed)
    assert records(store, monitor)["loss"].tolist() == pytest.approx(losses, rel=1e-7)
    assert_clean_finish(store, monitor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a loss on another device needs a CUDA device")
def test_a_loss_on_another_device_than_the_model(store):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    losses = []
    with Monitor(model, optimizer, store=store, mode="32-true") as monitor:
        for _ in range(5):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            monitor.step(loss.detach().to("cuda"))
    assert records(store, monitor)["loss"].tolist() == pytest.approx(losses, rel=1e-7)
    assert_clean_finish(store, monitor)


@pytest.mark.parametrize(("loss", "says"), [
    ("0.5 nats", "must be a number or a one-element tensor, got str"),
    ([0.5], "must be a number or a one-element tensor, got list"),
    (torch.ones(4), r"has 4 elements \(shape \(4,\)\): pass one value per step"),
    (torch.ones((), device="meta"), "on the meta device"),
])
@pytest.mark.parametrize("mode", ["32-true", "16-mixed"])
def test_a_loss_the_monitor_cannot_record_is_refused_at_the_first_step_in_one_line(store, loss, says, mode):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", enabled=mode == "16-mixed")
    x, y = batch()
    with Monitor(model, optimizer, scaler, store=store, mode=mode) as monitor:
        optimizer.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        with pytest.raises(TypeError, match=f"^Monitor.step\\(loss\\): .*{says}") as refused:
            monitor.step(loss)
    assert "\n" not in str(refused.value)
    assert store.steps(monitor.run_id).empty


@pytest.mark.parametrize(("raised", "status", "says"), [
    (ValueError("data ran out"), "failed", "the script raised ValueError: data ran out"),
    (KeyboardInterrupt(), "interrupted", "KeyboardInterrupt"),
])
def test_an_exception_in_the_with_block_propagates_unchanged_and_marks_the_run(store, raised, status, says):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    losses = []
    with pytest.raises(type(raised)) as caught, Monitor(model, optimizer, store=store, mode="32-true") as monitor:
        for step in range(6):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            monitor.step(loss)
            if step == 3:
                raise raised
    assert caught.value is raised
    run = store.run(monitor.run_id)
    assert run["status"] == status and run["lanes"][0]["status"] == status
    assert says in run["lanes"][0]["error"]
    assert records(store, monitor)["loss"].tolist() == pytest.approx(losses, rel=1e-9)


def _broken_figures(tensor: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("layer figures broke on purpose")


def test_a_layer_watch_that_fails_is_told_once_switched_off_and_the_loop_goes_on(store, monkeypatch, capfd):
    """The layer watch's hooks (inside the user's forward and backward) made to raise: the first watched step's
    failure is an event and one line on stderr, the second switches the layer watch off; every step is recorded."""
    monkeypatch.setattr(layerwatch, "tensor_figures", _broken_figures)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    losses = []
    with Monitor(model, optimizer, store=store, mode="32-true", layers_every=2, probe_budget=0) as monitor:
        for _ in range(10):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            monitor.step(loss)
    frame = records(store, monitor)
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-6)  # records hold float32
    failed = events_of(store, monitor, FAILED_EVENT)
    assert failed["step"].astype(int).tolist() == [0, 2]
    assert [row["diagnostic"] for row in failed["data"]] == ["the layer watch"] * 2
    assert "RuntimeError: layer figures broke on purpose" in failed["message"].iloc[0]
    assert [row["switched_off"] for row in failed["data"]] == [False, True]
    assert events_of(store, monitor, layerwatch.LAYER_AMAX_EVENT).empty
    err = [line for line in capfd.readouterr().err.splitlines() if "AMP Lab Monitor" in line]
    assert len(err) == 1 and "the layer watch failed (RuntimeError: layer figures broke on purpose)" in err[0]
    assert store.run(monitor.run_id)["status"] == "finished"


def test_a_step_hook_that_fails_is_told_and_dropped(store, capfd):
    """An integration's step hook (Monitor.step_hooks) that raises: told once, dropped after its second failure."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    calls = []

    def hook(monitor, result):
        calls.append(result.step)
        raise KeyError("no such figure")

    with Monitor(model, optimizer, store=store, mode="32-true") as monitor:
        monitor.step_hooks.append(hook)
        for _ in range(5):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            monitor.step(loss)
    assert calls == [0, 1] and not monitor.step_hooks
    assert len(records(store, monitor)) == 5
    failed = events_of(store, monitor, FAILED_EVENT)
    assert len(failed) == 2 and "KeyError" in failed["message"].iloc[0]
    assert capfd.readouterr().err.count("AMP Lab Monitor") == 1


def hf_trainer_run(store_path, steps: int, **settings):
    """A tiny GPT-2 under the Hugging Face Trainer with AMP Lab's callback; returns (callback, the Trainer's own
    logged losses)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from amp_core.integrations.transformers import AmpLabCallback
    from examples.hf_trainer import LoggedLosses, PatternData

    amp_lab = AmpLabCallback(name="hf guard test", store=store_path, **settings)
    logged = LoggedLosses()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    training = TrainingArguments(output_dir="/tmp/amp-lab-hf-guard-test", max_steps=steps, learning_rate=3e-3,
                                 per_device_train_batch_size=4, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, disable_tqdm=True, seed=0)
    Trainer(model=model, args=training, train_dataset=PatternData(samples=32), callbacks=[amp_lab, logged]).train()
    return amp_lab, [logged.losses[step] for step in sorted(logged.losses)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_failing_layer_watch_under_the_hf_trainer_leaves_its_records_whole(fresh_store, monkeypatch, capfd):
    pytest.importorskip("transformers")
    monkeypatch.setattr(layerwatch, "tensor_figures", _broken_figures)
    amp_lab, losses = hf_trainer_run(fresh_store, 6, layers_every=2, probe_budget=0)
    store = open_store(fresh_store)
    frame = records(store, amp_lab.monitor)
    assert frame["loss"].tolist() == pytest.approx(losses, rel=1e-3) and len(losses) == 6  # the Trainer rounds
    failed = events_of(store, amp_lab.monitor, FAILED_EVENT)
    assert [row["switched_off"] for row in failed["data"]] == [False, True]
    assert capfd.readouterr().err.count("AMP Lab Monitor") == 1
    assert store.run(amp_lab.monitor.run_id)["status"] == "finished"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_hf_callback_that_fails_twice_switches_itself_off_and_the_trainer_finishes(fresh_store, monkeypatch,
                                                                                       capfd):
    pytest.importorskip("transformers")
    from amp_core.integrations import transformers as integration

    def broken(self):
        raise ZeroDivisionError("the step's loss factors broke on purpose")

    monkeypatch.setattr(integration.AmpLabCallback, "_factors", broken)
    amp_lab, losses = hf_trainer_run(fresh_store, 5)
    assert len(losses) == 5  # the Trainer went on to its last step
    assert amp_lab.off
    store = open_store(fresh_store)
    run = store.run(amp_lab.monitor.run_id)
    assert run["status"] == "failed" and "ZeroDivisionError" in run["lanes"][0]["error"]
    failed = events_of(store, amp_lab.monitor, FAILED_EVENT)
    assert len(failed) == 2 and failed["data"].iloc[0]["diagnostic"] == "the Hugging Face Trainer callback"
    assert capfd.readouterr().err.count("AMP Lab Monitor") == 1


@pytest.mark.filterwarnings("ignore")
def test_a_failing_layer_watch_under_lightning_leaves_its_records_whole(fresh_store, monkeypatch, capfd):
    lightning = pytest.importorskip("lightning")
    from amp_core.integrations.lightning import AmpLabCallback
    from examples.lightning_module import SineFit

    monkeypatch.setattr(layerwatch, "tensor_figures", _broken_figures)
    amp_lab = AmpLabCallback(name="lightning guard test", store=fresh_store, layers_every=2, probe_budget=0)
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 192).unsqueeze(1)
    module = SineFit()
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[amp_lab])
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.sin(x)), batch_size=32))
    store = open_store(fresh_store)
    frame = records(store, amp_lab.monitor)
    assert frame["loss"].tolist() == pytest.approx(module.losses, rel=1e-6) and len(module.losses) == 6
    failed = events_of(store, amp_lab.monitor, FAILED_EVENT)
    assert [row["switched_off"] for row in failed["data"]] == [False, True]
    assert capfd.readouterr().err.count("AMP Lab Monitor") == 1
    assert store.run(amp_lab.monitor.run_id)["status"] == "finished"
