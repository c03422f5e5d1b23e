"""Headroom and forecasts: how many bits each sampled layer has left to its format's limits, the robust trend of that
over the recent samples, and the step at which it reaches zero — so a run that is heading for an overflow says so
hundreds of steps before the first skipped step or NaN loss.

Fed by the per-layer abs max samples a run already takes (`layer_amax` events: a race's `amax_every`, a Monitor's
`layers_every`), never by the training step itself: the cost is a little numpy per sample.

Headroom of a tensor in a format, in bits:
- to the largest value: log2(format max / amax). Zero: its largest value overflows (inf, NaN, saturation).
- to the smallest normal: log2(amax / smallest normal). Zero: even its largest value is subnormal, every value has
  lost precision or flushed to zero. (The samples hold the abs max only, so this is the bound the largest magnitude
  gives; the shares that go subnormal are in the samples beside it.)
A gradient under a GradScaler is held scaled: its headroom is that of amax (as held) at the latest scale, and its
trend is fitted to the unscaled amax (amax / scale), so the scaler's own halvings and doublings are not read as a
trend. Its distance to the max is shown but never forecast: reaching it costs one skipped step, after which the
scaler halves the scale — the scaler's routine, not a run breaking (and early training's gradients, growing and then
shrinking, would forecast it falsely); its distance to the smallest normal, which the scaler cannot see, is.

Trend: a Theil–Sen fit (the median of the pairwise slopes) of log2 amax over step across the last WINDOW samples,
which one spike (or one sample taken as the loss scale moved) cannot tilt. Its slope's interval is Sen's: the
pairwise slopes at the ranks a two-sided Kendall test puts at 95%. A forecast — the step at which the fitted line
reaches the limit, with the interval the slope's bounds give — is made only when the trend is clear:
- at least MIN_SAMPLES samples;
- the slope's interval excludes 0, on the side toward the limit;
- the rise over the window (|slope| × its span) is at least NOISE_FACTOR times the residual scatter (1.4826 × MAD of
  the residuals): a trend beyond the sampling noise;
- the growth keeps its pace: the window's latter half has its own Theil–Sen slope at least STEADY_SHARE of the
  former half's (a healthy run's logits and gradients rise fast at first and then flatten; runaway growth — a factor
  compounding step after step — keeps a steady slope in log2);
- the crossing lies within HORIZON_SPANS spans of the window ahead (extrapolating further is a guess).
The loss row of a sample is left out: the loss is the user's own function, computed in fp32 by every workload here.
Anything else is "no clear trend", an answer in its own right.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

FORECAST_EVENT = "forecast"
"""Event kind: a lane's earliest forecast, when it first appears or moves materially (data: Forecast.event_data)."""


@dataclass(frozen=True, slots=True)
class FormatLimits:
    """The two magnitudes a cast to a format must stay between."""

    max: float
    """Largest finite value."""
    smallest_normal: float
    """Smallest positive normal value: below it precision falls away, then values flush to zero."""


FORMAT_LIMITS: dict[str, FormatLimits] = {
    "fp16": FormatLimits(65504.0, 2.0**-14),
    "bf16": FormatLimits(3.3895313892515355e38, 2.0**-126),
    "fp8 e4m3fn": FormatLimits(448.0, 2.0**-6),
    "fp8 e5m2": FormatLimits(57344.0, 2.0**-14),
}
"""Format name (as the layer watch's shares name them) -> limits, torch.finfo's figures (tests/test_headroom.py holds
them to it). A new format (a block-scaled one) is one more entry."""
LIMITS = ("max", "smallest normal")
TENSORS = ("output", "grad")
LOSS_PSEUDO_MODULE = "(loss)"
"""The samples' loss row: the user's loss (fp32) and the backward's seed (the loss scale itself); never a layer."""

WINDOW = 16
"""Recent samples a trend is fitted to."""
MIN_SAMPLES = 8
NOISE_FACTOR = 3.0
STEADY_SHARE = 0.7
HORIZON_SPANS = 4.0
MOVED_SHARE = 0.25
"""A lane's forecast is told again when its predicted step moved by more than this share of the steps still to go
(or its layer, tensor, format or limit changed)."""
_Z95 = 1.959963984540054


