"""Formats page: fp32 / tf32 / bf16 / fp16 / fp8 side by side, a typed value rounded into each, softmax stability."""

import streamlit as st

from amp_core.probes import formats
from amp_core.views import formats as format_views
from pages.common import app_frame

LABELS = (0.5, 0.5)
SOFTMAX_FORWARD = ("logits (stored)", "exp(logits)", "naive softmax", "stable softmax")
SOFTMAX_LOSS = ("log(softmax) cross-entropy", "stable cross-entropy", "grad, log(softmax) CE", "grad, stable CE")


def softmax_tables(logits: list[float], key: str) -> None:
    """The softmax demo as two tables that fit the page: the forward pass, then the losses and their gradients."""
    table = formats.softmax_table(logits, LABELS)
    for part, title, columns in (("forward", "The softmax", SOFTMAX_FORWARD),
                                 ("loss", "The cross-entropy and its gradient", SOFTMAX_LOSS)):
        st.caption(title)
        st.dataframe(table[["dtype", *columns]], hide_index=True, key=f"{key}_{part}",
                     column_config={"dtype": st.column_config.TextColumn(width=70)})


app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
st.title("Number formats")
st.caption("Every figure on this page comes from `torch.finfo` or from storing values in real torch dtypes "
           "on this machine; TF32 (no torch dtype) from its bit layout.")

st.subheader("The formats side by side")
st.dataframe(formats.readable_format_table(), hide_index=True, key="fmt_facts", column_config={
    "format": st.column_config.TextColumn(width=90), "bits": st.column_config.NumberColumn(width=50),
    "sign · exponent · mantissa": st.column_config.TextColumn(
        "sign · exp · mantissa", width=165,
        help="Bits of each field: the exponent sets the range, the mantissa the precision"),
    "max": st.column_config.TextColumn(width=115, help="Largest finite value (exact digits below)"),
    "smallest normal": st.column_config.TextColumn(width=170, help="Full precision down to here"),
    "smallest subnormal": st.column_config.TextColumn(width=170, help="Smallest positive value at all; below: 0"),
    "eps": st.column_config.TextColumn(width=150, help="Gap between 1 and the next value"),
    "has inf": st.column_config.CheckboxColumn(width=65)})
st.caption("Smallest subnormal = smallest normal × eps (one unit in the last place of the lowest binade). "
           "float8_e4m3fn (*fn* = finite) has no inf, only NaN, and torch's cast saturates to ±448 instead "
           "(see 1000 or inf below).")
with st.expander("Exact values (every digit) and where they come from"):
    st.dataframe(formats.display_frame(formats.format_table(), digits={"ln(max)": 6}), hide_index=True,
                 key="fmt_facts_exact")
chart_slot = st.container()

st.subheader("Round this value")
text = st.text_input("Value to store", value="65520", key="fmt_value",
                     help="A number such as 65520, 1e-8, -3.5, inf, or arithmetic such as 1 + 2^-8.")
value = None
try:
    value = formats.parse_number(text)
except ValueError as error:
    st.error(f"Cannot read the value: {error}")
if value is not None:
    rounding = formats.rounding_table(value)
    st.dataframe(formats.display_frame(rounding, digits={"abs error": 4, "rel error": 4}), hide_index=True,
                 key="fmt_rounding_table", column_config={
                     "format": st.column_config.TextColumn(width=95),
                     "stored": st.column_config.TextColumn(width=165, help="The exact value the format holds"),
                     "abs error": st.column_config.TextColumn(width=90),
                     "rel error": st.column_config.TextColumn(width=90),
                     "what happened": st.column_config.TextColumn(width=265),
                     "bits": st.column_config.TextColumn(width=270, help="sign, exponent, mantissa")})
    st.caption("Stored as torch does it: `torch.tensor(value, dtype=torch.float64).to(dtype)`. On CPU torch "
               "converts float64 through float32, so a value can be rounded twice (1 + 2^-8 + 2^-30 becomes 1 "
               "in bf16, not 1 + 2^-7). TF32 is emulated: the fp32 value rounded to nearest-even at 10 mantissa "
               "bits on its bit pattern (tensor cores may convert differently). Errors are against the typed "
               "value as a float64.")

with chart_slot:
    st.plotly_chart(format_views.number_line_figure(value), key="fmt_number_line")
    st.caption("Faint segment: subnormal range (fewer significant bits); thick segment: normal range; red tick: "
               "max. The dashed line is |value| from *Round this value* below.")

st.subheader("A block of values in MXFP8, NVFP4 and blockwise FP8")
block_text = st.text_input("Up to 32 values, comma-separated", key="fmt_block",
                           value=", ".join(f"{v:g}" for v in formats.BLOCK_DEMO_VALUES),
                           help="One MXFP8 block (32 values), two NVFP4 blocks (16 each); the outlier 30 sits in the "
                                "second 16.")
