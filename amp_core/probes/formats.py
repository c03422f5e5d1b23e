"""Number-format facts (torch.finfo), rounding a value into each format, and stable vs naive softmax demos.

Everything here is computed by really storing values in torch dtypes; nothing is a hand-written table.
The one format torch has no dtype for is TF32 (a tensor-core input format, 1 sign / 8 exponent /
10 mantissa bits, held in fp32 storage); it is emulated by `round_to_tf32`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from amp_core.imports import parse_python

# Display name -> storage dtype. TF32 has no torch dtype: its values live in fp32 tensors.
FORMATS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8 e4m3fn": torch.float8_e4m3fn,
    "fp8 e5m2": torch.float8_e5m2,
}
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)

# The softmax demo runs in dtypes that have CPU math kernels (float8 has no exp on CPU); fp64 is the reference.
SOFTMAX_DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

TF32_MANTISSA_BITS = 10
_FP32_MANTISSA_BITS = 23
_TF32_DROPPED_BITS = _FP32_MANTISSA_BITS - TF32_MANTISSA_BITS  # 13 low fp32 mantissa bits TF32 drops

# Same-width integer dtype used to read a float's bit pattern.
_BITS_VIEW: dict[int, torch.dtype] = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


@dataclass(frozen=True, slots=True)
class FormatInfo:
    """The facts of one floating-point format, read from torch.finfo (TF32: from its bit layout)."""

    name: str
    """Display name ("fp16", "fp8 e4m3fn", ...)."""
    dtype: torch.dtype
    """torch dtype that stores it (torch.float32 for tf32)."""
    bits: int
    """Bits in the format itself (19 for tf32, although it is stored in 32)."""
    sign_bits: int
    """Always 1."""
    exponent_bits: int
    """Exponent field width: sets the range."""
    mantissa_bits: int
    """Stored fraction bits (without the implicit leading 1): sets the precision."""
    max: float
    """Largest finite value."""
    smallest_normal: float
    """Smallest positive normal value (full precision down to here)."""
    smallest_subnormal: float
    """Smallest positive value at all (one unit in the last place below smallest_normal); below it: 0."""
    eps: float
    """Gap between 1 and the next value: 2**-mantissa_bits."""
    has_inf: bool
    """Whether the format can hold +-inf (float8_e4m3fn cannot: 'fn' = finite, NaN only)."""
    source: str
    """Where the figures come from."""

    @property
    def ulp_at_max(self) -> float:
        """Gap between max and the value below it (half of it decides where rounding overflows)."""
        return 2.0 ** math.floor(math.log2(self.max)) * self.eps


def format_info(name: str) -> FormatInfo:
    """Facts of one format. Raises ValueError for an unknown name."""
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; choose from {', '.join(FORMAT_NAMES)}")
    if name == "tf32":
        # Layout 1/8/10: fp32's exponent (so fp32's normal range), fp16's mantissa width.
        eps = 2.0**-TF32_MANTISSA_BITS
        smallest_normal = 2.0**-126
        return FormatInfo(
            name=name, dtype=torch.float32, bits=19, sign_bits=1, exponent_bits=8,
            mantissa_bits=TF32_MANTISSA_BITS, max=(2.0 - eps) * 2.0**127, smallest_normal=smallest_normal,
            smallest_subnormal=smallest_normal * eps, eps=eps, has_inf=True,
            source="TF32 bit layout (1 sign, 8 exponent, 10 mantissa)",
        )
    dtype = FORMATS[name]
    finfo = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(finfo.eps))
    return FormatInfo(
        name=name, dtype=dtype, bits=finfo.bits, sign_bits=1, exponent_bits=finfo.bits - 1 - mantissa_bits,
        mantissa_bits=mantissa_bits, max=finfo.max, smallest_normal=finfo.smallest_normal,
        # One unit in the last place of the smallest binade: the smallest subnormal.
        smallest_subnormal=finfo.smallest_normal * finfo.eps, eps=finfo.eps,
        has_inf=dtype != torch.float8_e4m3fn, source=f"torch.finfo({dtype})",
    )


def format_table() -> pd.DataFrame:
    """One row per format: bit layout, max, smallest normal/subnormal, epsilon, ln(max), inf support."""
    rows = []
    for name in FORMAT_NAMES:
        info = format_info(name)
        rows.append({
            "format": name,
            "bits": info.bits,
            "sign": info.sign_bits,
            "exponent": info.exponent_bits,
            "mantissa": info.mantissa_bits,
            "max": info.max,
            "smallest normal": info.smallest_normal,
            "smallest subnormal": info.smallest_subnormal,
            "eps": info.eps,
            "ln(max)": math.log(info.max),
            "has inf": info.has_inf,
            "source": info.source,
        })
    return pd.DataFrame(rows)


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32 (10 mantissa bits), returned as fp32.

    Emulation: round-to-nearest-even on the fp32 bit pattern, dropping the 13 low mantissa bits. A carry
    out of the mantissa bumps the exponent, so values past TF32's max become inf, as rounding should.
    NaN and inf pass through. (Tensor-core hardware may convert differently, e.g. by truncation; this is
    the correctly rounded TF32 value of the fp32 input.)
    """
    x = x.to(torch.float32)
    magnitude_bits = x.abs().view(torch.int32)  # sign cleared, so the integer arithmetic cannot overflow
    lowest_kept_bit = (magnitude_bits >> _TF32_DROPPED_BITS) & 1
    half_minus_one = (1 << (_TF32_DROPPED_BITS - 1)) - 1
    rounded_bits = (magnitude_bits + half_minus_one + lowest_kept_bit) & ~((1 << _TF32_DROPPED_BITS) - 1)
    rounded = torch.copysign(rounded_bits.view(torch.float32), x)
    return torch.where(torch.isfinite(x), rounded, x)


