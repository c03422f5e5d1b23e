"""Op inspector page under Streamlit's AppTest: real traces on CPU, no browser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.config import RunConfig
from amp_core.views import optrace as trace_views
from amp_core.views import tables
from pages.common import get_manager
from tests.answered_pages import answered

PAGE = str(Path(__file__).resolve().parents[1] / "pages" / "op_inspector.py")


def frames(app: AppTest, column: str) -> list:
    """The values of the page's dataframes that have `column` (AppTest does not expose a dataframe's key)."""
    return [df.value for df in app.dataframe if column in df.value.columns]


def op_tables(app: AppTest) -> list:
    return frames(app, "inputs")


def column_widths(app: AppTest, column: str) -> list[dict[str, int]]:
    """Pixel width per column of the dataframes that have `column`, from the column config the page sent."""
    return [{name: config.get("width") for name, config in json.loads(df.proto.columns).items() if name != "_index"}
            for df in app.dataframe if column in df.value.columns]


def low_precision(cells) -> bool:
    return any("bf16" in cell or "fp16" in cell for cell in cells)


@pytest.fixture
def app() -> AppTest:
    return answered(AppTest.from_file(PAGE, default_timeout=60).run())


def test_default_view_traces_one_mode_and_runs_the_seed_demo(app):
    assert not app.exception
    assert app.radio(key="opi_source").value == "One mode"
    [table] = op_tables(app)
    assert len(table) > 0 and list(table.columns) == list(trace_views.OP_TABLE_COLUMNS)
    assert not table["note"].str.contains("view").any()  # views hidden by default
    fc1 = table[(table["module"] == "fc1") & (table["op"] == "addmm")].iloc[0]
    assert (fc1["inputs"], fc1["outputs"]) == ("bf16: [256], [16,64], [64,256]", "bf16: [16,256]")
    # Every column is as wide as its longest cell, so "[256], [16, 6" and "_log_softm" read whole.
    [widths] = column_widths(app, "inputs")
    for column in ("module", "op", "inputs", "outputs", "note"):
        assert widths[column] >= max(tables.text_px(text) for text in [column, *table[column]]), column
    assert sum(widths.values()) <= tables.TABLE_WIDTH_PX  # the default trace's table fits the page: no scrolling
    assert "_log_softmax_backward_data" in set(table["op"])
    assert {m.label for m in app.metric} >= {"Casts", "FLOPs in bf16 / fp16"}
    treemap = next(json.loads(c.proto.spec) for c in app.get("plotly_chart") if "opi_treemap_0" in c.proto.id)
    boxes = dict(zip(treemap["data"][0]["ids"], treemap["data"][0]["customdata"], strict=True))
    assert "gradient seed" in boxes["(outside)"] and "forward()" in boxes["(root)"]  # explained on hover
    assert any("**(outside)** holds" in c.value and "**(root)** holds" in c.value for c in app.caption)
    [demo] = frames(app, "expression")
    results = {(row.autocast, row.y, row.expression): row.result for row in demo.itertuples()}
    assert results[("float16", "float32", "x + y")] == "float32"
    assert results[("float16", "float32", "x @ y")] == "float16"
    assert results[("float16", "float16", "x @ y")] == "float16"
    assert results[("bfloat16", "bfloat16", "x + y")] == "float32"
    assert results[("bfloat16", "float32", "x @ y")] == "bfloat16"
    notes = demo.set_index(["autocast", "y", "expression"])[trace_views.NOTES_COLUMN]
    assert notes[("float16", "float32", "x @ y")] == "float16"
    assert (notes.loc["bfloat16"] == "not in the notes (fp16 only)").all()  # no blank cells
    assert "seed notes (CUDA)" not in demo.columns


def test_filters_narrow_the_table(app):
    app.multiselect(key="opi_phase").set_value(["backward"])
    app.multiselect(key="opi_module").set_value(["fc1"]).run()
    assert not app.exception
    [table] = op_tables(app)
    assert set(table["phase"]) == {"backward"} and set(table["module"]) == {"fc1"}
    app.checkbox(key="opi_hide_views").uncheck().run()
    assert (op_tables(app)[0]["note"] == "view").any()


def test_two_modes_side_by_side(app):
    answered(app.radio(key="opi_source").set_value("Two modes side by side").run())
    assert not app.exception
    assert app.selectbox(key="opi_mode_a").value == "32-true"
    first, second = op_tables(app)
    assert not low_precision(first["outputs"]) and low_precision(second["outputs"])
    # Module by module: one narrow table per mode, side by side, rows aligned.
    left, right = frames(app, "low_precision_share")[:2]
    assert list(left["module"]) == list(right["module"]) and "fc1" in set(left["module"])
    fc1 = (left.set_index("module").loc["fc1"], right.set_index("module").loc["fc1"])
    assert (fc1[0]["forward_dtype"], fc1[1]["forward_dtype"]) == ("fp32", "bf16")
    assert any(md.value == "**bf16-mixed**" for md in app.markdown)


def test_other_workload_and_size_by_flops(app):
    app.selectbox(key="opi_workload").set_value("tiny_transformer")
    answered(app.number_input(key="opi_batch").set_value(2).run())  # the box size radio is drawn with the trace
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
        assert low_precision(table["outputs"])
    finally:
        run.stop()


def test_recipe_options_trace_a_recipe_and_one_that_cannot_be_traced_is_refused_in_one_line(app):
    # `+keep:fc2` beside the mode: fc2's matmul runs in fp32 while fc1's stays in the mode's 16-bit dtype.
    answered(app.text_input(key="opi_options").set_value("+keep:fc2").run())
    assert not app.exception and not app.error
    [table] = op_tables(app)
    matmuls = table[table["op"] == "addmm"].groupby("module").first()
    assert matmuls.loc["fc2", "inputs"].startswith("fp32") and matmuls.loc["fc2", "outputs"].startswith("fp32")
    assert low_precision([matmuls.loc["fc1", "inputs"]])
    for options, said in (("keep:fc3", "matches no module"), ("+compile", "a trace runs the step eagerly")):
        answered(app.text_input(key="opi_options").set_value(options).run())
        assert not app.exception
        [error] = [element.value for element in app.error]
        assert error.startswith("Cannot trace:") and said in error and "\n" not in error, error
        assert not op_tables(app)


def test_the_compiled_section_compiles_the_recipe_traced_above(app):
    # +keep:fc2 with inductor: the kept Linear's matmul is an fp32 op of the compiled forward graph, fc1's a bf16 one.
    answered(app.text_input(key="opi_options").set_value("keep:fc2").run())
    app.toggle(key="opi_compiled").set_value(True).run()
    assert not app.exception and not app.error, [e.value for e in app.error]
    assert app.toggle(key="opi_compiled").label == "Compile bf16-mixed+keep:fc2 with inductor and show what ran"
    [ops] = frames(app, "is_cast")
    forward = ops[(ops["phase"] == "forward") & ops["op"].isin(["aten.mm.default", "aten.addmm.default"])]
    assert sorted(forward["dtype"]) == ["bf16", "fp32"], forward  # fc1's, then the kept fc2's
