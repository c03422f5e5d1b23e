"""Block-scaled numerics over sampled steps: each Linear's GEMM operands (input, weight, output gradient) quantised in
a block-scaled format at the steps a run samples, as a `block_sample` event per sample, for a race's block-scaled
lane (on a shadow copy, `BlockSampler`) and for an attached job (hooks in the user's own step, `BlockWatch`).

One recorder measures both: `OperandRecorder` hooks the Linear layers; as a layer's forward runs it quantises the
input and weight the layer's GEMMs read (in the autocast dtype) with the recipe's own code (probes.block_numerics'
`operand_figures`, the emulated lanes' quantisers), and the output gradient as the backward produces it. The figures
stay on the device until `read`, which takes them to the host in one transfer and turns them into the event's data.

The sampled probes that carry it (probes.sampled, written once for a race lane and a Monitor's loop) are in
probes.block_sampling: they only configure it."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp_core.formats.linear import GRAD_OUTPUT, INPUT, WEIGHT, GemmRecipe
from amp_core.precision import Precision
from amp_core.probes.block_numerics import (
    SNR_THRESHOLD_DB,
    BlockNumericsReport,
    OperandNumerics,
    gemm_recipe,
    operand_figures,
    operand_numerics,
)
from amp_core.torch_private import foreach_copy_

BLOCK_SAMPLE_EVENT = "block_sample"
"""Event kind: one sampled step's block-scaled numerics of every Linear's GEMM operands (`sample_data`; the workshop's
one-probe `block_numerics` event is another kind)."""
ROW_FIELDS = ("layer", "operand", "format", "snr_db", "flush_share", "saturated_share", "underflow_share")
"""One row of the event's `rows`: a layer's operand in one format; snr_db is the string "inf" where every value beside
its block's largest quantised exactly (JSON has no inf)."""


@dataclass(slots=True)
class _Kept:
    layer: str
    operand: str
    format: str
    shape: tuple[int, ...]
    figures: torch.Tensor


@dataclass(slots=True)
class OperandRecorder:
    """While entered, hooks every nn.Linear of `model` (BlockScaledLinear too): each layer's first call per step has
    its operands measured in each of `formats` (block-scaled option names) whose blocks its dims fill. A hook that
    fails keeps the failure (`error`) and does nothing more, so the step it rides on goes on."""

    model: nn.Module
    formats: Sequence[str]
    gemms: dict[str, GemmRecipe] = field(init=False)
    kept: list[_Kept] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """"layer (format)": why it was not measured (its dims are not whole blocks)."""
    keep_outputs: bool = False
    """Keep the measured layers' outputs (`outputs`): a shadow's backward asks for their gradients. Off in a user's
    step, where holding them would keep its activations alive until the flush."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """The measured layers' outputs that need a gradient (with `keep_outputs`)."""
    hook_s: float = 0.0
    """Host time of the hooks: probe time, never step time."""
    account: Any = None
    """Another recorder (a layer watch's) whose `hook_s` counts this one's time too, as it is spent."""
    error: Exception | None = None
    _seen: set[str] = field(default_factory=set)
    _handles: list = field(default_factory=list)
    _generators: dict[torch.device, torch.Generator] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.gemms = {name: gemm_recipe(name) for name in self.formats}

    def __enter__(self) -> OperandRecorder:
        for name, layer in self.model.named_modules():
            if isinstance(layer, nn.Linear):
                self._handles.append(layer.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _generator(self, device: torch.device) -> torch.Generator:
        """Stochastic rounding's draws (a recipe that rounds gradients so): the recorder's own stream, so the step's
        random numbers stay the step's."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(0)
        return self._generators[device]

    def _measure(self, name: str, operand: str, tensor: torch.Tensor) -> None:
        for format_name, gemm in self.gemms.items():
            if f"{name} ({format_name})" in self.skipped:
                continue
            generator = self._generator(tensor.device) if operand == GRAD_OUTPUT else None
            self.kept.append(_Kept(name, operand, format_name, tuple(tensor.shape),
                                   operand_figures(tensor, gemm, operand, generator=generator)))

    def _hook(self, name: str):
        def record(layer: nn.Linear, args: tuple, output: Any) -> None:
            if self.error is not None or name in self._seen or not isinstance(output, torch.Tensor) or not args:
                return
            started = time.perf_counter()
            try:
                self._seen.add(name)
                for format_name, gemm in self.gemms.items():
                    why = gemm.misfit(layer.in_features, layer.out_features)
                    if why:
                        self.skipped[f"{name} ({format_name})"] = why
                device_type = output.device.type
                # The GEMMs read both operands in the autocast dtype (BlockScaledLinear casts them so, as torchao's).
                dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
                    else args[0].dtype
                with torch.no_grad():
                    self._measure(name, INPUT, args[0].detach().to(dtype).reshape(-1, layer.in_features))
                    self._measure(name, WEIGHT, layer.weight.detach().to(dtype))
                if output.requires_grad:
                    if self.keep_outputs:
                        self.outputs.append(output)
                    output.register_hook(self._grad_hook(name, layer.out_features))
            except Exception as exc:
                self.error = exc
            self._spent(time.perf_counter() - started)
        return record

    def _grad_hook(self, name: str, out_features: int):
        def keep(grad: torch.Tensor) -> None:  # returns None: the gradient flows on unchanged
            if self.error is not None:
                return
            started = time.perf_counter()
            try:
                with torch.no_grad():
                    self._measure(name, GRAD_OUTPUT, grad.detach().reshape(-1, out_features))
            except Exception as exc:
                self.error = exc
            self._spent(time.perf_counter() - started)
        return keep

    def _spent(self, seconds: float) -> None:
        self.hook_s += seconds
        if self.account is not None:
            self.account.hook_s += seconds

    def report(self, label: str = "", thresholds_db: dict[str, float] | None = None) -> BlockNumericsReport:
        """What was measured, read on the host (the one transfer of the sample: on CUDA it waits for the step)."""
        rows = torch.stack([kept.figures for kept in self.kept]).cpu().tolist() if self.kept else []
        operands = [operand_numerics(figures, self.gemms[kept.format], kept.operand, layer=kept.layer,
                                     format_name=kept.format, shape=kept.shape)
                    for kept, figures in zip(self.kept, rows, strict=True)]
        thresholds = {name: (thresholds_db or {}).get(name, SNR_THRESHOLD_DB[gemm.format])
                      for name, gemm in self.gemms.items()}
        return BlockNumericsReport(label=label, formats=tuple(self.formats), operands=tuple(operands),
                                   thresholds_db=thresholds, loss=math.nan, skipped=dict(self.skipped))


def _snr(value: float) -> float | str:
    return "inf" if math.isinf(value) and value > 0 else value


def sample_data(report: BlockNumericsReport, why: str = "sampled") -> tuple[str, dict[str, Any]]:
    """(message, data) of a `block_sample` event: a row per measured operand (ROW_FIELDS), the thresholds, per
    format the first layer below its threshold and the verdict line, what was not measured."""
    operands: tuple[OperandNumerics, ...] = report.operands
    rows = [[o.layer, o.operand, o.format, _snr(o.snr_db), o.flush_share, o.saturated_share, o.underflow_share]
            for o in operands]
    first = {name: (lambda found: found.layer if found else None)(report.first_below(name)) for name in report.formats}
    verdicts = {name: report.verdict(name) for name in report.formats}
    data = {"formats": list(report.formats), "fields": list(ROW_FIELDS), "rows": rows,
            "thresholds_db": report.thresholds_db, "first_below": first, "verdicts": verdicts,
            "skipped": report.skipped, "why": why}
    return "block numerics: " + " · ".join(verdicts.values()), data


class BlockSampler:
    """A race lane's block-scaled numerics, again and again, on a shadow copy made once (probes.numerics'
    LayerAmaxSampler's way: its weights refreshed from the lane's by an in-place copy before each sample). One forward
    in the lane's mode (its block-scaled layers as they run) and a backward that asks only for the Linear outputs'
    gradients (no parameter gradient), seen by an OperandRecorder; the lane's random numbers are untouched."""

    def __init__(self, model: nn.Module, precision: Precision, loss, formats: Sequence[str]):
        self.precision, self.loss, self.formats = precision, loss, tuple(formats)
        self.shadow = copy.deepcopy(model)
        self._sources = [*model.parameters(), *model.buffers()]
        self._targets = [*self.shadow.parameters(), *self.shadow.buffers()]

    def sample(self, batch: tuple[torch.Tensor, torch.Tensor]) -> BlockNumericsReport:
        with torch.no_grad():
            foreach_copy_(self._targets, self._sources)
        precision = self.precision
        inputs, target = (precision.prepare_input(t) for t in batch)
        device = inputs.device
        recorder = OperandRecorder(self.shadow, self.formats, keep_outputs=True)
        forked = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked), precision.step_context(), recorder:
            with precision.forward_context():
                value = self.loss(self.shadow(inputs), target)
            if recorder.outputs:
                torch.autograd.grad(value, recorder.outputs, allow_unused=True)
        if recorder.error is not None:
            raise recorder.error
        return recorder.report()


