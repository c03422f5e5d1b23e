"""Op trace: what autocast really did on this device, op by op, in one forward + backward of a copy of a model.

A `TorchDispatchMode` sees every aten op after autocast has rewritten it (the casts it inserted appear as
`_to_copy` ops), and a ModuleTracker names the module each op ran in, in the forward and in the backward.
Both exist only for the duration of one traced step: the dispatch mode is thread-local and the tracker's
hooks sit on the traced copy's modules, so a training thread running at the same time sees neither.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from amp_core.config import INSPECT_DEFAULTS, ConfigError, RunConfig
from amp_core.formats import stages
from amp_core.precision import Precision, compile_option, get_precision
from amp_core.probes.module_formats import module_formats, plain_format
from amp_core.torch_private import ScopedModuleTracker, TorchDispatchMode
from amp_core.workloads import WORKLOADS, check_launch

ROOT = "(root)"
"""Module path of the model itself (its own ops, outside any child module)."""
LOSS = "(loss)"
"""Module path of the loss function's ops."""
OUTSIDE = "(outside)"
"""Ops outside the model and the loss: the GradScaler's multiply, the gradient seed of backward."""
STEP = "step"
"""The top of the module tree: the model, the loss and what is outside both."""

FORWARD, BACKWARD = "forward", "backward"
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
"""The dtypes FLOP shares are reported in (any other float dtype still appears in the op table)."""
DEFAULT_TRACE_BATCH = INSPECT_DEFAULTS.trace_batch_size
"""Batch size of a workload trace (InspectConfig.trace_batch_size)."""


