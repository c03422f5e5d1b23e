"""What a compiled lane really runs: one forward + backward of an eager copy of the model compiled with inductor behind
a backend that keeps what it is handed — the post-AOT graphs (forward and backward, every op with its dtype, the casts
autocast asked for as `convert_element_type` nodes) and inductor's generated code (its kernels, named by inductor
after the aten ops fused into each, with their argument types; the extern matmuls). A cast is *kept* where a kernel
does nothing but cast (its result is written to memory, as eager's `_to_copy` is) and *fused away* where it sits in a
kernel that also computes (the value is converted in registers and never stored in the cast dtype).

What this cannot see: inside a fused kernel, the dtype of each intermediate value (inductor may compute a pointwise
chain in fp32 and round once, pytorch#150638) — only the kernel's argument types and the ops it was built from.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from amp_core.imports import compiler_ready
from amp_core.precision import Precision
from amp_core.torch_private import inductor_backend

CAST_TARGETS = frozenset({"prims.convert_element_type.default", "aten._to_copy.default"})
CANNOT_SEE = ("Inside a fused kernel AMP Lab sees the aten ops inductor built it from (its name) and the types of its "
              "arguments, not the dtype of each intermediate value: inductor may compute a chain of pointwise ops in "
              "fp32 and round once at the end, so a fused kernel's rounding can differ from eager's op-by-op "
              "rounding. Matmuls go to extern kernels (oneDNN / cuBLAS) in the dtype their inputs were cast to.")
_CPP_KERNEL = re.compile(r"^(cpp_fused_\w+?)_(\d+) = async_compile\.cpp_pybinding\(\[(.*?)\]", re.MULTILINE)
_TRITON_KERNEL = re.compile(r"^(triton_\w+?)_(\d+) = async_compile\.triton\(", re.MULTILINE)
_EXTERN = re.compile(r"extern_kernels\.(\w+)\(")
_ARG_TYPES = {"float": "fp32", "at::BFloat16": "bf16", "at::Half": "fp16", "double": "fp64", "int64_t": "int64",
              "bool": "bool", "int32_t": "int32"}


def _dtype_name(value) -> str:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return ""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch."))


@dataclass(slots=True)
class CompiledKernel:
    """One generated kernel of the compiled step."""

    phase: str
    name: str
    ops: str
    """The aten ops inductor built it from, as its name says them (e.g. `_to_copy_gelu`)."""
    arg_dtypes: str
    cast_only: bool
    """It does nothing but cast: its casts are kept (written to memory)."""
    fuses_casts: bool
    """It casts and computes: its casts are fused away."""


@dataclass(slots=True)
class CompiledTrace:
    """The compiled step's graphs and kernels (plain data)."""

    recipe: str
    ops: pd.DataFrame
    """Every op of the post-AOT graphs: phase, node, op, dtype, input dtypes, is_cast."""
    kernels: list[CompiledKernel] = field(default_factory=list)
    extern: list[tuple[str, str]] = field(default_factory=list)
    """(phase, extern kernel) calls: matmuls and convolutions outside inductor's own code."""
    code: list[str] = field(default_factory=list)
    """Inductor's output code, forward then backward."""

    @property
    def graph_casts(self) -> int:
        return int(self.ops["is_cast"].sum()) if len(self.ops) else 0

    @property
    def kept_cast_kernels(self) -> int:
        """Kernels that only cast (their casts are written to memory)."""
        return sum(kernel.cast_only for kernel in self.kernels)

    @property
    def fusing_kernels(self) -> int:
        return sum(kernel.fuses_casts for kernel in self.kernels)

    def kernel_frame(self) -> pd.DataFrame:
        return pd.DataFrame([{"phase": k.phase, "kernel": k.name, "built from": k.ops, "argument dtypes": k.arg_dtypes,
                              "casts": "kept (cast only)" if k.cast_only else "fused" if k.fuses_casts else "none"}
                             for k in self.kernels] + [{"phase": phase, "kernel": f"extern_kernels.{name}",
                                                        "built from": name, "argument dtypes": "", "casts": "none"}
                                                       for phase, name in self.extern])


    def summary(self, max_rows: int = 400) -> CompiledSummary:
        """The step in a few rows (what a run keeps of a lane's compile): ops counted by phase, op and dtype, and the
        kernels; at most `max_rows` of each (the rest counted in `rows_left_out`)."""
        counts = (self.ops.groupby(["phase", "op", "dtype"], sort=False).size().reset_index(name="count")
                  if len(self.ops) else pd.DataFrame(columns=list(SUMMARY_OP_COLUMNS)))
        kernels = self.kernel_frame()
        left_out = max(0, len(counts) - max_rows) + max(0, len(kernels) - max_rows)
        return CompiledSummary(op_counts=counts.head(max_rows).reset_index(drop=True),
                               kernels=kernels.head(max_rows).reset_index(drop=True), graph_casts=self.graph_casts,
                               kept_cast_kernels=self.kept_cast_kernels, fusing_kernels=self.fusing_kernels,
                               rows_left_out=left_out)