def store_in_format(values: torch.Tensor | Sequence[float] | float, name: str) -> torch.Tensor:
    """Values (as float64) stored in format `name` and read back as float64.

    The cast is torch's own `float64 tensor .to(dtype)`; on CPU torch converts through float32, so a float64
    value can be rounded twice. TF32: stored in fp32 first (what tensor cores read), then `round_to_tf32`.
    """
    info = format_info(name)
    x64 = torch.as_tensor(values, dtype=torch.float64)
    stored = round_to_tf32(x64.to(torch.float32)) if name == "tf32" else x64.to(info.dtype)
    return stored.to(torch.float64)


def bit_pattern(value: float, name: str) -> str:
    """The stored bits of `value` in format `name` as 'sign exponent mantissa', e.g. '0 01111 0000000000'."""
    info = format_info(name)
    if name == "tf32":
        stored = round_to_tf32(torch.tensor(value, dtype=torch.float64).to(torch.float32))
        raw = int(stored.view(torch.int32).item()) & 0xFFFFFFFF
        raw >>= _TF32_DROPPED_BITS  # the top 19 bits of the fp32 word are the TF32 word
    else:
        width = torch.finfo(info.dtype).bits
        stored = torch.tensor([value], dtype=torch.float64).to(info.dtype)
        raw = int(stored.view(_BITS_VIEW[width]).item()) & ((1 << width) - 1)
    text = format(raw, f"0{info.bits}b")
    return f"{text[0]} {text[1:1 + info.exponent_bits]} {text[1 + info.exponent_bits:]}"


@dataclass(frozen=True, slots=True)
class RoundResult:
    """A value stored in one format."""

    format: str
    """Format name."""
    value: float
    """The value asked for (as a float64)."""
    stored: float
    """What the format really holds."""
    abs_error: float
    """|stored - value|; NaN when value is not finite or stored is not finite."""
    rel_error: float
    """abs_error / |value|; NaN when value is 0 or not finite, or stored is not finite."""
    status: str
    """exact / rounded / subnormal / flushed to zero / overflow to inf / saturated to max / NaN ..."""
    bits: str
    """Stored bit pattern, 'sign exponent mantissa'."""


