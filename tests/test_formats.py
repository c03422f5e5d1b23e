"""amp_core.formats against real torch and the formats' definitions: facts, bit patterns, rounding, TF32, softmax."""

import math
import random

import pytest
import torch
from format_layouts import LAYOUTS

from amp_core.probes import formats
from amp_core.views import formats as format_views

TORCH_FORMATS = [name for name in formats.FORMAT_NAMES if name != "tf32"]
SIXTEEN_AND_EIGHT_BIT = [name for name in TORCH_FORMATS if torch.finfo(formats.FORMATS[name]).bits <= 16]
INT_VIEW = {8: torch.uint8, 16: torch.int16}


def _all_values(name: str) -> torch.Tensor:
    """Every bit pattern of an 8/16-bit format, as float64."""
    width = torch.finfo(formats.FORMATS[name]).bits
    patterns = torch.arange(2**width, dtype=torch.int64)
    if width == 16:
        patterns = torch.where(patterns >= 2**15, patterns - 2**16, patterns)
    return patterns.to(INT_VIEW[width]).view(formats.FORMATS[name]).to(torch.float64)


@pytest.mark.parametrize("name", formats.FORMAT_NAMES)
def test_facts_follow_from_the_bit_layout(name):
    info, layout = formats.format_info(name), LAYOUTS[name]
    assert (info.sign_bits, info.exponent_bits, info.mantissa_bits, info.bits) == (
        1, layout.exponent_bits, layout.mantissa_bits, layout.bits)
    assert (info.max, info.smallest_normal, info.smallest_subnormal, info.eps, info.has_inf) == (
        layout.max, layout.smallest_normal, layout.smallest_subnormal, layout.eps, layout.has_inf)


def test_layout_figures_are_the_well_known_ones():
    """The derivation in format_layouts, checked against figures quoted everywhere (IEEE 754, OCP FP8)."""
    assert (LAYOUTS["fp16"].max, LAYOUTS["fp16"].smallest_subnormal) == (65504.0, 2.0**-24)
    assert (LAYOUTS["fp8 e4m3fn"].max, LAYOUTS["fp8 e5m2"].max) == (448.0, 57344.0)
    assert LAYOUTS["fp32"].max == float.fromhex("0x1.fffffep+127")
    assert LAYOUTS["bf16"].max == float.fromhex("0x1.fep+127")


@pytest.mark.parametrize("name", SIXTEEN_AND_EIGHT_BIT)
def test_facts_equal_every_bit_pattern(name):
    info = formats.format_info(name)
    values = _all_values(name)
    finite = values[torch.isfinite(values)]
    positive = finite[finite > 0]
    assert finite.max().item() == info.max
    assert positive.min().item() == info.smallest_subnormal
    assert positive[positive >= info.smallest_normal].min().item() == info.smallest_normal
    assert positive[positive > 1].min().item() - 1 == info.eps
    assert bool(torch.isinf(values).any()) == info.has_inf


def test_fp32_extremes_by_nextafter():
    info = formats.format_info("fp32")
    zero, inf = torch.tensor(0.0), torch.tensor(math.inf)
    assert torch.nextafter(inf, zero).item() == info.max
    assert torch.nextafter(zero, inf).item() == info.smallest_subnormal


def test_tf32_rounding_matches_its_layout():
    info = formats.format_info("tf32")

    def tf32(x: float) -> float:
        return formats.round_to_tf32(torch.tensor(x, dtype=torch.float32)).item()

    assert tf32(info.max) == info.max
    assert tf32(info.max + info.ulp_at_max / 2) == math.inf  # tie to even rounds up and carries into inf
    assert tf32(info.max + info.ulp_at_max / 4) == info.max
    assert tf32(1 + info.eps) == 1 + info.eps
    assert tf32(1 + info.eps / 2) == 1.0  # tie: to even (down)
    assert tf32(1 + 3 * info.eps / 2) == 1 + 2 * info.eps  # tie: to even (up)
    assert tf32(-(1 + 3 * info.eps / 2)) == -(1 + 2 * info.eps)
    assert tf32(info.smallest_subnormal) == info.smallest_subnormal
    assert tf32(info.smallest_subnormal / 2) == 0.0
    assert tf32(info.smallest_subnormal * 0.75) == info.smallest_subnormal
    assert math.isnan(tf32(math.nan)) and tf32(-math.inf) == -math.inf


def test_tf32_rounding_agrees_with_float_reference():
    # Reference: round half to even of x / ulp, with ulp from x's binade (exact in float64).
    rng = random.Random(0)
    samples = [rng.uniform(-1, 1) * 2.0 ** rng.randint(-140, 127) for _ in range(3000)]
    x = torch.tensor(samples, dtype=torch.float32)
    got = formats.round_to_tf32(x).tolist()
    for value, rounded in zip(x.tolist(), got, strict=True):
        exponent = max(math.floor(math.log2(abs(value))), -126) if value else -126
        ulp = 2.0 ** (exponent - 10)
        assert rounded == round(value / ulp) * ulp, value


