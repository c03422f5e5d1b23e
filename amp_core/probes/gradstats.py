"""Gradient ranges against fp16/bf16: log2 histograms, underflow/overflow fractions, non-finite forensics.

Fractions come from really casting the gradient (unscaled, and multiplied by the scale) to fp16 and bf16,
so they are what those formats do, ties and rounding included, not a threshold model.
"""

from __future__ import annotations

import torch

from amp_core.measure import local_tensor
from amp_core.records.schema import GradStats

HIST_LO = -140
"""Lowest log2 bin (below bf16's smallest subnormal, 2^-133); smaller magnitudes are counted in it."""
HIST_HI = 20
"""Highest log2 bin; larger magnitudes are counted in it."""
FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _fractions(values: torch.Tensor, scale: float) -> dict[str, float]:
    out: dict[str, float] = {}
    count = values.numel()
    if count == 0:
        return out
    # Unscaled, each value is cast as it is (a cast through float64 rounds the same number once, the same way: a
    # gradient's value is exact in float64); scaled, through float64, where value x scale is exact (one copy for
    # both formats).
    scaled = values.double() * scale if scale != 1.0 else None
    for fmt, dtype in FORMATS.items():
        smallest_normal = torch.finfo(dtype).tiny
        for label, source in (("unscaled", values), ("scaled", values if scaled is None else scaled)):
            stored = source.to(dtype).abs()
            zero = int((stored == 0).sum())
            out[f"{fmt}.zero.{label}"] = zero / count
            out[f"{fmt}.subnormal.{label}"] = (int((stored < smallest_normal).sum()) - zero) / count
            out[f"{fmt}.overflow.{label}"] = int(torch.isinf(stored).sum()) / count
    return out


def grad_stats(name: str, grad: torch.Tensor, scale: float = 1.0) -> GradStats:
    """Statistics of one (unscaled) gradient tensor (of this rank's shard, for a sharded one)."""
    g = local_tensor(grad.detach()).reshape(-1)
    finite_mask = torch.isfinite(g)
    if bool(finite_mask.all()):  # the usual case: no masked copy, no inf/NaN counts to make
        inf = nan = 0
        finite = g
    else:
        inf = int(torch.isinf(g).sum())
        nan = int(torch.isnan(g).sum())
        finite = g[finite_mask]
    nonzero = finite[finite != 0]
    # frexp gives |g| = m * 2**e with m in [0.5, 1): floor(log2|g|) = e - 1, exact for powers of two.
    _, exponent = torch.frexp(nonzero.float().abs())
    bins = (exponent.to(torch.int64) - 1).clamp(HIST_LO, HIST_HI) - HIST_LO
    hist = torch.bincount(bins, minlength=HIST_HI - HIST_LO + 1).tolist()
    return GradStats(param=name, numel=g.numel(), zeros=int(finite.numel() - nonzero.numel()), inf=inf, nan=nan,
                     hist=hist, scale=float(scale), fractions=_fractions(nonzero, scale))


def model_grad_stats(model: torch.nn.Module, scale: float = 1.0) -> list[GradStats]:
    """GradStats for every parameter that has a gradient."""
    return [grad_stats(name, p.grad, scale) for name, p in model.named_parameters() if p.grad is not None]


def nonfinite_params(model: torch.nn.Module) -> list[dict]:
    """Parameters whose gradient holds inf or NaN: name, inf count, NaN count."""
    out = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = local_tensor(p.grad)  # a sharded gradient: this rank's shard
        inf, nan = int(torch.isinf(grad).sum()), int(torch.isnan(grad).sum())
        if inf or nan:
            out.append({"param": name, "inf": inf, "nan": nan})
    return out


def lost_update_fraction(before: torch.Tensor, after: torch.Tensor, grad: torch.Tensor) -> float | None:
    """Share of elements with a finite non-zero gradient whose value did not move (the update rounded away); of this
    rank's shard, for a sharded parameter."""
    before, after, grad = local_tensor(before), local_tensor(after), local_tensor(grad)
    live = torch.isfinite(grad) & (grad != 0)
    count = int(live.sum())
    if count == 0:
        return None
    return int(((before == after) & live).sum()) / count


def combine(stats: list[GradStats]) -> GradStats:
    """Whole-model statistics: counts summed, fractions weighted by each parameter's non-zero count."""
    nonzero = [sum(s.hist) for s in stats]
    total_nonzero = sum(nonzero) or 1
    keys = stats[0].fractions.keys() if stats else []
    fractions = {k: sum(s.fractions.get(k, 0.0) * n for s, n in zip(stats, nonzero, strict=True)) / total_nonzero
                 for k in keys}
    lost = [(s.lost_update_fraction, n) for s, n in zip(stats, nonzero, strict=True)
            if s.lost_update_fraction is not None]
    lost_fraction = sum(f * n for f, n in lost) / (sum(n for _, n in lost) or 1) if lost else None
    return GradStats(param="(all)", numel=sum(s.numel for s in stats), zeros=sum(s.zeros for s in stats),
                     inf=sum(s.inf for s in stats), nan=sum(s.nan for s in stats),
                     hist=[sum(col) for col in zip(*(s.hist for s in stats), strict=True)] if stats else [],
                     scale=stats[0].scale if stats else 1.0, fractions=fractions, lost_update_fraction=lost_fraction)
