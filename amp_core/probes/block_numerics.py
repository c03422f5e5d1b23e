"""Block-scaled numerics per layer: what MXFP8, NVFP4 or blockwise FP8 would do to each Linear's GEMM operands
(input, weight, output gradient), measured on the real tensors of one step with the recipe's own quantisation
(amp_core.formats, the emulated lanes' code).

One forward + backward of a throwaway copy of the model in bf16-mixed (the high precision the block-scaled recipes
start from) records each Linear's operands as its GEMMs read them (input and weight in the autocast dtype, the output
gradient as it arrives); each is then quantised as the recipe quantises it in its first GEMM (input and weight along
in_features, the recipe's 2-D tiles for weights; the output gradient along out_features, stochastically where the
recipe rounds gradients so). Per operand:

- `snr_db`: signal-to-noise, in dB, of the values beside each block's largest: the ones a shared scale crushes (the
  largest value of a block is always represented well; counting it lets one outlier hide that its 15 neighbours
  flushed to zero);
- `flush_share`: the share of non-zero values that quantise to exactly zero inside their block;
- `saturated_share` / `underflow_share`: the share of blocks whose scale hit the top / the bottom of what the scale
  format stores.

The first layer (in forward order) whose SNR falls below a threshold is named with why: an outlier channel (one
feature's magnitude many times the median feature's, sharing blocks with small ones) or a wide dynamic range inside
blocks (small values flushed beside large ones)."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn

from amp_core.config import ConfigError, RunConfig
from amp_core.formats.linear import GRAD_OUTPUT, INPUT, OPERANDS, WEIGHT, GemmRecipe
from amp_core.formats.quantize import block_view
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS
from amp_core.precision import get_precision
from amp_core.probes.numerics import DEFAULT_NUMERICS_BATCH, resolve_workload

FORMAT_NAMES = tuple(option.name for option in BLOCK_SCALED_OPTIONS)
"""What `--format` takes: a block-scaled recipe option's name (its GEMM recipe is the one measured)."""
SNR_THRESHOLD_DB = {"mxfp8": 25.0, "nvfp4": 10.0, "fp8-blockwise": 25.0}
"""Default SNR below which a layer is named, by element format: well under what the format keeps on Gaussian values
of one scale (MXFP8 and blockwise FP8 ~31 dB, NVFP4 ~16 dB measured), so a named layer lost bits to its data, not to
the format's resolution alone."""
OUTLIER_FACTOR = 16.0
"""A feature (column) whose |max| is this many times the median feature's is an outlier channel."""
HIGH_PRECISION_MODE = "bf16-mixed"


@dataclass(frozen=True, slots=True)
class OperandNumerics:
    """One GEMM operand of one layer, quantised in one format."""

    layer: str
    operand: str
    """input | weight | grad_output."""
    format: str
    shape: tuple[int, ...]
    snr_db: float
    """SNR (dB) of the values beside each block's largest; inf where they all quantise exactly."""
    flush_share: float
    saturated_share: float
    underflow_share: float
    why: str
    """Why the SNR is what it is, in words: an outlier channel, a wide dynamic range, or the format's resolution."""


@dataclass(frozen=True, slots=True)
class BlockNumericsReport:
    """Every Linear's operands in each format asked for, from one step's tensors."""

    label: str
    formats: tuple[str, ...]
    operands: tuple[OperandNumerics, ...]
    thresholds_db: dict[str, float]
    loss: float
    skipped: dict[str, str]
    """Linear layers not measured in a format, with why ("format: misshaped ...")."""

    def frame(self) -> pd.DataFrame:
        """One row per (layer, operand, format), in forward order."""
        return pd.DataFrame([{"layer": o.layer, "operand": o.operand, "format": o.format, "snr_db": o.snr_db,
                              "flush_share": o.flush_share, "saturated_share": o.saturated_share,
                              "underflow_share": o.underflow_share, "why": o.why} for o in self.operands])

    def layer_snr(self) -> pd.DataFrame:
        """Each layer's lowest operand SNR per format (layers in forward order, one column per format)."""
        frame = self.frame()
        if frame.empty:
            return frame
        order = list(dict.fromkeys(frame["layer"]))
        table = frame.groupby(["layer", "format"])["snr_db"].min().unstack("format")
        return table.reindex(index=order, columns=list(self.formats))

    def first_below(self, format_name: str) -> OperandNumerics | None:
        """The first operand (forward order, then input, weight, grad_output) whose SNR in `format_name` is below
        its threshold."""
        threshold = self.thresholds_db[format_name]
        return next((o for o in self.operands if o.format == format_name and o.snr_db < threshold), None)

    def lowest(self, format_name: str) -> OperandNumerics | None:
        """The operand with the lowest SNR in `format_name`."""
        found = [o for o in self.operands if o.format == format_name]
        return min(found, key=lambda o: o.snr_db) if found else None

    def verdict(self, format_name: str) -> str:
        """One line: the first layer below the threshold and why, or that none is."""
        threshold = self.thresholds_db[format_name]
        first = self.first_below(format_name)
        if self.lowest(format_name) is None:
            return f"{format_name}: no Linear layer measured (none has dims that are whole blocks of this format)"
        if first is None:
            lowest = self.lowest(format_name)
            worst = f" (lowest: {lowest.layer} {lowest.operand}, {lowest.snr_db:.1f} dB)" if lowest else ""
            return f"{format_name}: every layer keeps >= {threshold:g} dB{worst}"
        return (f"{format_name}: first layer below {threshold:g} dB: {first.layer} ({first.operand}, "
                f"{first.snr_db:.1f} dB) — {first.why}")