SUMMARY_OP_COLUMNS = ("phase", "op", "dtype", "count")
KERNEL_COLUMNS = ("phase", "kernel", "built from", "argument dtypes", "casts")


@dataclass(slots=True)
class CompiledSummary:
    """A compiled step in a few rows, small enough to keep as a run's event (CompiledTrace.summary)."""

    op_counts: pd.DataFrame
    """The post-AOT graphs' ops counted by phase, op and dtype (SUMMARY_OP_COLUMNS)."""
    kernels: pd.DataFrame
    """The generated kernels and the extern calls, with the ops each was built from (KERNEL_COLUMNS)."""
    graph_casts: int
    """Casts in the compiled graphs (convert_element_type / _to_copy nodes)."""
    kept_cast_kernels: int
    """Kernels that only cast: those casts are kept (written to memory)."""
    fusing_kernels: int
    """Kernels that cast and compute: those casts are fused away."""
    rows_left_out: int = 0
    """Rows beyond the summary's bound, not kept."""

    @property
    def generated_kernels(self) -> int:
        return int((~self.kernels["kernel"].astype(str).str.startswith("extern_kernels.")).sum()) \
            if len(self.kernels) else 0

    def to_dict(self) -> dict:
        return {"op_counts": self.op_counts.to_dict("split")["data"], "kernels": self.kernels.to_dict("split")["data"],
                "graph_casts": self.graph_casts, "kept_cast_kernels": self.kept_cast_kernels,
                "fusing_kernels": self.fusing_kernels, "rows_left_out": self.rows_left_out}

    @classmethod
    def from_dict(cls, data: dict) -> CompiledSummary:
        counts = pd.DataFrame(data.get("op_counts") or [], columns=list(SUMMARY_OP_COLUMNS))
        return cls(op_counts=counts.astype({"count": int}),
                   kernels=pd.DataFrame(data.get("kernels") or [], columns=list(KERNEL_COLUMNS)),
                   graph_casts=int(data.get("graph_casts", 0)), kept_cast_kernels=int(data.get("kept_cast_kernels", 0)),
                   fusing_kernels=int(data.get("fusing_kernels", 0)), rows_left_out=int(data.get("rows_left_out", 0)))