@dataclass(slots=True)
class BlockWatch:
    """An attached job's block-scaled numerics (MonitorConfig.block_formats), riding on its layer watch
    (probes.layerwatch.LayerWatch, `layers`): armed on the steps the layer watch arms (sampled, requested, after a
    failure), measured by hooks in the user's own step, read at the layer watch's read. Its hooks' host time is
    counted in the layer watch's recorder as it is spent, so the probe budget and the step-time exclusion count it."""

    model: nn.Module
    formats: Sequence[str]
    layers: Any
    """The LayerWatch it follows."""
    current: tuple[int, str, OperandRecorder] | None = None
    pending: list[tuple[int, str, OperandRecorder]] = field(default_factory=list)
    error: Exception | None = None
    """What a hook raised in the step that ended (its figures dropped); the desk tells it."""

    def follow(self, ended: int) -> None:
        """After the layer watch's `between_steps`: the hooks of step `ended` come off (its figures wait for `read`),
        and go on for the step the layer watch armed, if any, their time counted in its recorder's."""
        if self.current is not None:
            step, why, recorder = self.current
            recorder.__exit__()
            self.current = None
            if recorder.error is not None:
                self.error = recorder.error
            elif recorder.kept:
                self.pending.append((step, why, recorder))
        watched = self.layers.current
        if watched is not None and watched.step == ended + 1 and not self.layers.off:
            recorder = OperandRecorder(self.model, self.formats, account=watched.recorder)
            self.current = (watched.step, watched.why, recorder.__enter__())

    def take_error(self) -> Exception | None:
        error, self.error = self.error, None
        return error

    def read(self) -> list[tuple[str, str, int, dict[str, Any]]]:
        """The watched steps' figures (one host transfer each) as (kind, message, step, data) events."""
        events = []
        for step, why, recorder in self.pending:
            message, data = sample_data(recorder.report(), why)
            events.append((BLOCK_SAMPLE_EVENT, message, step, {**data, "sample_ms": recorder.hook_s * 1e3}))
        self.pending = []
        return events

    def close(self) -> None:
        if self.current is not None:
            self.current[2].__exit__()
            self.current = None
