"""`MODE+keep:PATTERN`: kept modules compute in fp32 (op traces), stay plain Linear under FP8, keep fp32 weights in
true modes, compile in one graph, stay kept in a copy, and a pattern that matches nothing is refused with the closest
names."""

import copy

import pytest
import torch

from amp_core.config import ConfigError, RunConfig
from amp_core.fixes import keep_in_fp32
from amp_core.precision import get_precision, is_kept, parse_recipe
from amp_core.probes.optrace import trace_step
from amp_core.workloads import WORKLOADS, check_launch


def _transformer():
    return WORKLOADS["tiny_transformer"].seeded_model_and_batch(RunConfig(workload="tiny_transformer",
                                                                          batch_size=4))


def test_keep_options_parse_repeatably_and_are_refused_where_they_change_nothing():
    mode, options = parse_recipe("bf16-mixed+fp8-rowwise+keep:head+keep:blocks.*.ln1")
    assert mode == "bf16-mixed" and [o.name for o in options] == ["fp8-rowwise", "keep:head", "keep:blocks.*.ln1"]
    assert get_precision("16-mixed+keep:*.qkv").recipe == "16-mixed+keep:*.qkv"
    with pytest.raises(ValueError, match=r"changes nothing in 32-true"):
        parse_recipe("32-true+keep:head")
    with pytest.raises(ValueError, match=r"needs a pattern"):
        parse_recipe("16-mixed+keep:")


def test_a_pattern_that_matches_nothing_is_refused_at_launch_with_the_closest_names():
    with pytest.raises(ConfigError, match=r"modes: 16-mixed\+keep:blocks\.0\.qvk: .*matches no module.*blocks\.0\.qkv"):
        check_launch(RunConfig(workload="tiny_transformer", modes=("16-mixed+keep:blocks.0.qvk",)))


@pytest.mark.parametrize("recipe", ["16-mixed", "bf16-mixed"])
def test_kept_modules_ops_run_in_fp32_in_the_op_trace(recipe):
    model, batch = _transformer()
    workload = WORKLOADS["tiny_transformer"]
    plain = trace_step(model, get_precision(recipe), workload.loss, batch)
    kept = trace_step(model, get_precision(f"{recipe}+keep:blocks.0.qkv+keep:head"), workload.loss, batch)
    low = {"16-mixed": "fp16", "bf16-mixed": "bf16"}[recipe]

    def matmul_dtypes(trace, module):
        return {r.compute_dtype for r in trace.records if r.module == module and r.flops > 0}

    for module in ("blocks.0.qkv", "head"):
        assert matmul_dtypes(plain, module) == {low}
        assert matmul_dtypes(kept, module) == {"fp32"}
    assert matmul_dtypes(kept, "blocks.1.qkv") == {low}  # the rest of the model is untouched


def test_true_modes_keep_the_kept_weights_in_fp32_and_hand_back_16_bit_outputs():
    model, batch = _transformer()
    precision = get_precision("bf16-true+keep:blocks.1.mlp")
    prepared = precision.prepare_module(model)
    dtypes = {name: p.dtype for name, p in prepared.named_parameters()}
    assert dtypes["blocks.1.mlp.0.weight"] == torch.float32 and dtypes["blocks.1.qkv.weight"] == torch.bfloat16
    output = prepared(precision.prepare_input(batch[0]))
    assert output.dtype == torch.bfloat16
    # a copy prepared for another recipe loses its keeps
    again = get_precision("bf16-true").prepare_module(prepared)
    assert not any(is_kept(module) for module in again.modules())


def test_an_fp8_lanes_kept_module_stays_a_plain_linear():
    pytest.importorskip("torchao")
    model, batch = _transformer()
    precision = get_precision("bf16-mixed+fp8-rowwise+keep:blocks.0.qkv")
    report = precision.recipe_report(model)
    assert report["kept_fp32"] == ["blocks.0.qkv"] and "kept in fp32" in report["fp8_skipped"]["blocks.0.qkv"]
    prepared = precision.prepare_module(model)
    modules = dict(prepared.named_modules())
    assert type(modules["blocks.0.qkv"]) is torch.nn.Linear
    assert type(modules["blocks.1.qkv"]).__name__ == "Float8Linear"
    with precision.forward_context():
        loss = WORKLOADS["tiny_transformer"].loss(prepared(batch[0]), batch[1])
    loss.backward()
    assert torch.isfinite(loss) and modules["blocks.0.qkv"].weight.grad is not None


def test_a_kept_model_compiles_in_one_graph_and_a_copy_of_it_stays_kept():
    # The user's own loop: keep_in_fp32, then torch.compile(fullgraph=True). The keep is one with-block dynamo traces
    # (hooks that switched autocast off in one hook and on in another failed the compile); a deep copy of the model
    # (a replay's fork, the Monitor's detached copy) keeps it, bound to the copy.
    from amp_core.precision.compiler import cpp_compiler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(x)
    assert keep_in_fp32(model, ["2"]) == ["2"] and is_kept(model[2]) and not is_kept(model[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = model(x)
    assert plain.dtype == torch.bfloat16 and kept.dtype == torch.float32  # the kept head hands back fp32

    twin = copy.deepcopy(model)
    assert is_kept(twin[2]) and twin[2].forward.__self__ is twin[2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(twin(x), kept)
    keep_in_fp32(twin, [])  # nothing kept: the forward the module had
    assert not is_kept(twin[2]) and "forward" not in vars(twin[2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert twin(x).dtype == torch.bfloat16

    if not cpp_compiler():
        pytest.skip("inductor needs a C++ compiler on a CPU")
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break would raise
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, kept, atol=2e-2, rtol=2e-2)  # bf16 first layer: fused, rounded alike or near
