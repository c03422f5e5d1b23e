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
    graphs: list[pd.DataFrame] = []
    codes: list[str] = []
    phases: list[str] = []

    def inner(graph, example_inputs, compile_inner, **kwargs):
        phase = "backward" if kwargs.get("is_backward") else "forward"
        phases.append(phase)
        graphs.append(pd.DataFrame(_graph_rows(graph, phase)))
        compiled = compile_inner(graph, example_inputs, **kwargs)
        codes.append(getattr(compiled, "source_code", "") or "")
        return compiled

    # The recipe's autocast, entered inside the compiled function (so its casts are in the graph), built from plain
    # values: dynamo traces torch.autocast itself, not the Precision object's helpers.
    device_type, autocast_dtype = precision.device_type, precision.autocast_dtype

    def step(inputs, targets):
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            return loss(work(inputs), targets)

    inputs, targets = (precision.prepare_input(t) for t in batch)
    compiled_step = torch.compile(step, backend=inductor_backend(inner, mode))
    with torch.random.fork_rng(devices=[torch.device(precision.device)] if precision.device_type == "cuda" else []):
        compiled_step(inputs, targets).backward()
    kernels, extern = [], []
    for phase, code in zip(phases, codes, strict=True):
        found, calls = _kernels(code, phase)
        kernels += found
        extern += calls
    ops = pd.concat(graphs, ignore_index=True) if graphs else pd.DataFrame(
        columns=["phase", "node", "op", "dtype", "input dtypes", "is_cast"])
    return CompiledTrace(recipe=precision.recipe, ops=ops, kernels=kernels, extern=extern, code=codes)


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