class GraphCapture:
    """What inductor's inner compile is handed and makes, kept while it compiles: `inner` is the inner compile for
    torch_private.inductor_backend (every post-AOT graph, forward and backward, passes through it)."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, pd.DataFrame, str]] = []
        """(phase, the graph's ops, inductor's output code), in the order compiled."""

    def inner(self, graph, example_inputs, compile_inner, **kwargs):
        phase = "backward" if kwargs.get("is_backward") else "forward"
        rows = pd.DataFrame(_graph_rows(graph, phase))
        compiled = compile_inner(graph, example_inputs, **kwargs)
        self.parts.append((phase, rows, getattr(compiled, "source_code", "") or ""))
        return compiled

    def trace(self, recipe: str) -> CompiledTrace:
        """What was captured, as a CompiledTrace (ops, kernels found in the code, extern calls, the code)."""
        kernels, extern = [], []
        for phase, _, code in self.parts:
            found, calls = _kernels(code, phase)
            kernels += found
            extern += calls
        frames = [rows for _, rows, _ in self.parts if len(rows)]
        ops = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
            columns=["phase", "node", "op", "dtype", "input dtypes", "is_cast"])
        return CompiledTrace(recipe=recipe, ops=ops, kernels=kernels, extern=extern,
                             code=[code for _, _, code in self.parts])


def _graph_rows(graph: torch.fx.GraphModule, phase: str) -> list[dict]:
    rows = []
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        inputs = [_dtype_name(arg.meta.get("val")) for arg in node.all_input_nodes]
        rows.append({"phase": phase, "node": node.name, "op": target, "dtype": _dtype_name(node.meta.get("val")),
                     "input dtypes": ", ".join(dtype for dtype in inputs if dtype),
                     "is_cast": target in CAST_TARGETS})
    return rows


def _kernels(code: str, phase: str) -> tuple[list[CompiledKernel], list[tuple[str, str]]]:
    kernels = []
    for match in _CPP_KERNEL.finditer(code):
        ops = match.group(1).removeprefix("cpp_fused_")
        types = [_ARG_TYPES.get(t.strip(" '").removeprefix("const ").rstrip("*"), t.strip(" '"))
                 for t in match.group(3).split(",")]
        kernels.append(_kernel(phase, f"{match.group(1)}_{match.group(2)}", ops, ", ".join(types)))
    for match in _TRITON_KERNEL.finditer(code):
        ops = re.sub(r"^triton_(poi|red|per|tem)_fused_", "", match.group(1))
        kernels.append(_kernel(phase, f"{match.group(1)}_{match.group(2)}", ops, ""))
    call = code[code.find("def call("):] if "def call(" in code else code
    return kernels, [(phase, name) for name in _EXTERN.findall(call)]


def _kernel(phase: str, name: str, ops: str, arg_dtypes: str) -> CompiledKernel:
    casts = "_to_copy" in ops or "convert_element_type" in ops
    rest = ops.replace("_to_copy", "").replace("convert_element_type", "").strip("_")
    return CompiledKernel(phase=phase, name=name, ops=ops, arg_dtypes=arg_dtypes, cast_only=casts and not rest,
                          fuses_casts=casts and bool(rest))


def trace_compiled(model: nn.Module, precision: Precision, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   batch: tuple[torch.Tensor, torch.Tensor], mode: str = "default") -> CompiledTrace:
    """Compile one forward + loss (+ backward) of an eager copy of `model` under `precision` with inductor, keeping
    the post-AOT graphs and the generated code (module docstring). The caller's model is not touched. The compile is
    a real one (seconds; inductor's caches make a repeat quicker); it adds entries to dynamo's cache of the model's
    forward (a live compiled lane of the same model is unaffected: its own entries still match)."""
    work = precision.prepare_module(copy.deepcopy(model))  # a deepcopy is eager: torch drops the compiled call
    for parameter in work.parameters():
        parameter.grad = None
    capture = GraphCapture()

    # The recipe's autocast, entered inside the compiled function (so its casts are in the graph), built from plain
    # values: dynamo traces torch.autocast itself, not the Precision object's helpers.
    device_type, autocast_dtype = precision.device_type, precision.autocast_dtype

    def step(inputs, targets):
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            return loss(work(inputs), targets)

    inputs, targets = (precision.prepare_input(t) for t in batch)
    compiler_ready()
    compiled_step = torch.compile(step, backend=inductor_backend(capture.inner, mode))
    with torch.random.fork_rng(devices=[torch.device(precision.device)] if precision.device_type == "cuda" else []), \
            precision.cpu_context():
        compiled_step(inputs, targets).backward()
    return capture.trace(precision.recipe)


def trace_workload_compiled(workload: str, mode: str, size: str = "small", device: str = "cpu", *, seed: int = 0,
                            batch_size: int = 16) -> tuple[CompiledTrace, int]:
    """A freshly built workload's step in `mode` compiled (CompiledTrace), and the eager trace's cast count of the
    same mode (optrace's `_to_copy` ops): the casts eager runs as ops of their own."""
    from amp_core.config import RunConfig
    from amp_core.precision import get_precision
    from amp_core.probes.optrace import trace_step
    from amp_core.workloads import WORKLOADS, check_launch

    config = RunConfig(workload=workload, modes=(mode,), size=size, device=device, seed=seed, batch_size=batch_size)
    check_launch(config)
    spec = WORKLOADS[workload]
    precision = get_precision(mode, config.device)
    model, batch = spec.seeded_model_and_batch(config)
    eager = trace_step(model, precision, spec.loss, batch).to_frame()
    eager_casts = int(eager["op"].astype(str).str.contains("_to_copy").sum())
    return trace_compiled(model, precision, spec.loss, batch), eager_casts
