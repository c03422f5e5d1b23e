"""Gradient ranges against fp16/bf16: log2 histograms, underflow/overflow fractions, non-finite forensics.

Fractions come from really casting the gradient (unscaled, and multiplied by the scale) to fp16 and bf16,
so they are what those formats do, ties and rounding included, not a threshold model.
"""

from __future__ import annotations

import torch

from amp_core.probes.memory import local_tensor
from amp_core.records.schema import GradStats

HIST_LO = -140
"""Lowest log2 bin (below bf16's smallest subnormal, 2^-133); smaller magnitudes are counted in it."""
HIST_HI = 20
"""Highest log2 bin; larger magnitudes are counted in it."""
FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}


GROUP_ELEMENTS = 1 << 21
"""Gradients are measured together, as one flat tensor per group of about this many elements (several parameters, or
a slice of a larger one): ~35 ops and one host transfer per group (on CUDA the group's one sync) instead of ~30 ops
and 13 host reads per parameter. A group's temporaries take a few tens of bytes per element."""
BINCOUNT_DEVICES = frozenset({"cpu"})
"""Device types whose counts are torch's bincount; elsewhere `_add_up` (bincount reads its input's largest value back
to the host on CUDA: a sync per count)."""

_CLASSES = 4
"""A gradient element's class: 0 finite non-zero, 1 zero, 2 inf, 3 NaN."""
_BINS = HIST_HI - HIST_LO + 1
_CASTS = 5
"""A finite non-zero element cast to a format: 0 becomes zero, 1 subnormal, 2 overflows, 3 normal; 4 the element is
not finite non-zero (not counted)."""


def grad_stats(name: str, grad: torch.Tensor, scale: float = 1.0) -> GradStats:
    """Statistics of one (unscaled) gradient tensor (of this rank's shard, for a sharded one)."""
    return named_grad_stats([(name, grad)], scale)[0]


def model_grad_stats(model: torch.nn.Module, scale: float = 1.0) -> list[GradStats]:
    """GradStats for every parameter that has a gradient."""
    return named_grad_stats([(name, p.grad) for name, p in model.named_parameters() if p.grad is not None], scale)


def named_grad_stats(named: list[tuple[str, torch.Tensor]], scale: float = 1.0) -> list[GradStats]:
    """GradStats of each (name, gradient), in order, measured a group of GROUP_ELEMENTS elements at a time: each
    gradient's counts are the sums of its slices' (a group holds slices of one or several gradients)."""
    rows: list[list[int] | None] = [None] * len(named)
    sizes: list[int] = []
    group: list[tuple[int, torch.Tensor]] = []  # (the gradient's index, a slice of it)
    size = 0

    def measure() -> None:
        for index, row in zip((index for index, _ in group), _group_counts([piece for _, piece in group], scale),
                              strict=True):
            rows[index] = row if rows[index] is None else [a + b for a, b in zip(rows[index], row, strict=True)]

    for index, (_, grad) in enumerate(named):
        flat = local_tensor(grad.detach()).reshape(-1)
        sizes.append(flat.numel())
        for start in range(0, max(flat.numel(), 1), GROUP_ELEMENTS):
            piece = flat[start:start + GROUP_ELEMENTS]
            if group and (size + piece.numel() > GROUP_ELEMENTS or piece.device != group[0][1].device):
                measure()
                group, size = [], 0
            group.append((index, piece))
            size += piece.numel()
    if group:
        measure()
    return [_stats(name, numel, row, scale) for (name, _), numel, row in zip(named, sizes, rows, strict=True)]


