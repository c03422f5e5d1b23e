"""Block-scaled formats: the quantisers equal torchao's own bit for bit (scales and values, on tensors with outliers,
zeros and exact ties), the emulated Linear's three GEMMs read their operands as the recipe says, and every option
races beside bf16-mixed on a CPU through the runner with its layers named; bad combinations are refused in one
line."""

from __future__ import annotations

import ast
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from amp_core.config import ConfigError, RunConfig
from amp_core.formats import quantize as q
from amp_core.formats.linear import GRAD_OUTPUT, INPUT, WEIGHT, BlockScaledLinear, GemmRecipe
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS, kept_in_fp32
from amp_core.precision import availability, get_precision, is_kept, parse_recipe
from amp_core.race.runner import Run
from amp_core.workloads import check_launch

pytestmark = pytest.mark.extra("recipes")  # the reference is torchao's own code


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """fp32 as its bit patterns: equal bits, not merely equal numbers (the sign of zero, NaN payloads)."""
    return tensor.to(torch.float32).contiguous().view(torch.int32)


def _hard_tensor(rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Random values over 16 decades, an outlier channel x300, an all-zero block and a block of tiny values."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-8, 8, cols)[torch.randperm(cols,
                                                                                             generator=generator)]
    x[:, 5] *= 300
    x[3, :32] = 0
    x[4, 32:64] = 1e-30
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", ["rceil", "floor"])
def test_mxfp8_equals_torchaos_to_mx_bit_for_bit(scaling, dtype):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    x = _hard_tensor().to(dtype)
    reference = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode[scaling.upper()])
    mine = q.quantize_mxfp8(x, scaling)
    assert torch.equal(mine.stored_scales, reference.scale.view(torch.uint8))
    assert torch.equal(_bits(mine.elements), _bits(reference.qdata.to(torch.float32)))
    assert torch.equal(_bits(mine.values), _bits(reference.dequantize(torch.float32)))
    assert not mine.values.eq(x.float()).all()  # it did quantise


@pytest.mark.parametrize("per_tensor", [True, False])
def test_nvfp4_equals_torchaos_to_nvfp4_and_dequantize_bit_for_bit(per_tensor):
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    x = _hard_tensor(seed=1)
    tensor_scale = per_tensor_amax_to_scale(x.abs().amax()) if per_tensor else None
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=tensor_scale)
    mine = q.quantize_nvfp4(x, per_tensor=per_tensor)
    assert torch.equal(mine.stored_scales.view(torch.uint8), reference.scale.view(torch.uint8))
    elements = f4_unpacked_to_f32(unpack_uint4(reference.qdata.contiguous().view(torch.uint8)))
    assert torch.equal(_bits(mine.elements), _bits(elements))
    assert torch.equal(_bits(mine.values), _bits(reference.dequantize(torch.float32)))
    assert torch.equal(_bits(mine.scales), _bits(reference.get_hp_scales()))


def test_nvfp4_16x16_tiles_scale_each_tile_by_its_own_amax():
    # torchao's 2-D weight quantiser is a Triton kernel; its numerics equal the 1x16 one's wherever every row of 16
    # in a tile holds the tile's amax, so that tensor is quantised both ways and compared bit for bit.
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    x = _hard_tensor(rows=64, cols=128, seed=2)
    tiles = x.reshape(4, 16, 8, 16).abs().amax(dim=(1, 3))  # (row tiles, col tiles)
    x.view(4, 16, 8, 16)[:, :, :, 0] = tiles[:, None, :].expand(4, 16, 8)
    reference = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))
    mine = q.quantize_nvfp4(x, tile_2d=True)
    assert torch.equal(_bits(mine.values), _bits(reference.dequantize(torch.float32)))
    assert mine.stored_scales.shape == (4, 8)
    assert torch.equal(mine.stored_scales.view(torch.uint8), reference.scale.view(torch.uint8)[::16])
    # A tile's transpose is the transposed tile: the weight reads alike in the forward and the grad-input GEMM.
    assert torch.equal(_bits(q.quantize_nvfp4(x.t().contiguous(), tile_2d=True).values), _bits(mine.values.t()))