@pytest.mark.parametrize(("value", "name", "stored", "status"), [
    (65520.0, "fp16", math.inf, "overflow to inf"),
    (1e-8, "fp16", 0.0, "flushed to zero (underflow)"),
    (1 + 2**-8, "bf16", 1.0, "rounded"),
    (1 + 2**-8, "fp16", 1 + 2**-8, "exact"),
    (65520.0, "bf16", 65536.0, "rounded"),
    (65520.0, "tf32", 65536.0, "rounded"),
    (1000.0, "fp8 e4m3fn", 448.0, "overflow saturated to ±max (no inf)"),
    (math.inf, "fp8 e4m3fn", 448.0, "inf saturated to ±max (format has no inf)"),
    (1000.0, "fp8 e5m2", 1024.0, "rounded"),
    (61440.0, "fp8 e5m2", math.inf, "overflow to inf"),
    (1e-40, "bf16", 2.0**-133, "rounded, subnormal (fewer significant bits)"),
])
def test_round_value_known_cases(value, name, stored, status):
    result = formats.round_value(value, name)
    assert result.stored == stored
    assert result.status == status


@pytest.mark.parametrize("name", formats.FORMAT_NAMES)
def test_round_value_errors_and_exact_values(name):
    info = formats.format_info(name)
    for exact in (1.5, -info.max, info.smallest_normal, info.smallest_subnormal):
        result = formats.round_value(exact, name)
        assert (result.stored, result.abs_error, result.rel_error) == (exact, 0.0, 0.0)
    above_one = formats.round_value(1 + info.eps / 4, name)
    assert above_one.stored == 1.0
    assert above_one.abs_error == info.eps / 4
    assert above_one.rel_error == pytest.approx(info.eps / 4 / (1 + info.eps / 4))
    assert math.isnan(formats.round_value(math.nan, name).stored)
    flushed = formats.round_value(info.smallest_subnormal / 4, name)
    assert flushed.stored == 0.0 and flushed.rel_error == 1.0


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_store_in_format_is_torch_cast(name):
    values = [0.1, -3.3, 1e-3, 300.0, 7e4]
    expected = torch.tensor(values, dtype=torch.float64).to(formats.FORMATS[name]).double()
    assert torch.equal(formats.store_in_format(values, name), expected)


@pytest.mark.parametrize("name", formats.FORMAT_NAMES)
def test_bit_pattern_of_one_and_minus_two(name):
    info = formats.format_info(name)
    bias_ones = "0" + "1" * (info.exponent_bits - 1)
    assert formats.bit_pattern(1.0, name) == f"0 {bias_ones} {'0' * info.mantissa_bits}"
    assert formats.bit_pattern(-2.0, name) == f"1 1{'0' * (info.exponent_bits - 1)} {'0' * info.mantissa_bits}"


def test_rounding_table_rows():
    table = formats.rounding_table(65520.0).set_index("format")
    assert list(table.index) == list(formats.FORMAT_NAMES)
    assert table.loc["fp16", "stored"] == math.inf
    assert table.loc["fp32", "stored"] == 65520.0


@pytest.mark.parametrize(("text", "value"), [
    ("65520", 65520.0), ("1e-8", 1e-8), (" -2.5 ", -2.5), ("1 + 2^-8", 1 + 2**-8), ("2**-24", 2.0**-24),
    ("inf", math.inf), ("(3 - 1) * 4 / 8", 1.0),
])
def test_parse_number(text, value):
    assert formats.parse_number(text) == value


@pytest.mark.parametrize(("text", "message"), [
    ("", "type a number"), ("abc", "only numbers"), ("__import__('os')", "only numbers"),
    ("(1", "is not a number"), ("1/0", "divides by zero"), ("10**10**10", "beyond float64"),
    ("(-8)**0.5", "not a real number"),
])
def test_parse_number_refuses(text, message):
    with pytest.raises(ValueError, match=message):
        formats.parse_number(text)


def test_unknown_names_refused():
    with pytest.raises(ValueError, match="unknown format"):
        formats.format_info("fp4")
    with pytest.raises(ValueError, match="unknown dtype"):
        formats.softmax_demo([1.0], [1.0], "fp8 e4m3fn")
    with pytest.raises(ValueError, match="as many labels as logits"):
        formats.softmax_demo([1.0, 0.0], [1.0], "fp32")


def test_format_number_keeps_nan_and_inf_visible():
    assert [formats.format_number(x) for x in (math.nan, math.inf, -math.inf, -0.0, 65504.0, 0.1)] == [
        "nan", "inf", "-inf", "-0", "65504", "0.1"]


@pytest.mark.parametrize(("value", "text"), [
    (3.4028234663852886e38, "3.403 × 10³⁸"), (65504.0, "65504"), (0.0078125, "0.007812"), (1e-8, "1 × 10⁻⁸"),
    (-2.5e-7, "-2.5 × 10⁻⁷"), (1.5e6, "1.5 × 10⁶"), (math.inf, "inf"), (math.nan, "nan"), (0.0, "0"),
])
def test_readable_number(value, text):
    assert formats.readable_number(value) == text