def _group_counts(pieces: list[torch.Tensor], scale: float) -> list[list[int]]:
    """Each piece's counts (classes, histogram, casts: as _stats reads them), all reaching the host in one transfer:
    every count is made over (piece, class) keys of the group's elements (`_per_owner`).

    Values are compared in a dtype that holds every gradient exactly (float32 for fp16/bf16/fp32 gradients, float64
    for a float64 one); each value is cast to fp16 and bf16 as it is (one rounding of the same number: the same as a
    cast from its own dtype) and, multiplied by the scale in float64 (where the product is exact), once more."""
    common = torch.float64 if any(piece.dtype == torch.float64 for piece in pieces) else torch.float32
    values = torch.cat([piece.to(common) for piece in pieces]) if len(pieces) > 1 else pieces[0].to(common)
    count = len(pieces)
    owner = None if count == 1 else torch.repeat_interleave(
        torch.arange(count, device=values.device), _to_device([p.numel() for p in pieces], values.device),
        output_size=values.numel())  # output_size given: no read of the sizes' sum back to the host
    finite = torch.isfinite(values)
    live = finite & (values != 0)  # finite non-zero: what the histogram and the fractions count
    kind = torch.where(live, 0, torch.where(finite, 1, torch.where(torch.isinf(values), 2, 3)))
    counts = [_per_owner(owner, kind, _CLASSES, count)]
    # frexp gives |g| = m * 2**e with m in [0.5, 1): floor(log2|g|) = e - 1, exact for powers of two.
    _, exponent = torch.frexp(values.abs())
    bins = (exponent.to(torch.int64) - 1).clamp(HIST_LO, HIST_HI) - HIST_LO
    counts.append(_per_owner(owner, torch.where(live, bins, _BINS), _BINS + 1, count)[:, :_BINS])
    scaled = values.double() * scale if scale != 1.0 else None
    for dtype in FORMATS.values():
        tiny = torch.finfo(dtype).tiny
        for source in (values, scaled):  # unscaled, then scaled (the same counts again when the scale is 1)
            if source is None:
                counts.append(counts[-1])
                continue
            stored = source.to(dtype).abs()
            cast = torch.where(stored == 0, 0, torch.where(stored < tiny, 1, torch.where(torch.isinf(stored), 2, 3)))
            counts.append(_per_owner(owner, torch.where(live, cast, 4), _CASTS, count)[:, :3])
    return torch.cat(counts, dim=1).tolist()  # the one host transfer (a sync on CUDA: a sampled probe's)


def _per_owner(owner: torch.Tensor | None, key: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """(count, width) counts of `key` (0..width-1) per owner (0..count-1; None: one owner): see BINCOUNT_DEVICES."""
    keys = key if owner is None else owner * width + key
    if keys.device.type in BINCOUNT_DEVICES:
        return torch.bincount(keys, minlength=count * width).reshape(count, width)
    return _add_up(keys, count * width).reshape(count, width)


def _add_up(keys: torch.Tensor, size: int) -> torch.Tensor:
    """How many of `keys` (each in 0..size-1) are each value, added on the device with nothing read back (index_add_
    of ones into zeros: the output's size is known, so nothing waits for the keys); ~1.5x bincount's time on a CPU."""
    return torch.zeros(size, dtype=torch.int64, device=keys.device).index_add_(
        0, keys, torch.ones((), dtype=torch.int64, device=keys.device).expand(keys.numel()))


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` on `device` without waiting for it: copied from pinned host memory, in order on the current stream
    (a plain torch.tensor(..., device=cuda) copies from pageable memory, which makes the host wait)."""
    on_host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return on_host.to(device)
    return on_host.pin_memory().to(device, non_blocking=True)


def _stats(name: str, numel: int, row: list[int], scale: float) -> GradStats:
    """One parameter's GradStats from its row of counts (as _group_counts lays them out)."""
    live, zeros, inf, nan = row[:_CLASSES]
    hist = row[_CLASSES:_CLASSES + _BINS]
    casts = row[_CLASSES + _BINS:]
    fractions: dict[str, float] = {}
    if live:
        at = 0  # casts: for each format, unscaled then scaled, (zero, subnormal, overflow) each
        for fmt in FORMATS:
            for label in ("unscaled", "scaled"):
                zero, subnormal, overflow = casts[at:at + 3]
                at += 3
                fractions[f"{fmt}.zero.{label}"] = zero / live
                fractions[f"{fmt}.subnormal.{label}"] = subnormal / live
                fractions[f"{fmt}.overflow.{label}"] = overflow / live
    return GradStats(param=name, numel=numel, zeros=zeros, inf=inf, nan=nan, hist=hist, scale=float(scale),
                     fractions=fractions)


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


def lost_update_fractions(triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[float | None]:
    """For each (before, after, grad) of a parameter: the share of elements with a finite non-zero gradient whose value
    did not move (the update rounded away), None where there is no such element; of this rank's shard, for a sharded
    parameter. The counts reach the host in one transfer per device."""
    counts: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for index, (before, after, grad) in enumerate(triples):
        before, after, grad = local_tensor(before), local_tensor(after), local_tensor(grad)
        live = torch.isfinite(grad) & (grad != 0)
        counts.setdefault(grad.device, []).append((index, torch.stack([live.sum(), ((before == after) & live).sum()])))
    out: list[float | None] = [None] * len(triples)
    for pairs in counts.values():
        for (index, _), (live, still) in zip(pairs, torch.stack([pair for _, pair in pairs]).tolist(), strict=True):
            out[index] = still / live if live else None
    return out


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