try:
    block = formats.block_rounding([formats.parse_number(part) for part in block_text.split(",") if part.strip()])
except ValueError as error:
    st.error(f"Cannot round the block: {error}")
else:
    st.dataframe(block.frame, hide_index=True, key="fmt_block_table")
    st.caption("Block-scaled formats share one scale per block, chosen from the block's largest |value|: "
               + "; ".join(f"**{name}**: {text}" for name, text in block.scales.items())
               + ". NVFP4 has 4-bit values (0, 0.5, 1, 1.5, 2, 3, 4, 6 times its scale), so beside an outlier its "
               "neighbours round to zero; MXFP8's e4m3 values keep them. Computed by the same code as the emulated "
               "lanes (bit for bit torchao's).")

st.subheader("Why fp16 needs a GradScaler and bf16 does not")
fp16, bf16, fp32 = (formats.format_info(name) for name in ("fp16", "bf16", "fp32"))
small_gradient = 1e-8
scale = 2.0**16
unscaled = formats.round_value(small_gradient, "fp16")
scaled = formats.round_value(small_gradient * scale, "fp16")
st.markdown(
    f"It is a question of **range**, not precision. fp16 has {fp16.exponent_bits} exponent bits: nothing above "
    f"**{formats.format_number(fp16.max)}** (beyond it: inf) and nothing below "
    f"**{formats.power_of_two_text(fp16.smallest_subnormal)}** "
    f"(below it: 0). Small gradients fall under that floor: a gradient of {small_gradient:g} stored in fp16 "
    f"becomes **{formats.format_number(unscaled.stored, 6)}**: {unscaled.status}. GradScaler multiplies the loss, "
    f"and so every gradient, by a scale such as 2^16: the same gradient becomes {small_gradient * scale:.4g} and "
    f"is stored as **{formats.format_number(scaled.stored, 6)}**, {scaled.status}; it is divided back in fp32 "
    f"before the optimizer step. When the scaled gradients overflow past {formats.format_number(fp16.max)} to "
    "inf, the scaler skips the step and halves the scale.\n\n"
    f"bf16 keeps fp32's {bf16.exponent_bits} exponent bits: its max is {formats.readable_number(bf16.max)} (fp32: "
    f"{formats.readable_number(fp32.max)}) and its smallest normal is {formats.power_of_two_text(bf16.smallest_normal)}"
    ", the same as fp32's. bf16 holds the magnitudes gradients have in fp32 (it gives up only fp32's deepest "
    f"subnormals, below {formats.power_of_two_text(bf16.smallest_subnormal)}), "
    f"more coarsely (eps {formats.power_of_two_text(bf16.eps)}; fp16: {formats.power_of_two_text(fp16.eps)}), "
    "so there is nothing for a scaler to rescue. "
    "Try 1e-8 and 65520 above, and look at the bf16 and fp16 rows of the number line."
)

st.subheader("Numerical stability: softmax and cross-entropy in each dtype")
st.markdown(
    "From *EffectivePyTorch*: the naive softmax `exp(x) / sum(exp(x))` overflows once `exp` of a logit passes "
    "the format's max, and `inf / inf` is NaN. Subtracting the max logit first changes nothing mathematically "
    "but keeps every `exp` in [0, 1]. Likewise `-sum(labels * log(softmax(x)))` takes `log(0) = -inf` once a "
    "probability underflows (even with the stable softmax, as in the source), while "
    "`(x - max) - logsumexp(x - max)` never does. Each row below runs with the logits and labels (0.5, 0.5) "
    "really held in that dtype, gradients by autograd. (CPU kernels may compute an op internally in fp32, but "
    "every op's result is stored in the dtype.)"
)

st.markdown("**Logits [1000, 0]**")
softmax_tables([1000.0, 0.0], "fmt_softmax_1000")

logit_text = st.text_input("Your first logit (the second is 0)", value="12", key="fmt_logit",
                           help="Try 11 and 12 (the fp16 limit is ln(65504) ≈ 11.09), 88 and 89 (fp32).")
try:
    logit = formats.parse_number(logit_text)
except ValueError as error:
    st.error(f"Cannot read the logit: {error}")
else:
    st.markdown(f"**Logits [{formats.format_number(logit, 6)}, 0]** (a logit is itself rounded when stored in "
                "the dtype: see *logits (stored)*)")
    softmax_tables([logit, 0.0], "fmt_softmax_user")

st.markdown("**Largest safe logit for the naive softmax**: ln(max), and the largest logit held in the dtype "
            "whose `exp` in that dtype is still finite (measured)")
safe_logits = formats.safe_logit_table()
safe_logits["max"] = safe_logits["max"].map(formats.readable_number)
st.dataframe(formats.display_frame(safe_logits), hide_index=True, key="fmt_safe_logits")