def test_e2m1_rounds_half_to_even_as_torchao_and_stochastically_without_bias():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, 0.0])
    values = torch.cat([torch.linspace(-6, 6, 100_003), ties, -ties])
    assert torch.equal(_bits(q.round_e2m1(values)), _bits(f4_unpacked_to_f32(f32_to_f4_unpacked(values))))
    generator = torch.Generator().manual_seed(0)
    draws = q.round_e2m1(torch.full((200_000,), 1.2), stochastic=True, generator=generator)
    assert set(draws.unique().tolist()) == {1.0, 1.5}
    assert draws.mean().item() == pytest.approx(1.2, abs=0.005)  # round to nearest gives 1.0 every time


def test_the_random_hadamard_transform_is_torchaos_matrix_and_keeps_products():
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    signs = q.random_signs(torch.Generator().manual_seed(3))
    reference = get_rht_matrix(tuple(int(s) for s in signs.tolist()), "cpu", torch.float32, 16)
    assert torch.equal(q.rht_matrix(signs), reference)
    a, b = torch.randn(8, 64, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)
    transformed = q.hadamard_transform(a, signs) @ q.hadamard_transform(b, signs).t()
    assert torch.allclose(transformed.double(), a @ b.t(), atol=1e-4)


def _torchao_blockwise_reference():
    """torchao's torch reference quantisers for blockwise FP8 (torch_blockwise_scale_act_quant_lhs,
    torch_blockwise_scale_weight_quant). Their module imports triton at the top, which a CPU machine lacks, so the two
    functions are read from torchao's own source file and run as written."""
    root = Path(importlib.util.find_spec("torchao").submodule_search_locations[0])
    source = (root / "prototype" / "blockwise_fp8_training" / "kernels.py").read_text()
    wanted = {"torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_weight_quant", "EPS"}
    tree = ast.parse(source)
    body = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in wanted)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", "") in wanted for t in node.targets))]
    assert len(body) == 3, "torchao's blockwise FP8 reference functions moved"
    namespace = {"torch": torch, "e4m3_dtype": torch.float8_e4m3fn}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(root / "kernels.py"), "exec"), namespace)
    return namespace["torch_blockwise_scale_act_quant_lhs"], namespace["torch_blockwise_scale_weight_quant"]


def test_blockwise_fp8_equals_torchaos_reference_bit_for_bit():
    activations, weights = _torchao_blockwise_reference()
    x = _hard_tensor(rows=256, cols=384, seed=4)
    x[7, 128:256] = 0
    data, scale = activations(x.clone())
    mine = q.quantize_fp8_blockwise(x)
    assert torch.equal(_bits(mine.elements), _bits(data.to(torch.float32)))
    assert torch.equal(_bits(mine.stored_scales), _bits(scale))
    data, scale = weights(x.clone())
    mine = q.quantize_fp8_blockwise(x, tile_2d=True)
    assert torch.equal(_bits(mine.elements), _bits(data.to(torch.float32)))
    assert torch.equal(_bits(mine.stored_scales), _bits(scale))
    assert mine.stored_scales.shape == (2, 3)


def test_block_flags_count_underflowed_and_saturated_scales():
    x = torch.ones(2, 32)
    x[1, :16] = 1e-9  # 1e-9 next to a tensor amax of 1: NVFP4's e4m3 block scale bottoms out
    nvfp4 = q.quantize_nvfp4(x)
    assert nvfp4.underflowed.tolist() == [[False, False], [True, False]]
    assert not nvfp4.saturated.any()
    floor = q.quantize_mxfp8(torch.full((1, 32), 1.9 * 2**4), "floor")  # 1.9 * 2^8 = 486 > 448: clipped
    assert floor.saturated.all() and not q.quantize_mxfp8(torch.full((1, 32), 1.9 * 2**4), "rceil").saturated.any()
    with pytest.raises(ValueError, match="not a multiple of the block"):
        q.quantize_mxfp8(torch.ones(4, 48))
    with pytest.raises(ValueError, match="unknown MXFP8 scaling"):
        q.quantize_mxfp8(torch.ones(4, 32), "even")


