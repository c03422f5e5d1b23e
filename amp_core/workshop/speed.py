"""The speed scenario's checks: is a 16-bit mode faster than 32-true here, and how does that change with the size.

Each expectation follows what the device computes natively (tensor cores on a GPU; AVX-512 bf16/fp16 or AMX on a
CPU, or what AMP_LAB_CPU_NATIVE says): with native math a bigger matmul amortises the casts, so a 16-bit mode gains
with the size and wins at the large one; without it every multiply converts, the conversions grow with the matmuls,
so it is slower and falls further behind at the large size. Each figure is the median of the run's per-step ratios
(32-true's step time over the mode's, in the same interleaved step, so noise hits both alike) with a 95% interval;
when the interval cannot decide the expectation the verdict is "cannot tell here", never a pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from amp_core.precision import BASELINE_MODE, CPU_NATIVE_ENV, cpu_math, low_precision_dtype
from amp_core.workshop.evidence import Evidence, Part
from amp_core.workshop.verdicts import CannotTell, Measure

WARMUP_STEPS = 3
"""Steps left out of a lane's step times (first-call allocations, caches)."""
MIN_STEPS = 20
"""A speed is read once a lane has this many steps (its warm-up left out)."""
INTERVAL_Z = 1.96
"""The speed's interval: 95% (a distribution-free interval of the median of the per-step ratios)."""


@dataclass(frozen=True, slots=True)
class DeviceMath:
    """What a device computes natively in one 16-bit format, as the speed checks expect from it."""

    native: bool | None
    """Native math (expect a gain), none (expect a loss), or None: not known on this machine."""
    words: str
    """Why, for people ("this CPU has no native bf16 math (it converts to fp32 and back)")."""
    against_detection: bool = False
    """AMP_LAB_CPU_NATIVE says the opposite of what torch detects on this CPU: the expectation is the override's, the
    figures are the hardware's."""


def device_math(dtype: torch.dtype, device: str) -> DeviceMath:
    """What `device` ('cpu' or a CUDA device) computes natively in `dtype` (fp16 or bf16)."""
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return DeviceMath(None, "the run trained on a GPU and this machine has none, so what that GPU computes "
                                    "natively is not known here")
        major, minor = torch.cuda.get_device_capability()
        need = (8, 0) if dtype == torch.bfloat16 else (7, 0)
        ok = (major, minor) >= need
        return DeviceMath(ok, f"this GPU (compute capability {major}.{minor}) has {'' if ok else 'no '}{name} tensor "
                              "cores")
    try:
        counted = cpu_math()
    except ValueError as error:
        return DeviceMath(None, str(error))
    native = counted.has(dtype)
    if native and not counted.override and name == "bf16" and not bf16_tiles():
        return DeviceMath(None, BF16_WITHOUT_TILES)
    return DeviceMath(native, counted.words(dtype),
                      against_detection=bool(counted.override) and native != (name in counted.detected))


BF16_WITHOUT_TILES = ("this CPU's bf16 instructions are AVX-512 BF16's (conversions and dot products) without AMX "
                      "tiles: whether its bf16 matmuls beat fp32 depends on their shapes and oneDNN's kernels, so it "
                      "is not predicted")
"""Why bf16's speed is not predicted on such a CPU: measured both ways on one (an AVX-512 BF16 Xeon without AMX ran
this scenario's large bf16-mixed lane at 0.86-0.89x of 32-true, where an AMX Xeon ran it faster)."""


def bf16_tiles() -> bool:
    """Whether this CPU has AMX's bf16 tiles (its bf16 matmuls then run well above fp32's rate)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("amx_bf16"))


@dataclass(frozen=True, slots=True)
class SpeedRatio:
    """A mode's speed vs 32-true in one run: the median of its per-step ratios and a 95% interval of that median."""

    median: float
    low: float
    high: float
    steps: int
    """Steps the ratios come from."""

    def text(self) -> str:
        return f"{self.median:.2f}× (95% interval {self.low:.2f}–{self.high:.2f}, {self.steps} steps)"


def speed_ratio(part: Part, mode: str) -> SpeedRatio:
    """`mode`'s speed vs 32-true in `part`: per step, 32-true's step time over the mode's (the same step, so the
    machine's load hits both), its warm-up left out; the median, and the order statistics that bracket it with 95%
    confidence whatever the distribution."""
    base, lane = part.lane(BASELINE_MODE, at_least=MIN_STEPS), part.lane(mode, at_least=MIN_STEPS)
    paired = base[["step", "step_ms"]].merge(lane[["step", "step_ms"]], on="step", suffixes=("_base", "_mode"))
    paired = paired[paired["step"] >= WARMUP_STEPS]
    ratios = np.sort((paired["step_ms_base"] / paired["step_ms_mode"]).to_numpy(dtype=float))
    ratios = ratios[np.isfinite(ratios)]
    count = len(ratios)
    spread = INTERVAL_Z * math.sqrt(count) / 2
    low_rank = max(1, math.floor(count / 2 - spread))  # 1-based ranks of the median's interval
    high_rank = min(count, math.ceil(1 + count / 2 + spread))
    return SpeedRatio(float(np.median(ratios)), float(ratios[low_rank - 1]), float(ratios[high_rank - 1]), count)


def _cannot_decide(what: str) -> str:
    return (f"{what}: the difference is within this run's own step-time noise (a busy or throttled machine widens "
            "the interval). Run it again on a quieter machine, and trust the figure you see twice.")


