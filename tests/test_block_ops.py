"""The op inspector on block-scaled lanes: a trace of an emulated lane names, per Linear and phase, each operand's
quantise+dequantise with its format and blocks (Hadamard transform and stochastic rounding where the recipe applies
them) and each GEMM of quantised operands, from the ops that really ran; other lanes' traces name none, and nothing
is named outside a trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest
from torch import nn

from amp_core.config import RunConfig
from amp_core.formats import stages
from amp_core.precision import get_precision
from amp_core.probes import optrace
from amp_core.views.optrace import block_stage_table
from pages.common import get_manager

TOKENS, WIDTH, HIDDEN = 256, 128, 256


def traced(recipe: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
    batch = (torch.randn(TOKENS, WIDTH), torch.randn(TOKENS, WIDTH))
    trace = optrace.trace_step(model, get_precision(recipe, "cpu"), nn.functional.mse_loss, batch)
    return block_stage_table(trace.to_frame())


EXPECTED = {
    # recipe: (format, weight layout forward, weight layout backward, block, grad-weight quantised, RHT, SR)
    "bf16-mixed+mxfp8": ("mxfp8", "1x32 blocks along in_features", "1x32 blocks along out_features", 32, True, False,
                         False),
    "bf16-mixed+mxfp8-wgrad-hp": ("mxfp8", "1x32 blocks along in_features", "1x32 blocks along out_features", 32,
                                  False, False, False),
    "bf16-mixed+nvfp4": ("nvfp4", "16x16 tiles", "16x16 tiles", 16, True, True, True),
    "bf16-mixed+nvfp4-no-rht": ("nvfp4", "16x16 tiles", "16x16 tiles", 16, True, False, True),
    "bf16-mixed+nvfp4-no-sr": ("nvfp4", "16x16 tiles", "16x16 tiles", 16, True, True, False),
    "bf16-mixed+nvfp4-1d": ("nvfp4", "1x16 blocks along in_features", "1x16 blocks along out_features", 16, True,
                            True, True),
    "bf16-mixed+fp8-blockwise": ("fp8-blockwise", "128x128 tiles", "128x128 tiles", 128, True, False, False),
}


@pytest.mark.parametrize("recipe", list(EXPECTED))
def test_a_block_scaled_trace_names_each_quantise_and_gemm_with_its_format_and_blocks(recipe):
    fmt, weight_fwd, weight_bwd, block, wgrad, rht, sr = EXPECTED[recipe]
    table = traced(recipe)
    for layer, (fan_in, fan_out) in {"0": (WIDTH, HIDDEN), "2": (HIDDEN, WIDTH)}.items():
        mine = table[table["module"] == layer]
        forward = list(mine[mine["phase"] == "forward"]["stage"])
        assert forward == [f"quantise+dequantise input · {fmt} · 1x{block} blocks along in_features",
                           f"quantise+dequantise weight · {fmt} · {weight_fwd}",
                           f"GEMM forward (input x weight) · {fmt} operands (emulated: fp32 product)"]
        backward = list(mine[mine["phase"] == "backward"]["stage"])
        rounding = ", stochastic rounding" if sr else ""
        # The first layer's input needs no gradient: it has no grad-input GEMM.
        grad_input = [
            f"quantise+dequantise grad_output · {fmt} · 1x{block} blocks along out_features{rounding}",
            f"quantise+dequantise weight · {fmt} · {weight_bwd}",
            f"GEMM grad-input (grad_output x weight) · {fmt} operands (emulated: fp32 product)"] if layer == "2" else []
        assert backward[:len(grad_input)] == grad_input
        backward = backward[len(grad_input):]
        if not wgrad:
            assert backward == ["GEMM grad-weight (grad_output x input) · high precision (not quantised)"]
        else:
            hadamard = " (Hadamard-transformed)" if rht else ""
            quantised = [f"quantise+dequantise grad_output · {fmt} · 1x{block} blocks along tokens{hadamard}"
                         f"{rounding}", f"quantise+dequantise input · {fmt} · 1x{block} blocks along tokens{hadamard}"]
            assert [s for s in backward if s.startswith("quantise")] == quantised
            assert any(s.startswith("random Hadamard transform") for s in backward) == rht
            assert backward[-1] == f"GEMM grad-weight (grad_output x input) · {fmt} operands (emulated: fp32 product)"
        gemms = mine[mine["stage"].str.startswith("GEMM")]
        assert list(gemms["FLOPs"]) == [2 * TOKENS * fan_in * fan_out] * (3 if grad_input else 2)  # real counts
        assert (mine[mine["stage"].str.startswith("quantise")]["ops"] > 5).all()
    assert stages._listeners == 0 and stages.current() == ""  # the trace is over: nothing names stages any more


def test_a_plain_lanes_trace_names_no_block_stage_and_training_outside_a_trace_names_none():
    assert traced("bf16-mixed").empty
    layer = get_precision("bf16-mixed+nvfp4", "cpu").prepare_module(nn.Sequential(nn.Linear(32, 32)))
    seen = []
    hook = layer[0].register_forward_pre_hook(lambda module, args: seen.append(stages.current()))
    layer(torch.randn(16, 32)).sum().backward()
    hook.remove()
    assert seen == [""] and stages._listeners == 0
    # A copy of a prepared lane's model (what an op trace or a replay of a live lane takes) is converted anew; in
    # 32-true (a replay's reference) it computes plain fp32 again, with the same Parameters.
    weight = layer[0].weight
    again = get_precision("bf16-mixed+nvfp4", "cpu").prepare_module(layer)
    assert type(again[0]).__name__ == "BlockScaledLinear" and again[0].weight is weight
    reference = get_precision("32-true", "cpu").prepare_module(again)
    assert type(reference[0]) is nn.Linear and reference[0].weight is weight and not hasattr(reference[0], "recipe")
    x = torch.randn(4, 32)
    assert torch.equal(reference(x), nn.functional.linear(x, weight, reference[0].bias))


def test_the_op_inspector_shows_a_block_scaled_lanes_stages(stepped_launches, no_leaked_threads):
    run = get_manager().launch(RunConfig(workload="tiny_transformer", modes=("bf16-mixed", "bf16-mixed+nvfp4"),
                                         steps=100_000, device="cpu", gradstats_every=0))
    try:
        run.wait_until(lambda r: all(lane.steps_done >= 1 for lane in r.lanes))
        page = str(Path(__file__).resolve().parents[1] / "pages" / "op_inspector.py")
        app = AppTest.from_file(page, default_timeout=120).run()
        app.radio(key="opi_source").set_value("A live lane").run()
        labels = app.selectbox(key="opi_lane").options
        app.selectbox(key="opi_lane").set_value(next(label for label in labels if "nvfp4" in label)).run()
        app.button(key="opi_trace_lane").click().run()
        assert not app.exception and not app.error, [e.value for e in app.error]
        assert any(h.value == "Block-scaled GEMMs: what quantised what" for h in app.subheader)
        [table] = [df.value for df in app.dataframe if "stage" in df.value.columns]
        assert "quantise+dequantise weight · nvfp4 · 16x16 tiles" in set(table["stage"])
        assert set(table["module"]) >= {"blocks.0.qkv", "head"}
    finally:
        run.stop()


COMPILE_OPTIONS = ("compile", "compile-max-autotune")


@pytest.mark.parametrize("compiled", COMPILE_OPTIONS)
@pytest.mark.parametrize("block", ["mxfp8", "mxfp8-wgrad-hp", "nvfp4", "nvfp4-no-sr", "fp8-blockwise"])
def test_compile_with_an_emulated_block_scaled_recipe_is_refused_in_one_line_naming_both(block, compiled):
    from amp_core.config import ConfigError
    from amp_core.precision import availability
    from amp_core.workloads import check_launch

    ok, why = availability(f"bf16-mixed+{block}+{compiled}", "cpu")
    assert not ok and why.startswith(f"+{compiled} with +{block} is refused where ") and "\n" not in why
    with pytest.raises(ConfigError, match=rf"^modes: bf16-mixed\+{block}\+{compiled} cannot run on this device: "
                                          rf"\+{compiled} with \+{block} is refused where .* emulated"):
        check_launch(RunConfig(workload="tiny_transformer", modes=("bf16-mixed", f"bf16-mixed+{block}+{compiled}")))
    assert availability(f"bf16-mixed+{block}", "cpu")[0]  # eager, the same recipe races
    assert availability(f"bf16-mixed+{compiled}", "cpu")[0]


def test_the_cli_refuses_a_compiled_emulated_block_scaled_lane_in_one_line():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "amp_core", "run", "--workload", "tiny_transformer", "--modes",
                           "bf16-mixed,bf16-mixed+nvfp4+compile", "--steps", "2"], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: modes: bf16-mixed+nvfp4+compile cannot run on this device: +compile with +nvfp4 "
                           "is refused where nvfp4 is emulated")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (10, 0),
                    reason="torchao's MXFP8 kernels need a Blackwell GPU (sm100)")
def test_compile_composes_with_torchaos_mxfp8_kernels_on_a_gpu_that_has_them():
    from amp_core.precision import availability

    assert availability("bf16-mixed+mxfp8+compile", "cuda")[0]
