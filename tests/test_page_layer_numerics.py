"""Layer numerics page under Streamlit's AppTest: real probes on CPU, real runs (with and without amax samples)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest
from torch import nn

from amp_core.config import RunConfig
from amp_core.probes import numerics
from amp_core.probes.numerics import LAYER_AMAX_EVENT
from amp_core.workloads import WORKLOADS, Data, Workload
from pages.answered import ANSWER_POLL_S, answer_board
from pages.common import get_manager
from tests.answered_pages import answered, awaiting_notes
from tests.test_numerics import OVERFLOW

PAGE = str(Path(__file__).resolve().parents[1] / "pages" / "layer_numerics.py")


def figures(app: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]


def titled(app: AppTest, text: str) -> list[dict]:
    return [f for f in figures(app) if text in f["layout"].get("title", {}).get("text", "")]


def tables(app: AppTest, column: str) -> list:
    return [df.value for df in app.dataframe if column in df.value.columns]


@pytest.fixture
def app() -> AppTest:
    return answered(AppTest.from_file(PAGE, default_timeout=120).run())


def test_default_view_probes_tiny_transformer_in_16_mixed(app):
    assert not app.exception and not app.error
    assert app.selectbox(key="lnum_workload").value == "tiny_transformer"
    assert app.selectbox(key="lnum_mode").value == "16-mixed"
    assert any("No inf or NaN" in s.value for s in app.success)
    [errors] = tables(app, "output_error")
    assert "blocks.0.qkv" in set(errors["module"]) and (errors["output_error"] >= 0).all()
    assert list(errors["output_error"]) == sorted(errors["output_error"], reverse=True)
    [error_chart] = titled(app, "Error of each module's output")
    assert error_chart["layout"]["xaxis"]["type"] == "log" and len(error_chart["data"][0]["y"]) == len(errors)
    assert titled(app, "Range of each module's output")
    assert {m.label for m in app.metric} >= {"Loss", "Worst output error", "Loss scale"}
    assert any("No runs yet" in i.value for i in app.info)


def test_the_page_is_drawn_before_its_probe_ends_and_the_report_joins_it(fragment_timers):
    """The probe runs off the page's script thread: while the server's answer board is busy with another probe (the
    test's own, asked of the same board), the page draws its controls, its over-time section and a one-line note
    that looks again every ANSWER_POLL_S; once the probe is answered the report joins the page, the same report the
    probe makes when called directly; a new session finds it made and draws it at once."""
    answer_board.clear()  # a fresh board: no earlier test's answer is remembered
    release = threading.Event()
    ahead = answer_board().ask("the test's probe", release.wait)
    try:
        app = AppTest.from_file(PAGE, default_timeout=120).run()
        assert not app.exception and not app.error
        assert app.selectbox(key="lnum_workload").value == "tiny_transformer"
        assert app.selectbox(key="lnum_mode").value == "16-mixed"
        assert any("No runs yet" in i.value for i in app.info)  # the sections below the probe are drawn
        [note] = awaiting_notes(app)
        assert "Probing one forward + backward in 16-mixed and in fp32" in note and "1 other probe first" in note
        assert not figures(app) and not app.metric and not tables(app, "output_error")
        assert fragment_timers["note"] == ANSWER_POLL_S
    finally:
        release.set()
    assert ahead.done.wait(60) and ahead.value is True
    answered(app)
    assert not app.exception and not app.error
    assert not awaiting_notes(app)
    [errors] = tables(app, "output_error")
    direct = numerics.probe_workload("tiny_transformer", "16-mixed", size="small", device="cpu",
                                     batch_size=numerics.DEFAULT_NUMERICS_BATCH)
    pd.testing.assert_frame_equal(errors, direct.error_frame().reset_index(drop=True), check_dtype=False)
    assert titled(app, "Quantisation SNR of each GEMM operand")  # the block-scaled probe, answered after it
    again = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not awaiting_notes(again)
    assert titled(again, "Error of each module's output") and titled(again, "Quantisation SNR of each GEMM operand")


def test_the_block_scaled_section_names_the_first_layer_below_its_threshold_with_a_heatmap(app):
    assert app.multiselect(key="lnum_formats").value == ["nvfp4", "mxfp8"]
    [heatmap] = titled(app, "Quantisation SNR of each GEMM operand")
    assert heatmap["data"][0]["type"] == "heatmap" and "nvfp4 · grad_output" in heatmap["data"][0]["x"]
    [table] = tables(app, "SNR dB")
    assert set(table["format"]) == {"nvfp4", "mxfp8"} and "blocks.0.qkv" in set(table["layer"])
    verdicts = [m.value for m in (*app.warning, *app.success) if m.value.startswith(("nvfp4:", "mxfp8:"))]
    assert len(verdicts) == 2 and any(v.startswith("mxfp8: every layer keeps") for v in verdicts)
    answered(app.multiselect(key="lnum_formats").set_value(["fp8-blockwise"]).run())
    assert not app.exception
    assert any(i.value.startswith("fp8-blockwise: no Linear layer measured") for i in app.info)
    assert any("misshaped" in c.value for c in app.caption)


def test_the_first_non_finite_module_is_highlighted_with_why(app, monkeypatch):
    monkeypatch.setitem(WORKLOADS, OVERFLOW.name, OVERFLOW)
    app.run()  # the selectbox lists the workload registered at run time
    answered(app.selectbox(key="lnum_workload").set_value(OVERFLOW.name).run())
    assert not app.exception
    [error] = app.error
    assert "First non-finite: `planted` (forward)" in error.value and "65504" in error.value
    assert any("Its inputs" in c.value for c in app.caption)


def test_switching_the_tensor_shows_gradient_ranges(app):
    answered(app.selectbox(key="lnum_workload").set_value("digits_mlp").run())  # the radio is drawn with a report
    app.radio(key="lnum_tensor").set_value("grad").run()
    assert not app.exception
    assert titled(app, "Range of each module's grad")
    (ranges,) = tables(app, "fp16_zero")  # the headers leave the tensor out: the radio says it
    assert ranges["abs_max"].notna().all() and "grad_fp16_zero" not in ranges


class Broken(Workload):
    name = "broken_numerics"
    title = "broken"
    sizes = {"small": {}}

    def load_data(self, config) -> Data:
        return Data(torch.randn(8, 2), torch.randn(8, 1), "")

    def build_model(self, size: str, data: Data) -> nn.Module:
        raise RuntimeError("CUDA out of memory (planted)\nsecond line")

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def test_a_failing_probe_is_a_message_not_a_traceback(app, monkeypatch):
    monkeypatch.setitem(WORKLOADS, Broken.name, Broken())
    app.run()
    answered(app.selectbox(key="lnum_workload").set_value(Broken.name).run())
    assert not app.exception
    [error] = app.error
    assert error.value == "The probe failed: CUDA out of memory (planted). Try a smaller size or batch."


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_run_without_samples_says_how_to_get_them(no_leaked_threads):
    run = get_manager().launch(RunConfig(workload="digits_mlp", modes=("32-true",), steps=5, device="cpu"))
    run.join(60)
    app = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not app.exception
    assert any("did not sample layer amax" in i.value for i in app.info)
    assert not titled(app, "Abs max")


def test_a_run_that_sampled_amax_shows_its_heatmap(no_leaked_threads):
    run = get_manager().launch(RunConfig(workload="digits_mlp", modes=("32-true", "16-mixed"), steps=40,
                                         device="cpu", amax_every=10, gradstats_every=0))
    run.join(60)
    assert sum(e.kind == LAYER_AMAX_EVENT for e in run.events()) == 8
    app = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not app.exception and not app.error
    [heatmap] = titled(app, "Abs max of each module's output")
    assert heatmap["data"][0]["y"] == ["fc1", "fc2", "(root)", "(loss)"]
    assert heatmap["data"][0]["x"] == [0, 10, 20, 30]
    assert any("closest to fp16's limit" in m.value for m in app.markdown)
    app.selectbox(key=f"lnum_amax_lane_{run.run_id}").set_value(1)
    app.radio(key=f"lnum_amax_which_{run.run_id}").set_value("grad").run()
    [heatmap] = titled(app, "output gradient")
    assert "16-mixed" in heatmap["layout"]["title"]["text"]


def test_launching_a_sampled_run_from_the_page(no_leaked_threads):
    app = AppTest.from_file(PAGE, default_timeout=120).run()
    app.selectbox(key="lnum_run_workload").set_value("digits_mlp")
    app.multiselect(key="lnum_run_modes").set_value(["32-true"])
    app.number_input(key="lnum_run_steps").set_value(20)
    app.number_input(key="lnum_run_every").set_value(5)
    app.button(key="FormSubmitter:lnum_launch_form-Launch").click().run()
    assert not app.exception and not app.error
    [run] = get_manager().runs()
    assert run.config.amax_every == 5 and run.config.workload == "digits_mlp"
    run.join(60)
    app.run()
    assert titled(app, "Abs max of each module's output")


def test_live_lane_is_probed_on_click(no_leaked_threads):
    run = get_manager().launch(RunConfig(workload="digits_mlp", modes=("32-true", "16-mixed"), steps=100_000,
                                         batch_size=16, device="cpu", gradstats_every=0))
    try:
        wait_for(lambda: all(lane.steps_done >= 1 for lane in run.lanes))
        app = AppTest.from_file(PAGE, default_timeout=120).run()
        app.radio(key="lnum_source").set_value("A live lane").run()
        labels = app.selectbox(key="lnum_lane").options
        app.selectbox(key="lnum_lane").set_value(next(label for label in labels if "16-mixed" in label)).run()
        app.button(key="lnum_probe_lane").click().run()
        assert not app.exception and not app.error
        assert any("lane 1" in s.value and "16-mixed" in s.value for s in app.success)
        assert titled(app, "Error of each module's output")
    finally:
        run.stop()


def test_live_lane_without_runs_says_so(app):
    app.radio(key="lnum_source").set_value("A live lane").run()
    assert not app.exception
    assert any("No live runs" in i.value for i in app.info)


@pytest.mark.extra("recipes")
def test_an_fp8_lanes_samples_measure_e4m3_and_e5m2_and_the_page_shows_them(no_leaked_threads):
    run = get_manager().launch(RunConfig(workload="tiny_transformer", size="small", steps=4, amax_every=2,
                                         modes=("bf16-mixed", "bf16-mixed+fp8-rowwise"), device="cpu",
                                         gradstats_every=0))
    run.join(120)
    samples = [e for e in run.events() if e.kind == LAYER_AMAX_EVENT]
    assert sorted((e.lane, e.step) for e in samples) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert all("shares" not in e.data for e in samples if e.lane == 0)  # a plain lane's samples stay light
    fp8 = [e.data for e in samples if e.lane == 1]
    for data in fp8:
        assert data["fp8"]["recipe"] == "rowwise" and data["fp8"]["casts"]["grad"] == "fp8 e4m3fn scaled"
        for which in ("output", "grad"):
            shares = data["shares"][which]
            assert {"fp8 e4m3fn", "fp8 e5m2", "fp8 e4m3fn scaled", "fp8 e5m2 scaled"} <= set(shares)
            measured = [v for v in shares["fp8 e4m3fn scaled"]["overflow"] if v is not None]
            assert measured and not any(measured)  # torchao's scale maps each row's max to e4m3's: none overflows
        # The gradients are tiny: a plain cast to e4m3 flushes many of them to 0, torchao's scaled cast keeps them.
        grads = data["shares"]["grad"]
        plain = sum(v or 0 for v in grads["fp8 e4m3fn"]["zero"])
        scaled = sum(v or 0 for v in grads["fp8 e4m3fn scaled"]["zero"])
        assert plain > scaled
    app = AppTest.from_file(PAGE, default_timeout=120).run()
    app.selectbox(key=f"lnum_amax_lane_{run.run_id}").set_value(1).run()
    assert not app.exception and not app.error
    radio = app.radio(key="lnum_cast_format")
    assert {"fp8 e4m3fn", "fp8 e5m2", "fp8 e4m3fn scaled", "fp8 e5m2 scaled"} <= set(radio.options)
    assert radio.value == "fp8 e4m3fn scaled"  # the format torchao casts a rowwise lane's outputs to
    assert any("torchao rowwise" in c.value and "one scale per row" in c.value for c in app.caption)
    [table] = tables(app, "subnormal")
    assert list(table.columns) == ["module", "overflow", "subnormal", "zero"]
    assert list(table["module"]) == fp8[-1]["modules"]
    radio.set_value("fp8 e5m2").run()
    [table] = tables(app, "subnormal")
    assert list(table.columns) == ["module", "overflow", "subnormal", "zero"]  # not "fp8 e5m2 scaled"'s too
    expected = fp8[-1]["shares"]["output"]["fp8 e5m2"]["zero"]
    assert table["zero"].fillna(-1).tolist() == [-1 if v is None else v for v in expected]


def test_recipe_options_probe_a_recipe_and_a_compiled_one_is_refused_in_one_line(app):
    # `+keep:blocks.*.mlp` beside 16-mixed: the kept MLPs' outputs are fp32 against the fp32 run, the rest fp16.
    answered(app.text_input(key="lnum_options").set_value("+keep:blocks.*.mlp").run())
    assert not app.exception and not app.error
    [errors] = tables(app, "output_error")
    dtypes = errors.set_index("module")["dtype"]
    assert dtypes["blocks.0.mlp"] == dtypes["blocks.1.mlp"] == "fp32" and dtypes["blocks.0.qkv"] == "fp16"
    answered(app.text_input(key="lnum_options").set_value("compile").run())
    assert not app.exception
    [error] = [element.value for element in app.error]
    assert error.startswith("Cannot probe: mode: 16-mixed+compile: a probe runs the step eagerly"), error
    assert not tables(app, "output_error")