def _status(value: float, stored: float, info: FormatInfo) -> str:
    if math.isnan(value):
        return "NaN stays NaN"
    if math.isinf(value):
        if math.isinf(stored):
            return "inf stays inf"
        if math.isnan(stored):
            return "inf becomes NaN"
        return "inf saturated to ±max (format has no inf)"
    if math.isinf(stored):
        return "overflow to inf"
    if math.isnan(stored):
        return "overflow to NaN"
    if abs(stored) == info.max and abs(value) - info.max > info.ulp_at_max / 2:
        return "overflow saturated to ±max (no inf)"
    if stored == 0.0 and value != 0.0:
        return "flushed to zero (underflow)"
    if stored == value:
        return "exact (subnormal)" if 0 < abs(stored) < info.smallest_normal else "exact"
    if abs(stored) < info.smallest_normal:
        return "rounded, subnormal (fewer significant bits)"
    return "rounded"


def round_value(value: float, name: str) -> RoundResult:
    """Store `value` in format `name`: stored value, errors, and what happened (overflow, flush to zero...)."""
    info = format_info(name)
    stored = float(store_in_format(value, name).item())
    comparable = math.isfinite(value) and math.isfinite(stored)
    abs_error = abs(stored - value) if comparable else math.nan
    rel_error = abs_error / abs(value) if comparable and value != 0 else math.nan
    return RoundResult(format=name, value=value, stored=stored, abs_error=abs_error, rel_error=rel_error,
                       status=_status(value, stored, info), bits=bit_pattern(value, name))


def rounding_table(value: float) -> pd.DataFrame:
    """One row per format: `value` stored in it (numeric columns stay floats)."""
    rows = []
    for name in FORMAT_NAMES:
        result = round_value(value, name)
        rows.append({"format": result.format, "stored": result.stored, "abs error": result.abs_error,
                     "rel error": result.rel_error, "what happened": result.status, "bits": result.bits})
    return pd.DataFrame(rows)


def format_number(x: float, digits: int = 17) -> str:
    """A float as text that keeps NaN/inf visible: shortest round-trip repr, or `digits` significant digits."""
    if isinstance(x, bool) or not isinstance(x, float):
        return str(x)
    x = float(x)  # a numpy float's repr names its type
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "-0" if math.copysign(1.0, x) < 0 else "0"
    if x == int(x) and abs(x) < 1e16:
        return str(int(x))
    return repr(x) if digits >= 17 else f"{x:.{digits}g}"


_SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _power_text(base: int, exponent: int) -> str:
    return f"{base}{str(exponent).translate(_SUPERSCRIPTS)}"


