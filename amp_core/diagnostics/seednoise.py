"""Seed noise: whether two recipes differ by more than the spread across seed replicates (one rule, said once). The
engine's advisor and the views' summaries both hold their figures against it."""

from __future__ import annotations

import math

import numpy as np

DIFFERENCE_SDS = 2.0
"""Two modes differ when their means are more than this many standard errors of the difference apart."""
DIFFERENCE_RULE = ("different when |mean_a − mean_b| > 2 × √(sd_a²/S_a + sd_b²/S_b) (S: seeds with a finite "
                   "figure, sd: their sample standard deviation; a Welch-style two-sided rule, about 95% when the "
                   "figures are normal); with fewer than 2 seeds a mode has no spread and the rule cannot tell")
"""The rule `difference_verdict` applies, in words (shown with its verdicts)."""


def difference_verdict(mean_a: float, sd_a: float, n_a: int, mean_b: float, sd_b: float, n_b: int,
                       sds: float = DIFFERENCE_SDS) -> tuple[str, float]:
    """(verdict, threshold) of DIFFERENCE_RULE: "different" when |mean_a - mean_b| > sds × √(sd_a²/n_a + sd_b²/n_b),
    "within the spread" when not, "cannot tell" (threshold NaN) when a side has fewer than 2 finite figures."""
    if n_a < 2 or n_b < 2 or not all(np.isfinite([mean_a, sd_a, mean_b, sd_b])):
        return "cannot tell", np.nan
    threshold = sds * math.sqrt(sd_a**2 / n_a + sd_b**2 / n_b)
    return ("different" if abs(mean_a - mean_b) > threshold else "within the spread"), threshold
