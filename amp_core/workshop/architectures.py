"""The checks of the workshop's real-architecture scenario (a transformers Llama in 16-true, bf16-true and 16-mixed):
which lane breaks, at which step and in which part of the step, and why bf16's range saves the same pure 16-bit
recipe, each read from the run's step records and lane statuses."""

from __future__ import annotations

import math

import torch

from amp_core.workshop.evidence import Evidence, diverged, final_loss, first_nonfinite

PURE_FP16, PURE_BF16, MIXED_FP16 = "16-true", "bf16-true", "16-mixed"
"""The scenario's lanes: fp16 everywhere, bf16 everywhere (the same recipe with fp32's exponent), fp16 math on fp32
weights with a GradScaler."""
LEARNS = 0.10
"""A lane "learns" when its final loss ends at least this fraction below its first step's loss."""
FIRST_STEPS = 5
"""16-true "breaks at once" when its loss turns non-finite within this many steps."""


def _in(value: float, dtype: torch.dtype) -> float:
    """`value` as `dtype` stores it (what the optimizer's arithmetic really adds)."""
    return float(torch.tensor(value, dtype=dtype))


def _learned(lane) -> tuple[float, float]:
    """(first step's loss, final loss) of a lane."""
    return float(lane["loss"].iat[0]), final_loss(lane)


def pure_fp16_breaks(evidence: Evidence) -> tuple[bool, str, str]:
    """16-true's loss turns non-finite within the first steps while the step before it had a finite loss and
    gradient norm: the inf was made by the optimizer's update, not by the forward or the backward."""
    part = evidence.part(0)
    lane = part.lane(PURE_FP16, at_least=FIRST_STEPS)
    if not diverged(part, lane, PURE_FP16):
        return False, f"{PURE_FP16} stayed finite for its {len(lane)} steps", (
            f"Adam's eps ({part.config.eps:g}) is {_in(part.config.eps, torch.float16):g} in fp16 and every update "
            "stayed finite: with an eps fp16 can hold (1e-4 and up) pure fp16 trains; the point needs torch's "
            "default 1e-8.")
    bad = first_nonfinite(lane)
    step = bad[0] if bad else len(lane)
    before = lane[lane["step"] == step - 1]
    norm = float(before["grad_norm"].iat[0]) if not before.empty else math.nan
    figure = f"{PURE_FP16}'s loss became {bad[1] if bad else 'non-finite'} at step {step}" + (
        f"; step {step - 1}'s loss {float(before['loss'].iat[0]):.4g} and gradient norm {norm:.3g} were finite"
        if math.isfinite(norm) else "")
    held = step < FIRST_STEPS and math.isfinite(norm)
    eps16 = _in(part.config.eps, torch.float16)
    why = (f"Where: the update. The forward and the backward of step {step - 1} were finite, so the inf was made "
           f"by Adam's step: eps={part.config.eps:g} is {eps16:g} in fp16 and the squared gradients (second moment) "
           f"underflow below fp16's smallest subnormal ({_in(2.0**-24, torch.float16):.3g}), so update = m / "
           "(√v + eps) divides by 0 and overflows to inf in the weights.")
    if not held:
        why = (f"It broke later than expected (step {step}), or the step before it was not finite: "
               + why.split(". ", 1)[1])
    return held, figure, why


def _trains(evidence: Evidence, mode: str):
    """(the part, `mode`'s lane over every step, its first and last loss, whether it stayed finite, whether it also
    learned: its last loss LEARNS below its first)."""
    part = evidence.part(0)
    lane = part.lane(mode, at_least=part.config.steps)
    first, last = _learned(lane)
    finite = not diverged(part, lane, mode)
    return part, lane, first, last, finite, finite and last <= first * (1 - LEARNS)


def bf16_range_saves_it(evidence: Evidence) -> tuple[bool, str, str]:
    """bf16-true (the same pure 16-bit recipe, no scaler, no fp32 master weights) stays finite and learns."""
    part, _, first, last, finite, held = _trains(evidence, PURE_BF16)
    eps = part.config.eps
    figure = (f"{PURE_BF16}: loss {first:.4g} -> {last:.4g}" if finite else f"{PURE_BF16} diverged")
    why = (f"bf16 keeps fp32's 8-bit exponent: eps={eps:g} is {_in(eps, torch.bfloat16):.3g} in bf16 (0 in fp16) "
           f"and its smallest normal is {torch.finfo(torch.bfloat16).tiny:.3g} "
           f"(fp16's {torch.finfo(torch.float16).tiny:.3g}), "
           "so Adam's second moment and eps stay non-zero and no update overflows; what it gives up is mantissa "
           "(8 bits against fp16's 11).")
    if not held:
        why = (f"{PURE_BF16} {'did not learn' if finite else 'diverged'} here (final loss not {LEARNS:.0%} below its "
               "first): the LR or the steps were too small for the point, or something else broke; see the "
               "Overflow debugger.")
    return held, figure, why


def mixed_fp16_trains(evidence: Evidence) -> tuple[bool, str, str]:
    """16-mixed (fp16 math, fp32 weights and Adam state, a GradScaler) stays finite and learns."""
    _, lane, first, last, finite, held = _trains(evidence, MIXED_FP16)
    skipped = int(lane["skipped"].sum())
    figure = (f"{MIXED_FP16}: loss {first:.4g} -> {last:.4g}, {skipped} skipped steps" if finite
              else f"{MIXED_FP16} diverged")
    why = ("fp16 computes the matmuls, but the weights, eps and Adam's moments are fp32: the division that broke "
           "16-true happens in fp32; the GradScaler keeps small gradients out of fp16's underflow and skips a step "
           "whose scaled gradients overflow.")
    if not held:
        why = (f"{MIXED_FP16} {'did not learn' if finite else 'diverged'} here (final loss not {LEARNS:.0%} below its "
               "first): see its skipped steps on the scale chart.")
    return held, figure, why