def readable_number(x: float, digits: int = 4) -> str:
    """A float short enough to read at a glance: integers below a million whole ("65504"), others in [0.001, 1e6)
    to `digits` significant digits ("0.0009766"), the rest as "3.403 × 10³⁸" (never "3.4028234663852886e+38",
    whose exponent a narrow cell can cut off). NaN/inf stay visible. Exact values: `format_number`."""
    if isinstance(x, bool) or not isinstance(x, float):
        return str(x)
    x = float(x)
    if not math.isfinite(x) or x == 0:
        return format_number(x)
    if abs(x) < 1e6 and x == int(x):
        return str(int(x))
    if 1e-3 <= abs(x) < 1e6:
        return f"{x:.{digits}g}"
    mantissa, exponent = f"{x:.{digits - 1}e}".split("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa} × {_power_text(10, int(exponent))}"


def power_of_two_text(x: float, digits: int = 4) -> str:
    """An exact power of two as "2⁻¹²⁶ ≈ 1.175 × 10⁻³⁸" (small ones as "2⁻¹ = 0.5"), anything else as
    `readable_number`: exact and short for smallest normals, subnormals and epsilons."""
    if x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5:
        exponent = math.frexp(x)[1] - 1
        near = readable_number(x, digits)
        exact = abs(exponent) <= 10  # 2^-10 = 0.0009765625 is written out whole below
        return f"{_power_text(2, exponent)} {'=' if exact else '≈'} {format_number(x) if exact else near}"
    return readable_number(x, digits)


def readable_format_table() -> pd.DataFrame:
    """`format_table` as a person reads it: one row per format, the bit layout, and short forms of max, smallest
    normal, smallest subnormal and eps (powers of two written as such). The page keeps `format_table` for the
    exact values."""
    table = format_table()
    return pd.DataFrame({
        "format": table["format"], "bits": table["bits"],
        "sign · exponent · mantissa": [f"{s} · {e} · {m}" for s, e, m in
                                       zip(table["sign"], table["exponent"], table["mantissa"], strict=True)],
        "max": [readable_number(v) for v in table["max"]],
        "smallest normal": [power_of_two_text(v) for v in table["smallest normal"]],
        "smallest subnormal": [power_of_two_text(v) for v in table["smallest subnormal"]],
        "eps": [power_of_two_text(v) for v in table["eps"]],
        "has inf": table["has inf"],
    })


def display_frame(df: pd.DataFrame, digits: dict[str, int] | None = None) -> pd.DataFrame:
    """Copy of `df` with float columns as text so NaN/inf show as 'nan'/'inf' (not blank cells)."""
    digits = digits or {}
    out = df.copy()
    for column in out.columns:
        if pd.api.types.is_float_dtype(out[column]):
            out[column] = [format_number(float(v), digits.get(column, 17)) for v in out[column]]
    return out


# ---- parsing a typed value -------------------------------------------------------------------------------

_BINARY_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.Pow: operator.pow}
_UNARY_OPS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)  # float arithmetic throughout: 10**10**10 overflows instead of hanging
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        return _BINARY_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / ** ^ and parentheses are allowed")


def parse_number(text: str) -> float:
    """A typed number as a float64: '65520', '1e-8', 'inf', 'nan', or arithmetic such as '1 + 2^-8'.

    Raises ValueError with a message fit to show the user.
    """
    cleaned = text.strip()
    if not cleaned:
        raise ValueError("type a number, e.g. 65520, 1e-8 or 1 + 2^-8")
    try:
        return float(cleaned)
    except ValueError:
        pass
    try:
        result = _evaluate(parse_python(cleaned.replace("^", "**"), mode="eval"))
    except SyntaxError:
        raise ValueError(f"{text!r} is not a number (try 65520, 1e-8 or 1 + 2^-8)") from None
    except ValueError as error:
        raise ValueError(f"{text!r}: {error}") from None
    except ZeroDivisionError:
        raise ValueError(f"{text!r} divides by zero") from None
    except OverflowError:
        raise ValueError(f"{text!r} is beyond float64's range (max {torch.finfo(torch.float64).max:.4g})") from None
    if isinstance(result, complex):
        raise ValueError(f"{text!r} is not a real number")
    return result


# ---- numerical stability: softmax and cross-entropy (EffectivePyTorch's examples) ---------------------

def naive_softmax(logits: torch.Tensor) -> torch.Tensor:
    """exp(x) / sum(exp(x)): exp overflows to inf for a logit above ~ln(max), and inf/inf is NaN."""
    exp = torch.exp(logits)
    return exp / torch.sum(exp)


def stable_softmax(logits: torch.Tensor) -> torch.Tensor:
    """exp(x - max(x)) / sum(...): the same value, but every exponent is <= 0 so exp stays in [0, 1]."""
    exp = torch.exp(logits - torch.max(logits))
    return exp / torch.sum(exp)


def naive_softmax_cross_entropy(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """-sum(labels * log(softmax(x))), with the *stable* softmax as in the source: a probability that
    underflows to 0 still makes log give -inf, so the loss is inf."""
    return -torch.sum(labels * torch.log(stable_softmax(logits)))


def stable_softmax_cross_entropy(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """-sum(labels * log_softmax(x)) with log_softmax = (x - max) - logsumexp(x - max): no exp overflow,
    no log(0)."""
    scaled = logits - torch.max(logits)
    normalized = scaled - torch.logsumexp(scaled, dim=-1)
    return -torch.sum(labels * normalized)


def _dtype(name: str) -> torch.dtype:
    if name not in SOFTMAX_DTYPES:
        raise ValueError(f"unknown dtype {name!r} for the softmax demo; choose from {', '.join(SOFTMAX_DTYPES)}")
    return SOFTMAX_DTYPES[name]


def _next_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, direction))