@pytest.mark.parametrize("gemm", [GemmRecipe("mxfp8"), GemmRecipe("mxfp8", wgrad_hp=True),
                                  GemmRecipe("nvfp4", weight_tiles=True), GemmRecipe("fp8-blockwise",
                                                                                     weight_tiles=True)],
                         ids=["mxfp8", "mxfp8-wgrad-hp", "nvfp4-2d", "fp8-blockwise"])
def test_the_emulated_linear_reads_each_gemms_operands_as_the_recipe(gemm):
    torch.manual_seed(0)
    size = 128 if gemm.format == "fp8-blockwise" else 32
    layer = torch.nn.Linear(size, 2 * size)
    x = torch.randn(3, 10, size, requires_grad=True)  # 30 tokens: the grad-weight GEMM pads them to a whole block
    emulated = BlockScaledLinear(layer, gemm, "layer")
    out = emulated(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    rows, dy = x.detach().reshape(-1, size), grad.reshape(-1, 2 * size)
    expected = gemm.quantize(rows, INPUT).values @ gemm.quantize(layer.weight.detach(), WEIGHT).values.t()
    assert torch.equal(out.detach(), (expected + layer.bias.detach()).reshape(out.shape))
    expected_dx = gemm.quantize(dy, GRAD_OUTPUT).values @ gemm.quantize(layer.weight.detach().t().contiguous(),
                                                                        WEIGHT).values.t()
    assert torch.equal(x.grad.reshape(-1, size), expected_dx)
    if gemm.wgrad_hp:
        assert torch.allclose(layer.weight.grad, dy.t() @ rows, atol=1e-5)
    else:
        pad = -rows.shape[0] % gemm.block
        padded = [torch.nn.functional.pad(t, (0, 0, 0, pad)).t().contiguous() for t in (dy, rows)]
        expected_dw = gemm.quantize(padded[0], GRAD_OUTPUT).values @ gemm.quantize(padded[1], INPUT).values.t()
        assert torch.equal(layer.weight.grad, expected_dw)
        assert not torch.equal(layer.weight.grad, dy.t() @ rows)


def test_nvfp4s_hadamard_transform_and_stochastic_rounding_change_only_the_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    x = torch.randn(64, 64)
    x[:, 3] *= 50  # an outlier channel: what the transform spreads over its 16
    dy = torch.randn(64, 64)
    outputs, grads = {}, {}
    for name, gemm in {"rn": GemmRecipe("nvfp4", weight_tiles=True),
                       "rht": GemmRecipe("nvfp4", weight_tiles=True, hadamard=True),
                       "sr": GemmRecipe("nvfp4", weight_tiles=True, stochastic_gradients=True)}.items():
        emulated = BlockScaledLinear(layer, gemm, "layer")
        layer.weight.grad = None
        out = emulated(x)
        out.backward(dy)
        outputs[name], grads[name] = out.detach(), layer.weight.grad.clone()
    assert torch.equal(outputs["rn"], outputs["rht"]) and torch.equal(outputs["rn"], outputs["sr"])
    exact = dy.t() @ x
    errors = {name: (grad - exact).norm().item() / exact.norm().item() for name, grad in grads.items()}
    assert errors["rht"] < errors["rn"], errors
    assert not torch.equal(grads["sr"], grads["rn"])


BLOCK_RECIPES = tuple(f"bf16-mixed+{option.name}" for option in BLOCK_SCALED_OPTIONS)


def test_every_block_scaled_option_races_beside_bf16_mixed_and_names_its_layers():
    recipes = tuple(recipe for recipe in BLOCK_RECIPES if "blockwise" not in recipe)
    config = RunConfig(workload="tiny_transformer", modes=("bf16-mixed", *recipes), steps=3, batch_size=4,
                       optimizer="adamw", device="cpu")
    run = Run(config).start()
    run.join()
    assert run.status == "finished", [(lane.mode, lane.error) for lane in run.lanes]
    frame = run.frame()
    last = frame.groupby("mode").last()
    assert (frame.groupby("mode").size() == 3).all()
    assert torch.isfinite(torch.tensor(last["loss"].to_numpy())).all()
    started = next(e for e in run.events() if e.kind == "started")
    for recipe in recipes:
        report = started.data["recipes"][recipe]
        assert "blocks.0.qkv" in report["block_layers"] and "blocks.1.mlp.2" in report["block_layers"]
        assert "Emulated here" in " ".join(report["notes"])
        assert f"{recipe}: {len(report['block_layers'])} Linear layers in {report['block_format']}" in started.message
    # Same weights, batch and seed: the formats' rounding is all that differs after three steps.
    assert len({round(float(loss), 6) for loss in last["loss"]}) == len(last)


def test_fp8_blockwise_races_on_a_model_of_whole_128_blocks_and_is_refused_on_one_without():
    config = RunConfig(workload="tiny_transformer", size="medium", modes=("bf16-mixed", "bf16-mixed+fp8-blockwise"),
                       steps=2, batch_size=2, optimizer="adamw", device="cpu")
    run = Run(config).start()
    run.join()
    assert run.status == "finished", [(lane.mode, lane.error) for lane in run.lanes]
    report = next(e for e in run.events() if e.kind == "started").data["recipes"]["bf16-mixed+fp8-blockwise"]
    assert "blocks.0.mlp.0" in report["block_layers"]
    small = RunConfig(workload="tiny_transformer", modes=("bf16-mixed+fp8-blockwise",), steps=2, device="cpu")
    with pytest.raises(ConfigError, match=r"\+fp8-blockwise converts none of CharLM's Linear layers \(blocks\.0\.qkv: "
                                          r"misshaped: 64->192 is not a multiple of fp8-blockwise's block of 128"):
        check_launch(small)


@pytest.mark.parametrize(("recipe", "why"), [
    ("bf16-mixed+fp8-rowwise+mxfp8", r"names 2 matmul-format options \(fp8-rowwise, mxfp8\); choose one"),
    ("bf16-mixed+nvfp4+mxfp8", r"names 2 matmul-format options \(nvfp4, mxfp8\)"),
    ("bf16-true+nvfp4", r"\+nvfp4 runs on top of bf16-mixed"),
    ("16-mixed+mxfp8-wgrad-hp", r"use bf16-mixed\+mxfp8-wgrad-hp"),
])
def test_a_bad_block_scaled_recipe_is_refused_in_one_line_naming_both(recipe, why):
    with pytest.raises(ValueError, match=why):
        parse_recipe(recipe)
    ok, reason = availability(recipe, "cpu")
    assert not ok and "\n" not in reason


def test_keep_leaves_a_module_out_of_the_nvfp4_conversion():
    precision = get_precision("bf16-mixed+nvfp4+keep:blocks.1*", "cpu")
    config = RunConfig(workload="tiny_transformer", modes=(precision.recipe,), device="cpu")
    from amp_core.workloads import WORKLOADS

    model, _ = WORKLOADS["tiny_transformer"].seeded_model_and_batch(config)
    report = precision.recipe_report(model)
    assert report["block_skipped"]["blocks.1.qkv"] == "kept out (+keep: blocks.1)"
    assert "blocks.0.qkv" in report["block_layers"] and not any(n.startswith("blocks.1") for n in
                                                                report["block_layers"])
    prepared = precision.prepare_module(model)
    assert kept_in_fp32(prepared.blocks[1]) and is_kept(prepared.blocks[1])
    assert not kept_in_fp32(prepared.blocks[0]) and not is_kept(prepared.blocks[0])
    assert isinstance(prepared.blocks[0].qkv, BlockScaledLinear)
    assert type(prepared.blocks[1].qkv) is torch.nn.Linear
    assert not math.isnan(prepared(torch.zeros(2, 32, dtype=torch.long)).float().sum().item())


def test_the_advisor_lists_block_scaled_candidates_and_refuses_one_that_converts_nothing_with_why():
    from amp_core.diagnostics.advise import AdviseConfig, check

    _, found = check(AdviseConfig(workload="digits_mlp", budget_s=600))
    by_recipe = {recipe: (ok, note) for recipe, ok, note in found}
    assert by_recipe["bf16-mixed+nvfp4"][0] and "Emulated here" in by_recipe["bf16-mixed+nvfp4"][1]
    ok, why = by_recipe["bf16-mixed+fp8-blockwise"]
    assert not ok and why.startswith("+fp8-blockwise converts none of Net's Linear layers (fc1: misshaped")