def headroom_bits(amax: float, limits: FormatLimits, limit: str) -> float:
    """Bits between `amax` and the format's `limit` ("max" | "smallest normal"); negative once beyond it."""
    if limit == "max":
        return math.log2(limits.max) - math.log2(amax)
    return math.log2(amax) - math.log2(limits.smallest_normal)


def formats_of_mode(mode: str) -> tuple[str, ...]:
    """The formats a lane's values are cast to, from its mode name: the 16-bit format of its autocast or parameters
    (`16-mixed` and `16-true` are fp16). An fp32 or tf32 lane casts to none of them; its table still shows them all."""
    base = mode.split("+")[0]
    if base.startswith("bf16"):
        return ("bf16",)
    if base.startswith("16"):
        return ("fp16",)
    return ()


@dataclass(frozen=True, slots=True)
class Trend:
    """A Theil–Sen fit of log2 amax over step."""

    slope: float
    """Bits per step (of amax; headroom to the max falls at this rate)."""
    slope_lo: float
    slope_hi: float
    intercept: float
    scatter: float
    """1.4826 × the median absolute deviation of the residuals, in bits."""
    early_slope: float
    """The former half's own slope."""
    recent_slope: float
    """The latter half's own slope (is the pace kept?)."""
    first_step: int
    last_step: int

    def at(self, step: float) -> float:
        return self.intercept + self.slope * step


def _pairwise_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    keep = dx != 0
    return (y[j] - y[i])[keep] / dx[keep]


def theil_sen(steps: Iterable[float], values: Iterable[float]) -> Trend:
    """The median of the pairwise slopes, its 95% interval (Sen 1968: the ranks (N ∓ C) / 2 of the N sorted pairwise
    slopes, C = z · sqrt(n(n−1)(2n+5)/18)), the median intercept and the residual scatter."""
    x, y = np.asarray(list(steps), dtype=float), np.asarray(list(values), dtype=float)
    n = len(x)
    if n < 2:
        raise ValueError("a trend needs at least two samples")
    slopes = np.sort(_pairwise_slopes(x, y))
    slope = float(np.median(slopes))
    spread = _Z95 * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    count = len(slopes)
    lo_rank = max(math.floor((count - spread) / 2), 0)
    hi_rank = min(math.ceil((count + spread) / 2), count - 1)
    intercept = float(np.median(y - slope * x))
    residuals = y - (intercept + slope * x)
    scatter = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
    half = n // 2
    early = float(np.median(_pairwise_slopes(x[:n - half], y[:n - half]))) if n >= 4 else slope
    recent = float(np.median(_pairwise_slopes(x[half:], y[half:]))) if n >= 4 else slope
    return Trend(slope, float(slopes[lo_rank]), float(slopes[hi_rank]), intercept, scatter, early, recent,
                 int(x[0]), int(x[-1]))