def largest_safe_logit(dtype_name: str) -> float:
    """Measured: the largest logit representable in the dtype whose exp (computed in the dtype) is finite.

    ln(finfo.max) is the textbook bound; this is the value that really survives `torch.exp` in the dtype.
    """
    dtype = _dtype(dtype_name)
    logit = torch.tensor(math.log(torch.finfo(dtype).max), dtype=torch.float64).to(dtype)
    while not torch.isfinite(torch.exp(logit)):
        logit = _next_toward(logit, -math.inf)
    while torch.isfinite(torch.exp(_next_toward(logit, math.inf))):
        logit = _next_toward(logit, math.inf)
    return float(logit.item())


@dataclass(frozen=True, slots=True)
class SoftmaxDemo:
    """Naive and stable softmax / cross-entropy computed with every tensor in one dtype."""

    dtype: str
    """Dtype name ("fp64", "fp32", "bf16", "fp16")."""
    logits: list[float]
    """The logits as stored in the dtype."""
    exp: list[float]
    """exp(logits) in the dtype: where the naive form breaks (inf)."""
    naive_softmax: list[float]
    """exp(x) / sum(exp(x))."""
    stable_softmax: list[float]
    """exp(x - max) / sum(exp(x - max))."""
    naive_cross_entropy: float
    """-sum(labels * log(softmax(x)))."""
    stable_cross_entropy: float
    """-sum(labels * ((x - max) - logsumexp(x - max)))."""
    naive_grad: list[float]
    """d naive_cross_entropy / d logits, by autograd in the dtype."""
    stable_grad: list[float]
    """d stable_cross_entropy / d logits, by autograd in the dtype."""
    ln_max: float
    """ln(finfo.max): the textbook largest safe logit for the naive softmax."""
    largest_safe_logit: float
    """Measured largest logit whose exp is finite in the dtype (see `largest_safe_logit`)."""


def softmax_demo(logits: Sequence[float], labels: Sequence[float], dtype_name: str) -> SoftmaxDemo:
    """Run the four forms (and their gradients) with logits and labels really held in `dtype_name`."""
    if len(logits) != len(labels) or len(logits) == 0:
        raise ValueError(f"need as many labels as logits (>= 1), got {len(logits)} logits, {len(labels)} labels")
    dtype = _dtype(dtype_name)
    label_tensor = torch.tensor(labels, dtype=torch.float64).to(dtype)

    def forward_and_grad(loss_fn) -> tuple[float, list[float]]:
        x = torch.tensor(logits, dtype=torch.float64).to(dtype).requires_grad_(True)
        loss = loss_fn(label_tensor, x)
        (grad,) = torch.autograd.grad(loss, x)
        return float(loss.item()), grad.double().tolist()

    x = torch.tensor(logits, dtype=torch.float64).to(dtype)
    naive_xe, naive_grad = forward_and_grad(naive_softmax_cross_entropy)
    stable_xe, stable_grad = forward_and_grad(stable_softmax_cross_entropy)
    return SoftmaxDemo(
        dtype=dtype_name, logits=x.double().tolist(), exp=torch.exp(x).double().tolist(),
        naive_softmax=naive_softmax(x).double().tolist(), stable_softmax=stable_softmax(x).double().tolist(),
        naive_cross_entropy=naive_xe, stable_cross_entropy=stable_xe, naive_grad=naive_grad,
        stable_grad=stable_grad, ln_max=math.log(torch.finfo(dtype).max),
        largest_safe_logit=largest_safe_logit(dtype_name),
    )


def _vector_text(values: list[float]) -> str:
    return "[" + ", ".join(format_number(v, 6) for v in values) + "]"