@pytest.mark.parametrize(("value", "text"), [
    (2.0**-126, "2⁻¹²⁶ ≈ 1.175 × 10⁻³⁸"), (2.0**-10, "2⁻¹⁰ = 0.0009765625"), (0.5, "2⁻¹ = 0.5"),
    (65504.0, "65504"), (3 * 2.0**-20, "2.861 × 10⁻⁶"),
])
def test_power_of_two_text(value, text):
    assert formats.power_of_two_text(value) == text


def test_readable_format_table_is_the_exact_one_shortened():
    short, exact = formats.readable_format_table().set_index("format"), formats.format_table().set_index("format")
    for name in formats.FORMAT_NAMES:
        assert short.loc[name, "max"] == formats.readable_number(exact.loc[name, "max"])
        assert short.loc[name, "eps"] == formats.power_of_two_text(exact.loc[name, "eps"])
        assert short.loc[name, "sign · exponent · mantissa"] == " · ".join(
            str(exact.loc[name, column]) for column in ("sign", "exponent", "mantissa"))


def test_number_line_figure_uses_the_facts():
    fig = format_views.number_line_figure(1e-8)
    assert fig.layout.xaxis.type == "log"
    by_name = {}
    for trace in fig.data:
        by_name.setdefault(trace.name, []).append(trace)
    for index, name in enumerate(formats.FORMAT_NAMES):
        info = formats.format_info(name)
        assert tuple(by_name["subnormal range"][index].x) == (info.smallest_subnormal, info.smallest_normal)
        assert tuple(by_name["normal range"][index].x) == (info.smallest_normal, info.max)
        assert tuple(by_name["max"][index].x) == (info.max,)
    assert tuple(by_name["|value| = 1 × 10⁻⁸"][0].x) == (1e-8, 1e-8)
    assert not any(trace.name.startswith("|value|") for trace in format_views.number_line_figure(math.inf).data)


def test_seed_examples_in_fp32():
    demo = formats.softmax_demo([1000.0, 0.0], [0.5, 0.5], "fp32")
    assert math.isnan(demo.naive_softmax[0]) and demo.naive_softmax[1] == 0.0
    assert demo.stable_softmax == [1.0, 0.0]
    assert demo.stable_cross_entropy == 500.0
    assert demo.naive_cross_entropy == math.inf
    assert demo.stable_grad == [0.5, -0.5]


@pytest.mark.parametrize("dtype_name", list(formats.SOFTMAX_DTYPES))
def test_softmax_1000_in_every_dtype(dtype_name):
    demo = formats.softmax_demo([1000.0, 0.0], [0.5, 0.5], dtype_name)
    assert demo.exp[0] == math.inf
    assert math.isnan(demo.naive_softmax[0])
    assert demo.stable_softmax == [1.0, 0.0]
    assert (demo.naive_cross_entropy, demo.stable_cross_entropy) == (math.inf, 500.0)
    assert all(math.isnan(g) for g in demo.naive_grad)
    assert demo.stable_grad == [0.5, -0.5]


@pytest.mark.parametrize("dtype_name", list(formats.SOFTMAX_DTYPES))
def test_largest_safe_logit_is_the_edge(dtype_name):
    dtype = formats.SOFTMAX_DTYPES[dtype_name]
    logit = torch.tensor(formats.largest_safe_logit(dtype_name), dtype=dtype)
    assert torch.isfinite(torch.exp(logit))
    assert torch.isinf(torch.exp(torch.nextafter(logit, torch.tensor(math.inf, dtype=dtype))))
    assert logit.item() <= math.log(torch.finfo(dtype).max)
    demo = formats.softmax_demo([logit.item(), 0.0], [0.5, 0.5], dtype_name)
    assert all(math.isfinite(p) for p in demo.naive_softmax)


def test_fp16_breaks_at_12_where_bf16_does_not():
    fp16 = formats.softmax_demo([12.0, 0.0], [0.5, 0.5], "fp16")
    bf16 = formats.softmax_demo([12.0, 0.0], [0.5, 0.5], "bf16")
    assert math.isnan(fp16.naive_softmax[0])
    assert fp16.stable_softmax[0] == 1.0
    assert all(math.isfinite(p) for p in bf16.naive_softmax)
    assert bf16.naive_softmax[0] == pytest.approx(1.0, abs=bf16.naive_softmax[0] * 2**-7)


def test_softmax_and_safe_logit_tables():
    table = formats.softmax_table([1000.0, 0.0]).set_index("dtype")
    assert list(table.index) == list(formats.SOFTMAX_DTYPES)
    assert table.loc["fp32", "naive softmax"] == "[nan, 0]"
    assert table.loc["fp32", "stable softmax"] == "[1, 0]"
    assert table.loc["fp16", "stable cross-entropy"] == "500"
    safe = formats.safe_logit_table().set_index("dtype")
    assert safe.loc["fp16", "ln(max)"] == math.log(65504.0)
    assert safe.loc["fp16", "largest safe logit (measured)"] == 11.0859375
