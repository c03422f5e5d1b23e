"""Every private torch API AMP Lab uses, called through amp_core/torch_private.py on real torch objects: on a torch
where one changed, the test of that wrapper fails and its message names the API."""

from __future__ import annotations

import pytest
import torch

from amp_core import torch_private
from amp_core.torch_private import TorchAPIChanged


def scaled_step(optimizer_kwargs: dict, overflow: bool = False):
    """One GradScaler step of a small model on a CPU; returns (model, optimizer, scaler, found-inf flags seen)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, **optimizer_kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(torch_private.found_inf_flag(opt)))
    loss = model(torch.randn(3, 4)).sum()
    scaler.scale(loss).backward()
    if overflow:
        model.bias.grad[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    return model, optimizer, scaler, seen


def named(api: str):
    """Run the block; a TorchAPIChanged or AttributeError fails the test with the API's name."""
    class Guard:
        def __enter__(self):
            return self

        def __exit__(self, kind, error, traceback):
            if kind is not None and issubclass(kind, (TorchAPIChanged, AttributeError, TypeError)):
                pytest.fail(f"private torch API {api} changed in torch {torch.__version__}: {error}")
            return False
    return Guard()


def test_scale_tensor_reads_the_scale_without_a_copy():
    with named("GradScaler._get_scale_async"):
        scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
        assert torch_private.scale_tensor(scaler) == 512.0  # before the first step: a host float
        _, _, stepped, _ = scaled_step({}, overflow=True)
        scale = torch_private.scale_tensor(stepped)
        assert isinstance(scale, torch.Tensor) and float(scale) == 128.0  # backed off from 256
        assert torch_private.scale_tensor(torch.amp.GradScaler("cpu", enabled=False)) is None


def test_scaler_settings_are_the_constructor_arguments():
    with named("GradScaler._init_scale/_growth_factor/_backoff_factor/_growth_interval"):
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_factor=3.0, backoff_factor=0.25,
                                      growth_interval=7)
        assert torch_private.scaler_settings(scaler) == {"init_scale": 64.0, "growth_factor": 3.0,
                                                         "backoff_factor": 0.25, "growth_interval": 7}


def test_scaler_tensors_are_the_initial_values_then_the_scalers_own():
    with named("GradScaler._scale/_growth_tracker/_init_scale/_init_growth_tracker"):
        scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
        first = torch_private.scaler_tensors(scaler)
        assert (float(first["scale"]), int(first["growth_tracker"])) == (512.0, 0)
        _, _, stepped, _ = scaled_step({}, overflow=True)
        tensors = torch_private.scaler_tensors(stepped)
        assert float(tensors["scale"]) == 128.0 and int(tensors["growth_tracker"]) == 0
        assert float(tensors["scale"]) == stepped.get_scale()  # the scaler's own, read without a copy


def test_a_fused_optimizer_is_told_and_handed_the_found_inf_flag():
    with named("Optimizer._step_supports_amp_scaling / optimizer.found_inf"):
        _, optimizer, _, seen = scaled_step({"fused": True}, overflow=True)
        assert torch_private.supports_amp_scaling(optimizer)
        assert len(seen) == 1 and isinstance(seen[0], torch.Tensor) and float(seen[0]) > 0
        _, plain, _, plain_seen = scaled_step({})
        assert not torch_private.supports_amp_scaling(plain) and plain_seen == [None]


def test_foreach_norm_and_copy():
    with named("torch._foreach_norm / torch._foreach_copy_"):
        tensors = [torch.full((3,), 2.0, dtype=torch.float16), torch.ones(4)]
        norms = torch_private.foreach_norm(tensors)
        assert [n.dtype for n in norms] == [torch.float32] * 2
        assert torch.allclose(torch.stack(norms), torch.tensor([12.0**0.5, 2.0]))
        targets = [torch.zeros(3), torch.zeros(4)]
        torch_private.foreach_copy_(targets, [torch.ones(3), torch.full((4,), 5.0)])
        assert targets[0].tolist() == [1.0] * 3 and targets[1].tolist() == [5.0] * 4


def test_scoped_module_tracker_names_modules_by_path_and_cleans_up():
    with named("ModuleTracker._fw_pre_hook/_fw_post_hook/_get_append_fn/_get_mod_name/_hooks"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
        names = {model: "(root)", model[0]: "0", model[1]: "1"}
        seen = []
        model[0].register_forward_hook(lambda module, args, out: seen.append(set(tracker.parents)))
        with torch_private.ScopedModuleTracker(names) as tracker:
            out = model(torch.randn(1, 2, requires_grad=True))
            tracker.enter_on_grad(out, "(root)")
            out.sum().backward()
        assert seen and {"(root)", "0"} <= seen[0]
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model[1:])
        assert not model._forward_pre_hooks


def test_a_missing_api_is_named():
    class Stripped:
        pass

    with pytest.raises(TorchAPIChanged, match=r"private API GradScaler\._init_scale is gone"):
        torch_private._attribute(Stripped(), "_init_scale", "GradScaler._init_scale")


def test_torch_compile_accounting_wrappers_answer_on_this_torch():
    """The dynamo / inductor names compiled lanes read (amp_core.race.compiled, the compiled op view), each called once;
    nothing here compiles (a compiled module's call is lazy)."""
    import logging

    seen = []
    remove = torch_private.watch_dynamo_compiles(seen.append, seen.append)
    remove()
    assert isinstance(torch_private.compilation_metrics(), list)
    assert isinstance(torch_private.graph_break_counts(), dict)
    assert torch_private.recompile_limit() >= 1
    model = torch.nn.Linear(2, 2)
    assert torch_private.compiled_call(model) is None
    model.compile()
    assert torch_private.compiled_call(model) is not None
    torch_private.set_compiled_call(model, None)
    assert torch_private.compiled_call(model) is None
    assert torch_private.inductor_cxx_names()
    assert isinstance(torch_private.has_triton(), bool)
    assert callable(torch_private.inductor_backend(lambda *args, **kwargs: None, "max-autotune"))
    assert callable(torch_private.inductor_backend(None, "default", bind=lambda: None))
    assert torch_private.current_compile_id() == ""  # outside a compile
    from torch._functorch import config as functorch_config

    before = functorch_config.enable_autograd_cache
    with torch_private.aot_autograd_cache_off(), torch_private.aot_autograd_cache_off():
        assert functorch_config.enable_autograd_cache is False
    assert functorch_config.enable_autograd_cache == before
    record = logging.LogRecord(torch_private.DYNAMO_FRAME_LOGGER, logging.WARNING, "", 0,
                               "torch._dynamo hit config.%s (%s)", ("recompile_limit", 8), None)
    assert torch_private.is_recompile_limit_warning(record)