def gemm_recipe(format_name: str) -> GemmRecipe:
    """The GEMM recipe of a block-scaled option by name; ValueError naming the choices."""
    option = next((o for o in BLOCK_SCALED_OPTIONS if o.name == format_name), None)
    if option is None:
        raise ConfigError("format", f"unknown block-scaled format {format_name!r}; choose from "
                                    f"{', '.join(FORMAT_NAMES)}")
    return option.gemm


FIGURES = ("signal", "noise", "nonzero", "flushed", "saturated", "underflowed", "blocks", "top_column",
           "median_column", "top_index")
"""What `operand_figures` returns, in order: the power of the values beside each block's largest and of their
quantisation error, the non-zero values and those that quantise to zero, the blocks whose scale saturated or
underflowed and all blocks, the largest column |max|, the median column |max| and the largest column's index."""


def operand_figures(tensor: torch.Tensor, gemm: GemmRecipe, operand: str, *,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """`tensor` (2-D, the GEMM's reduction dim last) quantised as `gemm` quantises `operand`, and what that did, as a
    float64 vector of FIGURES on the tensor's device: no host sync, so a hook in a user's own step can keep it until
    a flush (`operand_numerics` reads it)."""
    values = tensor.detach().to(torch.float32)
    blocked = gemm.quantize(values, operand, generator=generator)
    tiles = operand == WEIGHT and gemm.weight_tiles
    original = block_view(values, gemm.block, tiles).reshape(-1, gemm.block ** (2 if tiles else 1))
    quantized = block_view(blocked.values, gemm.block, tiles).reshape(original.shape)
    beside = torch.ones_like(original, dtype=torch.bool).scatter_(1, original.abs().argmax(1, keepdim=True), False)
    error = (quantized - original) * beside
    nonzero = values != 0
    columns = values.abs().amax(0)
    top_value, top_index = columns.max(0)
    return torch.stack([
        (original * beside).double().square().sum(), error.double().square().sum(),
        nonzero.sum().double(), (nonzero & (blocked.values == 0)).sum().double(),
        blocked.saturated.sum().double(), blocked.underflowed.sum().double(),
        # A fill kernel, not a copy from the host (new_tensor's would wait for the device's queue on CUDA).
        torch.full((), float(blocked.saturated.numel()), dtype=torch.float64, device=values.device),
        top_value.double(), columns.median().double(), top_index.double()])


def operand_numerics(figures: Sequence[float], gemm: GemmRecipe, operand: str, *, layer: str = "",
                     format_name: str = "", shape: tuple[int, ...] = ()) -> OperandNumerics:
    """What `operand_figures` measured (read on the host) as an OperandNumerics."""
    got = dict(zip(FIGURES, figures, strict=True))
    flushed = got["flushed"] / max(got["nonzero"], 1.0)
    blocks = max(got["blocks"], 1.0)
    return OperandNumerics(layer=layer, operand=operand, format=format_name or gemm.format, shape=shape,
                           snr_db=_snr_db(got["signal"], got["noise"]), flush_share=flushed,
                           saturated_share=got["saturated"] / blocks, underflow_share=got["underflowed"] / blocks,
                           why=_why(got, flushed, gemm, operand))


def _snr_db(power: float, error: float) -> float:
    if error == 0:
        return math.inf
    return 10 * math.log10(power / error) if power > 0 else -math.inf


def measure_operand(tensor: torch.Tensor, gemm: GemmRecipe, operand: str, *, layer: str = "", format_name: str = "",
                    generator: torch.Generator | None = None) -> OperandNumerics:
    """`tensor` (2-D, the GEMM's reduction dim last) quantised as `gemm` quantises `operand`, and what that did."""
    figures = operand_figures(tensor, gemm, operand, generator=generator).tolist()
    return operand_numerics(figures, gemm, operand, layer=layer, format_name=format_name, shape=tuple(tensor.shape))


def _why(got: dict[str, float], flushed: float, gemm: GemmRecipe, operand: str) -> str:
    """An outlier channel (a column of the operand many times the median column's |max|), a wide dynamic range
    (values flushed beside their block's largest), or the format's resolution."""
    median, top = got["median_column"], got["top_column"]
    if median > 0 and top >= OUTLIER_FACTOR * median:
        kind = "input feature" if operand == WEIGHT else "feature"
        return (f"outlier channel: {kind} {int(got['top_index'])} reaches {top / median:.0f}x the median feature's "
                f"|max|, and the values sharing its blocks of {gemm.block} take its scale")
    if flushed > 0.05:
        return f"wide dynamic range: {flushed:.0%} of the non-zero values flush to zero beside their block's largest"
    return f"{gemm.format}'s resolution: its elements keep this much of values of one scale"


def _operands(model: nn.Module, loss, batch: Any, device: str) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """One bf16-mixed forward + backward of `model` (a copy the caller owns): each nn.Linear's first call's operands,
    as its GEMMs read them, by layer name in forward order."""
    precision = get_precision(HIGH_PRECISION_MODE, device)
    model = precision.prepare_module(model)
    found: dict[str, dict[str, torch.Tensor]] = {}
    handles = []

    def hook(name: str):
        def record(layer: nn.Linear, args: tuple, output: torch.Tensor) -> None:
            if name in found or not isinstance(output, torch.Tensor):
                return
            dtype = torch.get_autocast_dtype(output.device.type) if torch.is_autocast_enabled(
                output.device.type) else args[0].dtype
            found[name] = {INPUT: args[0].detach().to(dtype).reshape(-1, layer.in_features),
                           WEIGHT: layer.weight.detach().to(dtype)}
            if output.requires_grad:
                def keep_grad(grad: torch.Tensor) -> None:  # returns None: the gradient flows on unchanged
                    found[name].setdefault(GRAD_OUTPUT, grad.detach().reshape(-1, layer.out_features))

                output.register_hook(keep_grad)
        return record

    for name, layer in model.named_modules():
        if type(layer) is nn.Linear:
            handles.append(layer.register_forward_hook(hook(name)))
    try:
        inputs, target = (precision.prepare_input(t) for t in batch)
        with torch.random.fork_rng(devices=[]), precision.step_context():
            with precision.forward_context():
                value = loss(model(inputs), target)
            value.backward()
    finally:
        for handle in handles:
            handle.remove()
    return found, float(value.detach().float())


def probe_model(model: nn.Module, loss, batch: Any, formats: Sequence[str], *, device: str = "cpu", label: str = "",
                thresholds_db: dict[str, float] | None = None, copy_model: bool = True) -> BlockNumericsReport:
    """Block-scaled numerics of `model`'s Linear layers on one batch, in each of `formats` (FORMAT_NAMES)."""
    gemms = {name: gemm_recipe(name) for name in formats}
    tensors, loss_value = _operands(copy.deepcopy(model) if copy_model else model, loss, batch, device)
    generator = torch.Generator().manual_seed(0)
    measured, skipped = [], {}
    for layer, operands in tensors.items():
        for name, gemm in gemms.items():
            rows, cols = operands[WEIGHT].shape
            why = gemm.misfit(cols, rows)
            if why:
                skipped[f"{layer} ({name})"] = why
                continue
            measured += [measure_operand(operands[operand], gemm, operand, layer=layer, format_name=name,
                                         generator=generator) for operand in OPERANDS if operand in operands]
    thresholds = {name: (thresholds_db or {}).get(name, SNR_THRESHOLD_DB[gemms[name].format]) for name in formats}
    return BlockNumericsReport(label=label, formats=tuple(formats), operands=tuple(measured), thresholds_db=thresholds,
                               loss=loss_value, skipped=skipped)


def probe_workload_formats(workload: str, formats: Sequence[str], size: str = "small", device: str = "cpu", *,
                           seed: int = 0, batch_size: int = DEFAULT_NUMERICS_BATCH,
                           thresholds_db: dict[str, float] | None = None) -> BlockNumericsReport:
    """Block-scaled numerics of a freshly built workload's first batch. ConfigError naming the field for a bad
    workload, size, format or batch size."""
    if not formats:
        raise ConfigError("format", f"name a block-scaled format ({', '.join(FORMAT_NAMES)})")
    for name in formats:
        gemm_recipe(name)
    spec = resolve_workload(workload)
    if spec.sizes and size not in spec.sizes:
        raise ConfigError("size", f"{spec.name} has sizes {', '.join(spec.sizes)}, not {size!r}")
    config = RunConfig(workload=spec.name, modes=(HIGH_PRECISION_MODE,), size=size, device=device, seed=seed,
                       batch_size=batch_size)
    model, batch = spec.seeded_model_and_batch(config)
    return probe_model(model, spec.loss, batch, formats, device=device, copy_model=False,
                       label=f"{spec.name} · {', '.join(formats)}", thresholds_db=thresholds_db)