_SHORT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
_LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})
_TO_COPY = torch.ops.aten._to_copy
_CONTAINERS = (tuple, list, type({}.values()))
_VIEW_LIKE = frozenset({torch.ops.aten._unsafe_view})  # a new shape on a tensor just made; torch does not flag it
# CPU attention has its own aten op that torch's FLOP registry does not list; its arguments match the flash
# attention op's, so torch's own formulas apply unchanged.
_FLOP_FORMULAS = {
    **flop_registry,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        flop_registry[torch.ops.aten._scaled_dot_product_flash_attention],
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[torch.ops.aten._scaled_dot_product_flash_attention_backward],
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short dtype name: fp32, bf16, fp16, fp64; others as torch spells them (int64, bool, ...)."""
    return _SHORT_DTYPES.get(dtype) or str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class OpRecord:
    """One aten op that ran in the traced step."""

    index: int
    """Position in the step (0-based, forward then backward)."""
    phase: str
    """forward | backward."""
    module: str
    """Dotted path of the innermost module it ran in ("fc1"), or (root), (loss), (outside)."""
    op: str
    """aten op, overload shown unless it is .default ("addmm", "sum.dim_IntList")."""
    in_dtypes: tuple[str, ...]
    """Dtypes of the tensor arguments, in order."""
    in_shapes: tuple[tuple[int, ...], ...]
    """Shapes of the tensor arguments, in order."""
    out_dtypes: tuple[str, ...]
    """Dtypes of the tensor results."""
    out_shapes: tuple[tuple[int, ...], ...]
    """Shapes of the tensor results."""
    compute_dtype: str
    """Floating dtype the op computed in (its first floating result; else its first floating argument; else "")."""
    flops: int
    """torch.utils.flop_counter's count (matmuls, convolutions, attention; 0 for every other op)."""
    is_cast: bool
    """A `_to_copy` that changed the dtype."""
    is_view: bool
    """An alias of its input (view, t, detach, ...): no data moved."""
    cast_bytes: int
    """Bytes a cast wrote (0 for other ops)."""
    widened_from: int | None
    """When a low-precision result fed this op and it produced fp32: the index of the op that made that result."""
    block: str = ""
    """The stage of an emulated block-scaled GEMM it ran in (formats.stages: "quantise+dequantise input · nvfp4 ·
    1x16 blocks along in_features", "GEMM forward ..."); "" elsewhere."""


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """The headline figures of one trace."""

    ops: int
    forward_ops: int
    backward_ops: int
    casts: int
    cast_bytes: int
    flops: int
    flops_by_dtype: dict[str, int]
    """FLOPs per compute dtype (fp32, bf16, fp16 always present)."""
    widened: int
    """Ops where a low-precision result was widened to fp32."""

    def flop_share(self, dtype: str) -> float:
        """Fraction of FLOPs that ran in `dtype` (0 when the step has no FLOPs)."""
        return self.flops_by_dtype.get(dtype, 0) / self.flops if self.flops else 0.0

    @property
    def low_precision_share(self) -> float:
        """Fraction of FLOPs that ran in bf16 or fp16."""
        return self.flop_share("bf16") + self.flop_share("fp16")

    def lines(self) -> list[str]:
        """Human-readable summary, one figure per line."""
        shares = ", ".join(f"{d} {self.flop_share(d):.1%}" for d in self.flops_by_dtype)
        return [
            f"ops: {self.ops} (forward {self.forward_ops}, backward {self.backward_ops})",
            f"casts: {self.casts} (_to_copy changing dtype), {format_bytes(self.cast_bytes)} written",
            f"FLOPs: {self.flops:,} — {shares}",
            f"widened to fp32: {self.widened} ops took a low-precision result and produced fp32",
        ]


@dataclass(slots=True)
class OpTrace:
    """Every op of one traced forward + backward, plus where it came from. Plain data: picklable, cacheable."""

    label: str
    """What was traced, for titles ("digits_mlp · bf16-mixed", "run 3 · lane 1 · step 120")."""
    mode: str
    device: str
    records: list[OpRecord]
    modules: list[str]
    """Every module path of the traced model, (root) first, then (loss) and (outside)."""
    formats: dict[str, str] = field(default_factory=dict)
    """Module path -> the format it computed its matmuls in, read from the traced model's layers
    (probes.module_formats: a plan lane's mxfp8 / nvfp4 / bf16 / fp32 per Linear, kept modules); empty where
    unknown."""

    def to_frame(self) -> pd.DataFrame:
        """The op table: one row per op, shapes and dtype lists as text."""
        rows = [{
            "index": r.index, "phase": r.phase, "module": r.module, "op": r.op,
            "in_dtypes": ", ".join(r.in_dtypes), "in_shapes": _shapes_text(r.in_shapes),
            "out_dtypes": ", ".join(r.out_dtypes), "out_shapes": _shapes_text(r.out_shapes),
            "compute_dtype": r.compute_dtype, "flops": r.flops, "is_cast": r.is_cast, "is_view": r.is_view,
            "cast_bytes": r.cast_bytes, "widened_from": r.widened_from, "block": r.block,
        } for r in self.records]
        frame = pd.DataFrame(rows, columns=_OP_COLUMNS)
        frame["widened_from"] = frame["widened_from"].astype("Int64")
        return frame

    def summary(self) -> TraceSummary:
        flops_by_dtype = dict.fromkeys(COMPUTE_DTYPES, 0)
        for r in self.records:
            if r.flops:
                flops_by_dtype[r.compute_dtype] = flops_by_dtype.get(r.compute_dtype, 0) + r.flops
        casts = [r for r in self.records if r.is_cast]
        forward = sum(r.phase == FORWARD for r in self.records)
        return TraceSummary(
            ops=len(self.records), forward_ops=forward, backward_ops=len(self.records) - forward,
            casts=len(casts), cast_bytes=sum(r.cast_bytes for r in casts),
            flops=sum(flops_by_dtype.values()), flops_by_dtype=flops_by_dtype,
            widened=sum(r.widened_from is not None for r in self.records),
        )

    def module_frame(self) -> pd.DataFrame:
        """Per module (its own ops, not its children's): the dtype its compute ran in, forward and backward.

        A module's dtype is the one most of its FLOPs ran in; a module without FLOPs (ReLU, LayerNorm) takes the
        dtype most of its computing ops ran in. Views and casts are not compute.
        """
        own: dict[str, list[OpRecord]] = defaultdict(list)
        for r in self.records:
            own[r.module].append(r)
        rows = []
        for module in self.modules:
            records = own.get(module, [])
            flops = {d: sum(r.flops for r in records if r.compute_dtype == d) for d in COMPUTE_DTYPES}
            total = sum(r.flops for r in records)
            rows.append({
                "module": module, "parent": module_parent(module), "format": self.formats.get(module, ""),
                "compute_dtype": _dominant_dtype(records),
                "forward_dtype": _dominant_dtype([r for r in records if r.phase == FORWARD]),
                "backward_dtype": _dominant_dtype([r for r in records if r.phase == BACKWARD]),
                "ops": sum(not r.is_view for r in records), "casts": sum(r.is_cast for r in records),
                "cast_bytes": sum(r.cast_bytes for r in records), "flops": total,
                **{f"flops_{d}": flops[d] for d in COMPUTE_DTYPES},
                "low_precision_share": (flops["bf16"] + flops["fp16"]) / total if total else float("nan"),
            })
        return pd.DataFrame(rows)

    def widened_frame(self) -> pd.DataFrame:
        """Where a low-precision result was widened to fp32: the op that made it and the op that widened it."""
        by_index = {r.index: r for r in self.records}
        rows = []
        for r in self.records:
            if r.widened_from is None:
                continue
            source = by_index[r.widened_from]
            rows.append({
                "phase": r.phase, "producer": source.op, "producer_module": source.module,
                "produced": ", ".join(source.out_dtypes), "index": r.index, "op": r.op, "module": r.module,
                "in_dtypes": ", ".join(r.in_dtypes), "out_dtypes": ", ".join(r.out_dtypes),
            })
        return pd.DataFrame(rows, columns=["phase", "producer", "producer_module", "produced", "index", "op",
                                           "module", "in_dtypes", "out_dtypes"])


_OP_COLUMNS = ["index", "phase", "module", "op", "in_dtypes", "in_shapes", "out_dtypes", "out_shapes",
               "compute_dtype", "flops", "is_cast", "is_view", "cast_bytes", "widened_from", "block"]


def _shapes_text(shapes: Iterable[tuple[int, ...]]) -> str:
    return ", ".join(f"[{', '.join(map(str, s))}]" for s in shapes)


def module_parent(module: str) -> str:
    """Parent in the module tree: "blocks.0.ln1" -> "blocks.0", "fc1" -> (root), (root)/(loss) -> step."""
    if module in (ROOT, LOSS, OUTSIDE):
        return STEP
    return module.rpartition(".")[0] or ROOT


def _dominant_dtype(records: Sequence[OpRecord]) -> str:
    compute = [r for r in records if r.compute_dtype and not r.is_view and not r.is_cast]
    flops = Counter()
    for r in compute:
        flops[r.compute_dtype] += r.flops
    if sum(flops.values()):
        return flops.most_common(1)[0][0]
    counts = Counter(r.compute_dtype for r in compute)
    return counts.most_common(1)[0][0] if counts else ""


def format_bytes(count: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(count)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


class _ScopedModuleTracker(ScopedModuleTracker):
    """The scoped module tracker (torch_private), which also knows each module's depth in the tree."""

    def __init__(self, names: dict[nn.Module, str]):
        super().__init__(names)
        self._depth = {name: _depth(name) for name in names.values()}

    def innermost(self) -> str:
        """The deepest module running now (a tie, possible in the backward at branches, goes to the larger path)."""
        best, best_key = OUTSIDE, (-1, "")
        for name in self.parents:
            key = (self._depth.get(name, -1), name)
            if key > best_key and name in self._depth:
                best, best_key = name, key
        return best


def _depth(name: str) -> int:
    return 0 if name in (ROOT, LOSS) else name.count(".") + 1


class _OpRecorder(TorchDispatchMode):
    """Records every aten op with the module the tracker says is running."""

    def __init__(self, tracker: _ScopedModuleTracker):
        super().__init__()
        self.tracker = tracker
        self.phase = FORWARD
        self.records: list[OpRecord] = []
        # Which op made each live tensor (a view is credited to the op that made its base), for "widened".
        self._producer: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        subclass = next((t for t in types if t is not torch.Tensor and t is not nn.Parameter), None)
        if subclass is not None:
            # A tensor subclass (torchao's float8 tensors) runs its own aten ops inside its __torch_dispatch__, where
            # this mode is off: run it with the mode back on, so its real ops (_scaled_mm on float8 data, the casts
            # and scales) are recorded instead of the wrapper's `mm`.
            with self:
                return subclass.__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def __enter__(self):
        stages.listeners(1)  # the block-scaled emulation names its stages while a recorder is on
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            stages.listeners(-1)

    def _record(self, func, args, kwargs, out) -> None:
        inputs = _tensors(args, [])
        _tensors(kwargs.values(), inputs)
        outputs = _tensors(out, [])
        packet = func._overloadpacket
        index = len(self.records)
        is_view = func.is_view or packet in _VIEW_LIKE
        floating_out = next((t.dtype for t in outputs if t.is_floating_point()), None)
        floating_in = next((t.dtype for t in inputs if t.is_floating_point()), None)
        compute = floating_out or floating_in
        is_cast = packet is _TO_COPY and bool(inputs) and bool(outputs) and inputs[0].dtype != outputs[0].dtype
        formula = _FLOP_FORMULAS.get(packet)
        widened_from = None
        if floating_out == torch.float32:
            for t in inputs:
                if t.dtype in _LOW_PRECISION:
                    widened_from = self._producer.get(t)
                    if widened_from is not None:
                        break
        source = self._producer.get(inputs[0]) if is_view and inputs else None
        for t in outputs:
            self._producer[t] = index if source is None else source
        self.records.append(OpRecord(
            index=index, phase=self.phase, module=self.tracker.innermost(),
            op=func.__name__.removesuffix(".default"),
            in_dtypes=tuple(dtype_name(t.dtype) for t in inputs), in_shapes=tuple(tuple(t.shape) for t in inputs),
            out_dtypes=tuple(dtype_name(t.dtype) for t in outputs),
            out_shapes=tuple(tuple(t.shape) for t in outputs),
            compute_dtype=dtype_name(compute) if compute is not None else "",
            flops=int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0,
            is_cast=is_cast, is_view=is_view,
            cast_bytes=outputs[0].numel() * outputs[0].element_size() if is_cast else 0,
            widened_from=widened_from, block=stages.current(),
        ))


def _tensors(value: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results, in order (a hand-rolled tree_flatten: it runs for every op)."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, _CONTAINERS):
        for item in value:
            _tensors(item, found)
    return found


class _Loss(nn.Module):
    """The loss function as a module, so the tracker can name its ops in the forward and the backward."""

    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.loss = loss

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(output, target)


def trace_step(model: nn.Module, precision: Precision, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               batch: tuple[torch.Tensor, torch.Tensor], *, copy_model: bool = True, label: str = "") -> OpTrace:
    """Trace one forward + backward (no optimizer step) as the training step runs it, op by op.

    The model is deep-copied first unless `copy_model` is False (pass False only for a model that is already a
    throwaway copy): the caller's parameters and gradients are never touched. Returns plain data.
    The TF32 flags are left alone: they are process-global (setting them here could change a training lane's
    matmuls mid-step), and a TF32 matmul reports float32 anyway, so the trace could not show them. A CPU step's own
    switch is set (Precision.cpu_context: an FP8 recipe's matmuls off oneDNN's reference kernel).
    """
    if copy_model:
        model = copy.deepcopy(model)
    model = precision.prepare_module(model)
    for parameter in model.parameters():
        parameter.grad = None  # a fresh step: gradients are created, not accumulated onto old ones
    inputs, target = (precision.prepare_input(t) for t in batch)
    loss_module = _Loss(loss)
    names = {module: name or ROOT for name, module in model.named_modules()}
    names[loss_module] = LOSS
    scaler = precision.make_scaler()
    scaler.scale(torch.ones((), device=precision.device))  # the scale tensor is made once, before the first step

    tracker = _ScopedModuleTracker(names)
    recorder = _OpRecorder(tracker)
    with precision.cpu_context(), tracker, recorder:
        with precision.forward_context():
            output = model(inputs)
            loss_value = loss_module(output, target)
        scaled = scaler.scale(loss_value)
        if scaled is loss_value:  # no scaler: the loss is the root of the backward
            tracker.enter_on_grad(loss_value, LOSS)
        recorder.phase = BACKWARD
        scaled.backward()
    formats = {name or ROOT: fmt for name, fmt in module_formats(model, plain_format(precision.recipe)).items()}
    return OpTrace(label=label or precision.mode, mode=precision.mode, device=precision.device,
                   records=recorder.records, modules=[*dict.fromkeys(names.values()), OUTSIDE], formats=formats)


def trace_workload(workload: str, mode: str, size: str = "small", device: str = "cpu", *, seed: int = 0,
                   batch_size: int = DEFAULT_TRACE_BATCH) -> OpTrace:
    """Trace one step of a freshly built workload in one mode or recipe (`bf16-mixed+keep:fc2`). ConfigError for a bad
    name, size or recipe, and for a compiled recipe (a trace runs eagerly)."""
    config = RunConfig(workload=workload, modes=(mode,), size=size, device=device, seed=seed, batch_size=batch_size)
    check_launch(config)
    spec = WORKLOADS[workload]
    precision = get_precision(mode, config.device)
    if compile_option(precision) is not None:
        raise ConfigError("modes", f"{mode}: a trace runs the step eagerly, op by op, so it would not show what "
                                   "compiling makes of it; a compiled lane's own compile is traced by the Op "
                                   "inspector's \"A compiled lane's own compile\"")
    model, batch = spec.seeded_model_and_batch(config)
    return trace_step(model, precision, spec.loss, batch, copy_model=False, label=f"{workload} · {mode}")


def trace_lane(run: Any, lane_index: int) -> OpTrace:
    """Trace one step of a live lane on a snapshot of its current weights; the lane itself is untouched."""
    snapshot = run.snapshot_lane(lane_index)
    label = f"run {run.run_id} · lane {lane_index} · {snapshot.mode} · step {snapshot.step}"
    return trace_step(snapshot.model, snapshot.precision, snapshot.workload.loss, snapshot.batch,
                      copy_model=False, label=label)


def filter_ops(frame: pd.DataFrame, *, phases: Sequence[str] = (), modules: Sequence[str] = (),
               dtypes: Sequence[str] = (), hide_views: bool = False) -> pd.DataFrame:
    """Rows of an op table that match every given filter (an empty filter matches everything).

    A module selects its own ops and its submodules'; a dtype selects ops with it among their inputs or results.
    """
    keep = pd.Series(True, index=frame.index)
    if phases:
        keep &= frame["phase"].isin(phases)
    if modules:
        keep &= frame["module"].map(lambda m: any(m == s or m.startswith(f"{s}.") for s in modules))
    if dtypes:
        wanted = set(dtypes)
        touched = (frame["in_dtypes"] + ", " + frame["out_dtypes"]).str.split(", ")
        keep &= touched.map(lambda names: not wanted.isdisjoint(names))
    if hide_views:
        keep &= ~frame["is_view"]
    return frame[keep]


def compare_modules(first: OpTrace, second: OpTrace) -> pd.DataFrame:
    """Two traces of the same model side by side, per module (in the first trace's order): format, dtypes,
    low-precision FLOP share, casts. Column names carry the mode in brackets: "forward_dtype [bf16-mixed]"."""
    columns = ["module", "format", "forward_dtype", "backward_dtype", "low_precision_share", "casts"]
    left = first.module_frame()[columns]
    right = second.module_frame()[columns]
    names = (first.mode, second.mode) if first.mode != second.mode else (f"{first.mode} A", f"{second.mode} B")
    return left.merge(right, on="module", how="left", suffixes=tuple(f" [{name}]" for name in names))


def autocast_demo(device: str = "cpu") -> list[dict[str, str]]:
    """EffectivePyTorch's autocast demo run here: `x + y` and `x @ y` on 32x32 fp32 inputs, then with `y` in half
    precision, under fp16 and bf16 autocast on `device`. Each row holds the result dtype that really came out.

    "seed notes (CUDA)" is what the notes print on a GPU under fp16 autocast (they do not try bf16).
    """
    from amp_core.precision import resolve_device

    device = resolve_device(device)
    device_type = torch.device(device).type
    generator = torch.Generator().manual_seed(0)
    rows = []
    for autocast_dtype in (torch.float16, torch.bfloat16):
        for y_dtype in (torch.float32, torch.float16 if autocast_dtype == torch.float16 else torch.bfloat16):
            x = torch.rand(32, 32, generator=generator).to(device)
            y = torch.rand(32, 32, generator=generator).to(device=device, dtype=y_dtype)
            with torch.autocast(device_type=device_type, dtype=autocast_dtype):
                results = {"x + y": x + y, "x @ y": x @ y}
            for expression, result in results.items():
                seed_says = ""
                if autocast_dtype == torch.float16:
                    seed_says = "float32" if expression == "x + y" else "float16"
                rows.append({
                    "autocast": str(autocast_dtype).removeprefix("torch."), "x": "float32",
                    "y": str(y_dtype).removeprefix("torch."), "expression": expression,
                    "result": str(result.dtype).removeprefix("torch."), "seed notes (CUDA)": seed_says,
                })
    return rows
