"""The Formats page under AppTest: renders, its figures follow from the bit layouts, typed values fill the table."""

import json
import math
from pathlib import Path

import pytest
import torch
from format_layouts import LAYOUTS
from streamlit.testing.v1 import AppTest

PAGE = str(Path(__file__).resolve().parents[1] / "pages" / "formats.py")
PAGE_WIDTH_PX = 978
"""Width of a table at 1440 x 900 with the sidebar open: 980 px measured in Chromium, less its borders."""


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
    facts = _frame(app, "format", "source")  # the exact table, in its expander
    assert list(facts.index) == list(LAYOUTS)
    for name, layout in LAYOUTS.items():
        row = facts.loc[name]
        assert (int(row["bits"]), int(row["exponent"]), int(row["mantissa"])) == (
            layout.bits, layout.exponent_bits, layout.mantissa_bits)
        assert float(row["max"]) == layout.max
        assert float(row["smallest normal"]) == layout.smallest_normal
        assert float(row["smallest subnormal"]) == layout.smallest_subnormal
        assert float(row["eps"]) == layout.eps


def test_the_first_table_reads_short_and_the_exact_one_keeps_every_digit(app):
    short = _frame(app, "format", "sign · exponent · mantissa")
    assert short.loc["fp32", "max"] == "3.403 × 10³⁸" and short.loc["fp16", "max"] == "65504"
    assert short.loc["fp32", "smallest normal"] == "2⁻¹²⁶ ≈ 1.175 × 10⁻³⁸"
    assert short.loc["bf16", "eps"] == "2⁻⁷ = 0.0078125"
    assert short.map(lambda cell: len(str(cell))).to_numpy().max() <= 22  # no 17-digit numbers
    exact = _frame(app, "format", "source")
    assert exact.loc["fp32", "max"] == repr(torch.finfo(torch.float32).max)
    (expander,) = [e for e in app.expander if e.label.startswith("Exact values")]
    assert not expander.proto.expanded


def test_tables_fit_the_page(app):
    """The sized tables' column widths add up to what a 1440-px-wide window shows beside the sidebar, and the wide
    softmax table comes in two parts."""
    sized = [df for df in app.dataframe if {"sign · exponent · mantissa", "what happened"} & set(df.value.columns)]
    assert len(sized) == 2
    for df in sized:
        config = {name: c for name, c in json.loads(df.proto.columns).items() if name != "_index"}
        assert set(config) == set(df.value.columns)  # every column sized
        assert sum(c["width"] for c in config.values()) <= PAGE_WIDTH_PX, list(df.value.columns)
    forward, loss = [df.value for df in app.dataframe if df.value.columns[0] == "dtype"][:2]
    assert "naive softmax" in forward.columns and "grad, stable CE" in loss.columns
    assert len(forward.columns) == len(loss.columns) == 5


def test_number_line_is_log_and_marks_the_value(app):
    (chart,) = app.get("plotly_chart")
    spec = json.loads(chart.proto.spec)
    assert spec["layout"]["xaxis"]["type"] == "log"
    value_lines = [trace for trace in spec["data"] if trace["name"].startswith("|value|")]
    assert [line["x"] for line in value_lines] == [[65520.0, 65520.0]]
    maxima = {trace["y"][0]: trace["x"][0] for trace in spec["data"] if trace["name"] == "max"}
    assert maxima == {name: layout.max for name, layout in LAYOUTS.items()}
    labels = {trace["y"][0]: trace["text"][0] for trace in spec["data"] if trace["name"] == "max"}
    assert labels["fp32"] == "max 3.403×10<sup>38</sup>" and labels["fp16"] == "max 65504"  # no "3.403e+3" cut
    assert all(trace["cliponaxis"] is False for trace in spec["data"] if trace["name"] == "max")


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
    fixed_loss = next(df.value.set_index("dtype") for df in app.dataframe if "stable cross-entropy" in df.value.columns)
    assert fixed.loc["fp32", "naive softmax"] == "[nan, 0]"
    assert fixed.loc["fp32", "stable softmax"] == "[1, 0]"
    assert fixed_loss.loc["fp32", "stable cross-entropy"] == "500"
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


def test_a_block_with_an_outlier_shows_nvfp4_flushing_its_neighbours_and_mxfp8_keeping_them(app):
    [block] = [df.value for df in app.dataframe if "NVFP4" in df.value.columns]
    outlier = block["value"].abs().idxmax()
    neighbours = block.index[(block.index // 16 == outlier // 16) & (block.index != outlier)]
    assert (block.loc[neighbours, "NVFP4"] == 0).sum() > 3  # its 16 share the outlier's scale
    assert (block.loc[neighbours, "MXFP8"] != 0).all() and block.loc[outlier, "MXFP8"] == 30.0
    assert any("one e8m0 scale for the 32" in c.value for c in app.caption)
    app.text_input(key="fmt_block").set_value("1, 2, inf").run()
    assert not app.exception and "finite values only" in app.error[0].value
