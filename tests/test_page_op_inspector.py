"""Op inspector page under Streamlit's AppTest: real traces on CPU, no browser."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.config import RunConfig
from pages.common import get_manager

PAGE = str(Path(__file__).resolve().parents[1] / "pages" / "op_inspector.py")


def frames(app: AppTest, column: str) -> list:
    """The values of the page's dataframes that have `column` (AppTest does not expose a dataframe's key)."""
    return [df.value for df in app.dataframe if column in df.value.columns]


def op_tables(app: AppTest) -> list:
    return frames(app, "in_shapes")


@pytest.fixture
def app() -> AppTest:
    return AppTest.from_file(PAGE, default_timeout=60).run()


def test_default_view_traces_one_mode_and_runs_the_seed_demo(app):
    assert not app.exception
    assert app.radio(key="opi_source").value == "One mode"
    [table] = op_tables(app)
    assert len(table) > 0 and {"phase", "module", "op", "in_dtypes", "out_dtypes", "flops"} <= set(table.columns)
    assert not table["is_view"].any()  # views hidden by default
    assert {m.label for m in app.metric} >= {"Casts", "FLOPs in bf16 / fp16"}
    [demo] = frames(app, "expression")
    results = {(row.autocast, row.y, row.expression): row.result for row in demo.itertuples()}
    assert results[("float16", "float32", "x + y")] == "float32"
    assert results[("float16", "float32", "x @ y")] == "float16"
    assert results[("float16", "float16", "x @ y")] == "float16"
    assert results[("bfloat16", "bfloat16", "x + y")] == "float32"
    assert results[("bfloat16", "float32", "x @ y")] == "bfloat16"


def test_filters_narrow_the_table(app):
    app.multiselect(key="opi_phase").set_value(["backward"])
    app.multiselect(key="opi_module").set_value(["fc1"]).run()
    assert not app.exception
    [table] = op_tables(app)
    assert set(table["phase"]) == {"backward"} and set(table["module"]) == {"fc1"}
    app.checkbox(key="opi_hide_views").uncheck().run()
    assert op_tables(app)[0]["is_view"].any()


def test_two_modes_side_by_side(app):
    app.radio(key="opi_source").set_value("Two modes side by side").run()
    assert not app.exception
    assert app.selectbox(key="opi_mode_a").value == "32-true"
    first, second = op_tables(app)
    assert set(first["compute_dtype"]) - {""} == {"fp32"}
    assert "bf16" in set(second["compute_dtype"])
    assert len(frames(app, "forward_dtype [bf16-mixed]")) == 1


def test_other_workload_and_size_by_flops(app):
    app.selectbox(key="opi_workload").set_value("tiny_transformer")
    app.number_input(key="opi_batch").set_value(2)
    app.radio(key="opi_size_by").set_value("flops").run()
    assert not app.exception
    assert "blocks.0.qkv" in set(op_tables(app)[0]["module"])


def test_live_lane_without_runs_says_so(app):
    app.radio(key="opi_source").set_value("A live lane").run()
    assert not app.exception
    assert any("No live runs" in info.value for info in app.info)


def test_live_lane_is_traced_on_click(stepped_launches, no_leaked_threads):
    run = get_manager().launch(RunConfig(workload="digits_mlp", modes=("32-true", "bf16-mixed"), steps=100_000,
                                         batch_size=16, device="cpu", gradstats_every=0))
    try:
        run.wait_until(lambda r: all(lane.steps_done >= 1 for lane in r.lanes))
        app = AppTest.from_file(PAGE, default_timeout=60).run()
        app.radio(key="opi_source").set_value("A live lane").run()
        lane_labels = app.selectbox(key="opi_lane").options
        app.selectbox(key="opi_lane").set_value(next(label for label in lane_labels if "bf16-mixed" in label)).run()
        app.button(key="opi_trace_lane").click().run()
        assert not app.exception and not app.error
        [table] = op_tables(app)
        assert "bf16" in set(table["compute_dtype"])
    finally:
        run.stop()