OVERRIDDEN = (f"The expectation is {CPU_NATIVE_ENV}'s and the figures are this CPU's: the CPU does not do what the "
              "override says, so the check it cannot meet fails.")
"""Why a check failed whose expectation an override set against what torch detects."""


def _dtype(mode: str) -> torch.dtype:
    dtype = low_precision_dtype(mode)
    if dtype is None:
        raise ValueError(f"{mode} computes in fp32: there is no 16-bit speed to check")
    return dtype


def size_trend_expectation(mode: str) -> Callable[[str], str]:
    """device -> what `mode`'s speed vs 32-true should do from the small to the large size there, and why."""
    dtype = _dtype(mode)

    def expectation(device: str) -> str:
        math_ = device_math(dtype, device)
        if math_.native is None:
            return f"cannot be told here: {math_.words}"
        if math_.native:
            return f"its speed vs 32-true rises at the large size: {math_.words}, so bigger matmuls amortise the casts"
        return (f"its speed vs 32-true falls at the large size: {math_.words}, so the conversions grow with the "
                "matmuls")
    return expectation


def size_trend(mode: str) -> Measure:
    """`mode`'s speed vs 32-true at the first (small) and second (large) run: rises where the device has native math
    in its format, falls where it has not."""
    dtype = _dtype(mode)

    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        small, large = evidence.part(0), evidence.part(1)
        before, after = speed_ratio(small, mode), speed_ratio(large, mode)
        figure = (f"{mode} vs 32-true: {before.text()} at {small.config.size}, {after.text()} at "
                  f"{large.config.size}")
        math_ = device_math(dtype, evidence.device)
        if math_.native is None:
            raise CannotTell(figure, math_.words)
        rose, fell = after.low > before.high, after.high < before.low
        if not (rose or fell):
            raise CannotTell(figure, _cannot_decide("the two sizes' intervals overlap"))
        held = rose if math_.native else fell
        if held:
            return True, figure, ""
        if math_.against_detection:
            why = f"It {'fell' if fell else 'rose'}. {OVERRIDDEN}"
        elif math_.native:
            why = "It fell: at these sizes the casts cost more than the 16-bit math saves on this device."
        else:
            why = ("It rose: this device's 16-bit path grew cheaper next to fp32 with the size (it may convert once "
                   "per matmul and compute in fp32).")
        return False, figure, why
    return measure


def large_size_expectation(mode: str) -> Callable[[str], str]:
    """device -> whether `mode` should be faster than 32-true at the large size there, and why."""
    dtype = _dtype(mode)

    def expectation(device: str) -> str:
        math_ = device_math(dtype, device)
        if math_.native is None:
            return f"cannot be told here: {math_.words}"
        return f"{'faster' if math_.native else 'slower'} than 32-true: {math_.words}"
    return expectation


def large_size(mode: str) -> Measure:
    """`mode` vs 32-true in the second (large) run: faster where the device has native math in its format, slower
    where it has not."""
    dtype = _dtype(mode)

    def measure(evidence: Evidence) -> tuple[bool, str, str]:
        part = evidence.part(1)
        ratio = speed_ratio(part, mode)
        figure = f"{mode} at {part.config.size}: {ratio.text()} the speed of 32-true"
        math_ = device_math(dtype, evidence.device)
        if math_.native is None:
            raise CannotTell(figure, math_.words)
        if ratio.low <= 1.0 <= ratio.high:
            raise CannotTell(figure, _cannot_decide("its interval includes 1×"))
        held = ratio.low > 1.0 if math_.native else ratio.high < 1.0
        if held:
            return True, figure, ""
        measured = f"Measured {'slower' if math_.native else 'faster'} than 32-true"
        if math_.against_detection:
            return False, figure, f"{measured}. {OVERRIDDEN}"
        return False, figure, f"{measured}, the other way round from what the device implies, outside the run's noise."
    return measure


def expected_here(modes: tuple[str, ...]) -> Callable[[str], str]:
    """device -> one sentence: what the 16-bit modes of `modes` are expected to do there, and why (modes that the
    device treats alike in one clause)."""
    def line(device: str) -> str:
        groups: dict[tuple[bool | None, bool], list[str]] = {}
        for mode in modes:
            math_ = device_math(_dtype(mode), device)
            groups.setdefault((math_.native, math_.against_detection), []).append(mode)
        clauses = []
        for (native, _), members in groups.items():
            names = " and ".join(members)
            why = _why(device, members)
            if native is None:
                clauses.append(f"{names} cannot be told here ({why})")
            elif native:
                clauses.append(f"{names} faster than 32-true at the large size, gaining with the size: {why}")
            else:
                clauses.append(f"{names} slower than 32-true, more so at the large size: {why}")
        return "Expected on this device: " + "; ".join(clauses) + "."
    return line


def _why(device: str, modes: list[str]) -> str:
    """Why the device treats `modes` alike, in one phrase."""
    dtypes = [_dtype(mode) for mode in modes]
    if not device.startswith("cuda"):
        try:
            maths = [device_math(dtype, device) for dtype in dtypes]
            if any(math_.native is None for math_ in maths):  # not predicted: say why, not what the CPU has
                return "; ".join(dict.fromkeys(math_.words for math_ in maths))
            return cpu_math().words(*dtypes)
        except ValueError as error:
            return str(error)
    return "; ".join(dict.fromkeys(device_math(dtype, device).words for dtype in dtypes))
