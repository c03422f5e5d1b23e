"""Each format's figures worked out from its bit layout alone: what format tests compare amp_core's facts with.

amp_core reads the figures from torch.finfo; comparing them with torch.finfo again would prove nothing. These come
from the definitions instead: sign, exponent and mantissa widths, an IEEE-style bias, and whether the top exponent
is kept for inf/NaN (IEEE) or holds numbers too (float8_e4m3fn: no inf, NaN only at all-ones).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True
    """IEEE style: the top exponent holds only inf and NaN. False for e4m3fn, whose top exponent holds numbers."""

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max(self) -> float:
        if self.has_inf:  # the largest exponent below the all-ones one, every mantissa bit set
            return (2 - 2.0**-self.mantissa_bits) * 2.0 ** (2**self.exponent_bits - 2 - self.bias)
        # all-ones exponent with all-ones mantissa is NaN: the largest number has the mantissa's last bit clear
        return (2 - 2.0 ** -(self.mantissa_bits - 1)) * 2.0 ** (2**self.exponent_bits - 1 - self.bias)

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        return 2.0**-self.mantissa_bits


LAYOUTS = {
    "fp32": Layout(8, 23),
    "tf32": Layout(8, 10),
    "bf16": Layout(8, 7),
    "fp16": Layout(5, 10),
    "fp8 e4m3fn": Layout(4, 3, has_inf=False),
    "fp8 e5m2": Layout(5, 2),
}
