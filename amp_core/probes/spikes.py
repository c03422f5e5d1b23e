"""Loss spikes a user would trust: a step whose loss lies above a rolling robust band (median + k·MAD of the steps
before it), shared by the charts that mark spikes and by the replay's verdict."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826
"""MAD times this estimates a normal distribution's standard deviation: k·MAD then reads like k sigmas."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SpikeRule:
    """When a step's loss is a spike: above median + k·MAD of the finite losses of the `window` steps before it."""

    window: int = 50
    """Steps before the step whose losses make its band."""
    k: float = 6.0
    """How many MADs (scaled to a standard deviation, x1.4826) above the median the band's upper edge lies."""
    min_history: int = 10
    """No band (no spike can be called) before this many finite losses precede the step."""

    def __post_init__(self) -> None:
        from amp_core.config import ConfigError

        for name in ("window", "min_history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"spikes.{name}", f"must be a whole number >= 1, got {value!r}")
        if not isinstance(self.k, (int, float)) or not math.isfinite(self.k) or self.k <= 0:
            raise ConfigError("spikes.k", f"must be a number > 0, got {self.k!r}")

    def describe(self) -> str:
        """The rule in words, for a caption or a verdict."""
        return (f"median + {self.k:g}·MAD of the previous {self.window} steps' losses (MAD x{MAD_TO_SIGMA} to read as "
                f"a standard deviation; at least {self.min_history} finite losses)")


@dataclass(frozen=True, slots=True)
class LossBand:
    """The robust band of the losses before one step."""

    median: float
    mad: float
    """Median absolute deviation, scaled to a standard deviation."""
    upper: float
    points: int
    """Finite losses it was made of."""


def loss_band(history: Sequence[float], rule: SpikeRule) -> LossBand | None:
    """The band of the last `rule.window` losses in `history` (oldest first); None with too few finite ones."""
    recent = np.asarray(list(history)[-rule.window:], dtype=np.float64)
    recent = recent[np.isfinite(recent)]
    if len(recent) < rule.min_history:
        return None
    median = float(np.median(recent))
    mad = float(np.median(np.abs(recent - median))) * MAD_TO_SIGMA
    return LossBand(median=median, mad=mad, upper=median + rule.k * mad, points=len(recent))


def band_upper(losses: Sequence[float], rule: SpikeRule) -> np.ndarray:
    """Per step, the band's upper edge from the `rule.window` steps before it (NaN where too few finite losses
    precede it). Vectorised: a window of every step at once (a long run's lane in well under a second)."""
    values = np.asarray(losses, dtype=np.float64)
    upper = np.full(len(values), np.nan)
    if len(values) <= rule.min_history:
        return upper
    finite = np.where(np.isfinite(values), values, np.nan)
    padded = np.concatenate([np.full(rule.window, np.nan), finite[:-1]])
    windows = np.lib.stride_tricks.sliding_window_view(padded, rule.window)  # row i: the window before step i
    enough = np.sum(~np.isnan(windows), axis=1) >= rule.min_history
    rows = windows[enough]
    with np.errstate(all="ignore"):
        median = np.nanmedian(rows, axis=1)
        mad = np.nanmedian(np.abs(rows - median[:, None]), axis=1) * MAD_TO_SIGMA
    upper[enough] = median + rule.k * mad
    return upper
