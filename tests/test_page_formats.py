"""The Formats page under AppTest: renders, its figures follow from the bit layouts, typed values fill the table."""

import json
import math
from pathlib import Path

import pytest
import torch
from format_layouts import LAYOUTS
from streamlit.testing.v1 import AppTest

PAGE = str(Path(__file__).resolve().parents[1] / "pages" / "formats.py")


@pytest.fixture
def app() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception
    return at


def _frame(at: AppTest, first_column: str, index: str):
    """The one dataframe on the page whose first column is `first_column`, indexed by it."""
    frames = [df.value for df in at.dataframe if df.value.columns[0] == first_column and index in df.value.columns]
    assert len(frames) == 1, [list(df.value.columns) for df in at.dataframe]
    return frames[0].set_index(first_column)


def test_renders_and_facts_follow_from_the_bit_layout(app):
    assert not app.error
    facts = _frame(app, "format", "smallest subnormal")
    assert list(facts.index) == list(LAYOUTS)
    for name, layout in LAYOUTS.items():
        row = facts.loc[name]
        assert (int(row["bits"]), int(row["exponent"]), int(row["mantissa"])) == (
            layout.bits, layout.exponent_bits, layout.mantissa_bits)
        assert float(row["max"]) == layout.max
        assert float(row["smallest normal"]) == layout.smallest_normal
        assert float(row["smallest subnormal"]) == layout.smallest_subnormal
        assert float(row["eps"]) == layout.eps


def test_number_line_is_log_and_marks_the_value(app):
    (chart,) = app.get("plotly_chart")
    spec = json.loads(chart.proto.spec)
    assert spec["layout"]["xaxis"]["type"] == "log"
    value_lines = [trace for trace in spec["data"] if trace["name"].startswith("|value|")]
    assert [line["x"] for line in value_lines] == [[65520.0, 65520.0]]
    maxima = {trace["y"][0]: trace["x"][0] for trace in spec["data"] if trace["name"] == "max"}
    assert maxima == {name: layout.max for name, layout in LAYOUTS.items()}


@pytest.mark.parametrize(("text", "expected"), [
    ("65520", {"fp16": "inf", "bf16": "65536", "fp32": "65520", "fp8 e4m3fn": "448", "fp8 e5m2": "inf"}),
    ("1e-8", {"fp16": "0", "fp8 e5m2": "0", "fp32": repr(torch.tensor(1e-8).item())}),
    ("1 + 2^-8", {"bf16": "1", "fp16": "1.00390625", "tf32": "1.00390625"}),
])
def test_typed_value_fills_the_rounding_table(app, text, expected):
    app.text_input(key="fmt_value").set_value(text).run()
    assert not app.exception and not app.error
    table = _frame(app, "format", "what happened")
    assert {name: table.loc[name, "stored"] for name in expected} == expected


def test_rounding_statuses_are_shown(app):
    table = _frame(app, "format", "what happened")  # default value 65520
    assert table.loc["fp16", "what happened"] == "overflow to inf"
    assert table.loc["fp8 e4m3fn", "what happened"] == "overflow saturated to ±max (no inf)"
    assert table.loc["fp16", "bits"] == "0 11111 0000000000"


def test_bad_text_is_an_error_not_a_traceback(app):
    app.text_input(key="fmt_value").set_value("12abc").run()
    assert not app.exception
    assert any("Cannot read the value" in error.value for error in app.error)
    assert all("what happened" not in df.value.columns for df in app.dataframe)
    app.text_input(key="fmt_logit").set_value("").run()
    assert not app.exception
    assert any("Cannot read the logit" in error.value for error in app.error)


def test_softmax_tables(app):
    fixed, user = [df.value.set_index("dtype") for df in app.dataframe if "naive softmax" in df.value.columns]
    assert fixed.loc["fp32", "naive softmax"] == "[nan, 0]"
    assert fixed.loc["fp32", "stable softmax"] == "[1, 0]"
    assert fixed.loc["fp32", "stable cross-entropy"] == "500"
    assert user.loc["fp16", "naive softmax"] == "[nan, 0]"  # default logit 12 > ln(65504)
    assert "nan" not in user.loc["bf16", "naive softmax"]
    app.text_input(key="fmt_logit").set_value("89").run()
    user = [df.value.set_index("dtype") for df in app.dataframe if "naive softmax" in df.value.columns][1]
    assert user.loc["fp32", "naive softmax"] == "[nan, 0]"
    assert user.loc["fp64", "naive softmax"] == "[1, 2.22736e-39]"
    safe = _frame(app, "dtype", "ln(max)")
    assert float(safe.loc["fp16", "ln(max)"]) == math.log(65504.0)
    # The edge, checked with torch itself: exp of the page's logit is finite in fp32, exp of the next fp32 is not.
    logit = torch.tensor(float(safe.loc["fp32", "largest safe logit (measured)"]), dtype=torch.float32)
    assert torch.isfinite(torch.exp(logit)) and torch.isinf(torch.exp(torch.nextafter(logit, torch.tensor(math.inf))))