@dataclass(frozen=True, slots=True)
class Forecast:
    """When one layer's tensor reaches one limit of one format, as the recent samples' trend says."""

    module: str
    tensor: str
    """"output" or "grad" (the gradient w.r.t. the output)."""
    format: str
    limit: str
    """"max" or "smallest normal"."""
    sample_step: int
    """The latest sample's step."""
    headroom_bits: float
    """At the latest sample (a scaled gradient at the latest scale)."""
    slope_bits_per_step: float
    """Of the headroom: negative, it shrinks."""
    predicted_step: int
    lo_step: int
    hi_step: int
    samples: int

    @property
    def steps_ahead(self) -> int:
        return self.predicted_step - self.sample_step

    def message(self) -> str:
        which = "max" if self.limit == "max" else "smallest normal"
        what = self.module if self.tensor == "output" else f"{self.module}'s gradient"
        ahead = f"{self.lo_step - self.sample_step}–{self.hi_step - self.sample_step}"
        return (f"{what} reaches {self.format}'s {which} in ~{self.steps_ahead} steps ({ahead}): step "
                f"{self.predicted_step}, {self.headroom_bits:.1f} bits of "
                f"headroom left, {-self.slope_bits_per_step:.3g} bits/step lost")

    def event_data(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class LayerHeadroom:
    """One row of a lane's table: a layer's tensor against one limit of one format, with its forecast if any."""

    module: str
    tensor: str
    format: str
    limit: str
    sample_step: int
    headroom_bits: float | None
    """None: the latest sample held inf/NaN or nothing there."""
    forecast: Forecast | None
    why_none: str
    """Why there is no forecast ("no clear trend", "moving away", "beyond the horizon", "broken", ...)."""


@dataclass(slots=True)
class _Series:
    steps: deque
    log2_amax: deque
    """Unscaled."""
    latest: float | str | None = None
    """The latest sample's amax as held (scaled under a GradScaler), or "inf"/"nan"/None."""
    latest_scale: float = 1.0
    scaled: bool = False
    """A gradient under a GradScaler."""


def _value(amax: float | str | None, scale: float) -> float | None:
    if amax is None or isinstance(amax, str) or not amax > 0 or not math.isfinite(amax):
        return None
    return math.log2(amax / scale)


class LaneHeadroom:
    """The recent samples of one lane, per layer and tensor, and what they say: `add` each `layer_amax` event's data
    in step order; `rows` the table; `earliest` the lane's forecast (its layers' earliest)."""

    def __init__(self, window: int = WINDOW):
        self.window = window
        self.series: dict[tuple[str, str], _Series] = {}
        self.last_step: int | None = None

    def add(self, step: int, data: dict) -> None:
        scale = data.get("scale") or 1.0
        self.last_step = step
        for tensor in TENSORS:
            values = data.get(f"{tensor}_amax") or []
            for module, amax in zip(data.get("modules") or [], values, strict=False):
                if module == LOSS_PSEUDO_MODULE:
                    continue
                held_scale = scale if tensor == "grad" else 1.0
                series = self.series.get((module, tensor))
                if series is None:
                    series = self.series[(module, tensor)] = _Series(deque(maxlen=self.window),
                                                                      deque(maxlen=self.window))
                series.latest, series.latest_scale = amax, held_scale
                series.scaled = tensor == "grad" and data.get("scale") is not None
                log2_amax = _value(amax, held_scale)
                if log2_amax is not None:
                    series.steps.append(step)
                    series.log2_amax.append(log2_amax)

    def rows(self, formats: Iterable[str] | None = None) -> list[LayerHeadroom]:
        """Every layer's tensor against each limit of each of `formats` (default: every format in the table), least
        headroom first."""
        formats = [name for name in (FORMAT_LIMITS if formats is None else formats) if name in FORMAT_LIMITS]
        out = []
        for (module, tensor), series in self.series.items():
            trend = theil_sen(series.steps, series.log2_amax) if len(series.steps) >= 2 else None
            for name in formats:
                for limit in LIMITS:
                    out.append(self._row(module, tensor, series, trend, name, limit))
        return sorted(out, key=lambda row: (row.headroom_bits is None,
                                            row.headroom_bits if row.headroom_bits is not None else 0.0))

    def forecasts(self, formats: Iterable[str]) -> list[Forecast]:
        """The forecasts among `rows(formats)`, earliest first."""
        found = [row.forecast for row in self.rows(formats) if row.forecast is not None]
        return sorted(found, key=lambda f: (f.predicted_step, f.headroom_bits))

    def earliest(self, formats: Iterable[str]) -> Forecast | None:
        found = self.forecasts(formats)
        return found[0] if found else None

    def _row(self, module: str, tensor: str, series: _Series, trend: Trend | None, name: str,
             limit: str) -> LayerHeadroom:
        limits = FORMAT_LIMITS[name]
        step = self.last_step if self.last_step is not None else 0
        latest = series.latest
        if isinstance(latest, str):
            return LayerHeadroom(module, tensor, name, limit, step, None, None, f"the latest sample held {latest}")
        if latest is None or not latest > 0:
            return LayerHeadroom(module, tensor, name, limit, step, None, None, "nothing sampled")
        headroom = headroom_bits(latest, limits, limit)
        forecast, why = None, "no clear trend"
        if series.scaled and limit == "max":
            why = "the GradScaler's to keep (an overflow skips one step and halves the scale)"
        elif trend is not None:
            forecast, why = _forecast(module, tensor, name, limit, limits, series, trend, headroom, step)
        if headroom <= 0:
            forecast, why = None, "beyond the limit now"
        return LayerHeadroom(module, tensor, name, limit, step, headroom, forecast, why)


def _forecast(module: str, tensor: str, name: str, limit: str, limits: FormatLimits, series: _Series, trend: Trend,
              headroom: float, step: int) -> tuple[Forecast | None, str]:
    """The crossing of the fitted line with the limit (the module's docstring says when it is made)."""
    samples = len(series.steps)
    if samples < MIN_SAMPLES:
        return None, f"{samples} of {MIN_SAMPLES} samples"
    toward = 1.0 if limit == "max" else -1.0  # the sign of the amax slope that heads for the limit
    slope, lo, hi = toward * trend.slope, toward * trend.slope_lo, toward * trend.slope_hi
    early, recent = toward * trend.early_slope, toward * trend.recent_slope
    lo, hi = min(lo, hi), max(lo, hi)
    if slope <= 0:
        return None, "moving away"
    if lo <= 0:
        return None, "no clear trend"
    span = trend.last_step - trend.first_step
    if slope * span < NOISE_FACTOR * trend.scatter:
        return None, "no clear trend (within the sampling noise)"
    if recent < STEADY_SHARE * early:
        return None, "no clear trend (the growth is fading)"
    scale_bits = math.log2(series.latest_scale)
    boundary = math.log2(limits.max) if limit == "max" else math.log2(limits.smallest_normal)
    remaining = toward * (boundary - scale_bits - trend.at(step))  # bits the fitted line has still to go
    ahead = max(remaining, 0.0) / slope
    if ahead > HORIZON_SPANS * span:
        return None, "beyond the horizon"
    return Forecast(module=module, tensor=tensor, format=name, limit=limit, sample_step=step,
                    headroom_bits=round(headroom, 3), slope_bits_per_step=-slope,
                    predicted_step=step + round(ahead), lo_step=step + round(max(remaining, 0.0) / hi),
                    hi_step=step + round(max(remaining, 0.0) / lo), samples=samples), ""


class Forecaster:
    """The one forecaster of races and attached jobs: `observe` each lane's new `layer_amax` sample (in step order);
    it answers the `forecast` event to record — the lane's earliest forecast — when one first appears, names another
    layer, tensor, format or limit, or moves by more than MOVED_SHARE of the steps still to go; else None."""

    def __init__(self):
        self.lanes: dict[int, LaneHeadroom] = {}
        self.told: dict[int, Forecast] = {}

    def observe(self, lane: int, step: int, data: dict, mode: str) -> tuple[str, dict] | None:
        """(message, event data) of a forecast to record, or None. `mode`: the lane's mode (the formats it casts to)."""
        headroom = self.lanes.setdefault(lane, LaneHeadroom())
        headroom.add(step, data)
        forecast = headroom.earliest(formats_of_mode(mode))
        if forecast is None:
            return None
        told = self.told.get(lane)
        if told is not None and _same(told, forecast):
            moved = abs(forecast.predicted_step - told.predicted_step)
            if moved <= MOVED_SHARE * max(told.predicted_step - step, 1):
                return None
        self.told[lane] = forecast
        return forecast.message(), forecast.event_data()


def _same(a: Forecast, b: Forecast) -> bool:
    return (a.module, a.tensor, a.format, a.limit) == (b.module, b.tensor, b.format, b.limit)


def first_warning(told: list[tuple[int, dict]]) -> tuple[int, dict] | None:
    """Of a lane's told forecasts ((step, event data), in step order), the first warning of the latest: the earliest
    told of the same layer, tensor, format and limit since another was told. What a reader acts on (the most notice
    it gave) and what a failure is judged against; None when nothing was told."""
    if not told:
        return None
    key = _target(told[-1][1])
    first = len(told) - 1
    while first > 0 and _target(told[first - 1][1]) == key:
        first -= 1
    return int(told[first][0]), told[first][1]


def _target(data: dict) -> tuple:
    return data["module"], data["tensor"], data["format"], data["limit"]