def softmax_table(logits: Sequence[float], labels: Sequence[float] = (0.5, 0.5)) -> pd.DataFrame:
    """One row per dtype (fp64 reference, fp32, bf16, fp16); vectors as text, so NaN and inf stay visible."""
    rows = []
    for name in SOFTMAX_DTYPES:
        demo = softmax_demo(logits, labels, name)
        rows.append({
            "dtype": name,
            "logits (stored)": _vector_text(demo.logits),
            "exp(logits)": _vector_text(demo.exp),
            "naive softmax": _vector_text(demo.naive_softmax),
            "stable softmax": _vector_text(demo.stable_softmax),
            "log(softmax) cross-entropy": format_number(demo.naive_cross_entropy, 6),
            "stable cross-entropy": format_number(demo.stable_cross_entropy, 6),
            "grad, log(softmax) CE": _vector_text(demo.naive_grad),
            "grad, stable CE": _vector_text(demo.stable_grad),
        })
    return pd.DataFrame(rows)


def safe_logit_table() -> pd.DataFrame:
    """Per softmax dtype: ln(finfo.max) and the measured largest logit whose exp stays finite."""
    rows = [{"dtype": name, "max": torch.finfo(dtype).max, "ln(max)": math.log(torch.finfo(dtype).max),
             "largest safe logit (measured)": largest_safe_logit(name)}
            for name, dtype in SOFTMAX_DTYPES.items()]
    return pd.DataFrame(rows)


BLOCK_DEMO_VALUES = (0.5, -0.21, 0.9, 0.04, -0.62, 0.33, 0.011, -0.78, 0.27, -0.05, 0.6, -0.38, 0.15, 0.0024, -0.44,
                     0.71, 30.0, -0.29, 0.47, -0.09, 0.83, -0.56, 0.19, 0.36, -0.68, 0.07, -0.13, 0.52, -0.95, 0.24,
                     -0.017, 0.41)
"""A block of 32 with one outlier (30, at index 16): what a shared scale does to its neighbours."""


@dataclass(frozen=True, slots=True)
class BlockRounding:
    """One block of values stored in MXFP8 (one block of 32), NVFP4 (two blocks of 16) and blockwise FP8 (one block
    of 128, the rest zeros), each through amp_core.formats' quantisers (torchao's numerics)."""

    frame: pd.DataFrame
    """One row per value: the value, then what each format stores for it."""
    scales: dict[str, str]
    """Each format's block scale(s), in words."""


def block_rounding(values: Sequence[float]) -> BlockRounding:
    """`values` (1 to 32 numbers; padded with zeros to 32, which changes no block's largest) in each block-scaled
    format. ValueError for more than 32 values or a non-finite one."""
    from amp_core.formats.quantize import quantize_fp8_blockwise, quantize_mxfp8, quantize_nvfp4

    values = [float(v) for v in values]
    if not 1 <= len(values) <= 32:
        raise ValueError(f"give 1 to 32 values (one MXFP8 block); got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError("block-scaled formats store finite values only: a block with inf or NaN has a NaN scale")
    block = torch.tensor([values + [0.0] * (32 - len(values))], dtype=torch.float32)
    mxfp8, nvfp4 = quantize_mxfp8(block), quantize_nvfp4(block)
    blockwise = quantize_fp8_blockwise(torch.nn.functional.pad(block, (0, 96)))
    shown = len(values)
    frame = pd.DataFrame({"value": values, "MXFP8": mxfp8.values[0, :shown].tolist(),
                          "NVFP4": nvfp4.values[0, :shown].tolist(),
                          "FP8 blockwise": blockwise.values[0, :shown].tolist()})
    scales = {"MXFP8": f"one e8m0 scale for the 32: {power_of_two_text(float(mxfp8.scales[0, 0]))}",
              "NVFP4": "e4m3 scales per 16 × a tensor scale: " + ", ".join(
                  f"{float(s):.4g}" for s in nvfp4.scales[0]),
              "FP8 blockwise": f"one fp32 scale for the 128: {float(blockwise.scales[0, 0]):.4g}"}
    return BlockRounding(frame=frame, scales=scales)
