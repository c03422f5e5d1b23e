"""Op-trace views: the module tree coloured by dtype, where each trace's FLOPs ran, and the op table as a person
reads it (dtype and shape side by side, short enough to fit the page)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from amp_core.probes.optrace import COMPUTE_DTYPES, LOSS, OUTSIDE, ROOT, STEP, OpTrace, format_bytes

DTYPE_COLOURS = {"fp32": "#4c78a8", "bf16": "#f58518", "fp16": "#e45756", "fp64": "#54a24b", "": "#bab0ac"}
"""Treemap colour per compute dtype ("" = no floating-point compute)."""
SPECIAL_MODULES: dict[str, tuple[str, str]] = {
    ROOT: ("(root): the model's own ops",
           "ops the model's forward() runs itself, outside any child module (a functional torch.relu, a positional "
           "add), and their backward"),
    LOSS: ("(loss)", "the loss function's ops, forward and backward"),
    OUTSIDE: ("(outside): not in the model or the loss",
              "ops outside both: backward's gradient seed (ones_like, d loss / d loss = 1) and, with a GradScaler, its "
              "loss x scale and that multiply's backward"),
}
"""The treemap's boxes that are not modules of the model (the op table's module names for them): (box label, what
they hold)."""
OP_TABLE_COLUMNS = ("#", "phase", "module", "op", "inputs", "outputs", "FLOPs", "note")


def module_treemap(trace: OpTrace, size_by: str = "ops") -> go.Figure:
    """The module tree, each box coloured by the dtype its compute ran in; sized by op count or FLOPs. The boxes
    that are not modules ((root), (loss), (outside)) carry a plain label and say in their hover what they hold."""
    if size_by not in ("ops", "flops"):
        raise ValueError(f"size_by must be 'ops' or 'flops', got {size_by!r}")
    modules = trace.module_frame()
    ids = [STEP, *modules["module"]]
    dtypes = ["", *modules["compute_dtype"]]
    labels = [f"{trace.label}: the whole step", *(
        SPECIAL_MODULES[m][0] if m in SPECIAL_MODULES else m.rpartition(".")[2] for m in modules["module"])]
    hover = [f"{trace.label}: one forward + backward", *(
        (f"{row.module}: {SPECIAL_MODULES[row.module][1]}<br>" if row.module in SPECIAL_MODULES else
         f"module {row.module}<br>")
        + f"forward: {row.forward_dtype or '—'} · backward: {row.backward_dtype or '—'}"
          f"<br>{row.ops} ops · {row.flops:,} FLOPs · {row.casts} casts"
        for row in modules.itertuples()
    )]
    treemap = {
        "type": "treemap", "ids": ids, "parents": ["", *modules["parent"]], "values": [0, *modules[size_by]],
        "labels": labels, "branchvalues": "remainder", "text": [d or "no compute" for d in dtypes],
        "texttemplate": "%{label}<br>%{text}", "customdata": hover, "hovertemplate": "%{customdata}<extra></extra>",
        "marker": {"colors": [DTYPE_COLOURS.get(d, "#72b7b2") for d in dtypes]}, "root": {"color": "white"},
    }
    key = " · ".join(f"<span style='color:{DTYPE_COLOURS[d]}'>■</span> {d}" for d in COMPUTE_DTYPES)
    layout = {"title": {"text": f"{trace.label}: dtype per module<br>{key}", "font": {"size": 13}},
              "margin": {"t": 55, "l": 5, "r": 5, "b": 5}, "height": 400}
    return go.Figure({"data": [treemap], "layout": layout})


def flop_share_figure(traces: Sequence[OpTrace]) -> go.Figure:
    """Stacked bars: the share of each trace's FLOPs that ran in fp32, bf16 and fp16."""
    summaries = [(t.label, t.summary()) for t in traces]
    data = [{"type": "bar", "name": dtype, "orientation": "h", "y": [label for label, _ in summaries],
             "x": [s.flop_share(dtype) for _, s in summaries], "marker": {"color": DTYPE_COLOURS[dtype]}}
            for dtype in COMPUTE_DTYPES]
    layout = {"barmode": "stack", "legend": {"traceorder": "normal"},
              "xaxis": {"tickformat": ".0%", "range": [0, 1], "title": {"text": "share of FLOPs"}},
              "yaxis": {"automargin": True}, "height": 120 + 40 * len(traces),
              "margin": {"t": 30, "l": 5, "r": 5, "b": 5},
              "title": {"text": "Where the FLOPs ran", "font": {"size": 13}}}
    return go.Figure({"data": data, "layout": layout})


# ---- the op table as a person reads it ----------------------------------------------------------------------------

def _tensors_text(dtypes: str, shapes: str) -> str:
    """"bf16, bf16, bf16" + "[256], [16, 64], [64, 256]" -> "bf16: [256], [16,64], [64,256]"; mixed dtypes go
    tensor by tensor ("fp16[16,10], fp32[10]"); repeats in a row are counted ("[16,4,32,16]×5", "fp32[64]×4")."""
    names = [d for d in dtypes.split(", ") if d]
    shape_list = [s.replace(" ", "") for s in re.findall(r"\[[^\]]*\]", shapes)]
    if not names and not shape_list:
        return "—"
    same = len(set(names)) == 1
    tokens = shape_list if same else [f"{name}{shape}" for name, shape in zip(names, shape_list, strict=False)]
    groups: list[list] = []
    for token in tokens:
        if groups and groups[-1][0] == token:
            groups[-1][1] += 1
        else:
            groups.append([token, 1])
    text = ", ".join(token + (f"×{count}" if count > 1 else "") for token, count in groups)
    return f"{names[0]}: {text}" if same else text


def _note(row) -> str:
    parts = [f"cast {format_bytes(row.cast_bytes)}"] if row.is_cast else []
    if pd.notna(row.widened_from):
        parts.append(f"widens #{int(row.widened_from)}")
    if row.is_view:
        parts.append("view")
    return "; ".join(parts)


def op_table(frame: pd.DataFrame) -> pd.DataFrame:
    """An op table (`OpTrace.to_frame`, filtered or not) as the page shows it: #, phase, module, op, inputs and
    outputs (dtype with shape; [] is a 0-d tensor), FLOPs, and a note: "cast 64 KiB" (bytes a cast wrote),
    "widens #35" (took op 35's bf16/fp16 result and produced fp32), "view" (no data moved). The CSV keeps every raw
    column."""
    return pd.DataFrame({
        "#": frame["index"].to_numpy(), "phase": frame["phase"].to_numpy(), "module": frame["module"].to_numpy(),
        "op": frame["op"].to_numpy(),
        "inputs": [_tensors_text(d, s) for d, s in zip(frame["in_dtypes"], frame["in_shapes"], strict=True)],
        "outputs": [_tensors_text(d, s) for d, s in zip(frame["out_dtypes"], frame["out_shapes"], strict=True)],
        "FLOPs": frame["flops"].to_numpy(), "note": [_note(row) for row in frame.itertuples()],
    }, columns=list(OP_TABLE_COLUMNS))


NOTES_COLUMN = "EffectivePyTorch prints (CUDA GPU)"
"""The seed demo's column of what the EffectivePyTorch notes print on a CUDA GPU under fp16 autocast."""


def autocast_demo_table(rows: list[dict[str, str]]) -> pd.DataFrame:
    """`optrace.autocast_demo` rows as the page's table: what really came out here, beside what the notes print on a
    CUDA GPU under fp16 autocast; the bf16 rows say "not in the notes" (the notes try fp16 only)."""
    table = pd.DataFrame(rows)
    notes = table.pop("seed notes (CUDA)")
    table[NOTES_COLUMN] = notes.where(notes != "", "not in the notes (fp16 only)")
    return table


BLOCK_STAGE_COLUMNS = ("phase", "module", "stage", "ops", "FLOPs")


def block_stage_table(frame: pd.DataFrame) -> pd.DataFrame:
    """An emulated block-scaled lane's trace (`OpTrace.to_frame`) by stage, in the order they ran: each Linear's
    quantise+dequantise of each operand (format, blocks or tiles, along which dim; Hadamard transform and stochastic
    rounding where the recipe applies them) and its GEMMs, with the ops (views not counted) and FLOPs each took.
    Empty when nothing ran block-scaled."""
    staged = frame[frame["block"] != ""] if "block" in frame else frame.iloc[0:0]
    if staged.empty:
        return pd.DataFrame(columns=list(BLOCK_STAGE_COLUMNS))
    # A stage's ops run one after another: a new row wherever the (phase, module, stage) changes.
    key = staged["phase"] + "\0" + staged["module"] + "\0" + staged["block"]
    runs = (key != key.shift()).cumsum()
    grouped = staged.assign(run=runs, counted=~staged["is_view"]).groupby("run", sort=True)
    return pd.DataFrame({"phase": grouped["phase"].first(), "module": grouped["module"].first(),
                         "stage": grouped["block"].first(), "ops": grouped["counted"].sum().astype(int),
                         "FLOPs": grouped["flops"].sum().astype(int)}).reset_index(drop=True)


FORMAT_COLUMNS = ("module", "format", "forward", "backward", "FLOPs")


def format_table(trace: OpTrace) -> pd.DataFrame:
    """Each module a format reached (Linear layers, modules kept in fp32), as the traced model held it, beside the
    dtypes its own ops computed in: an emulated block-scaled Linear's GEMMs compute in fp32 on dequantised operands,
    so its format is the figure that says what it ran as."""
    frame = trace.module_frame()
    shown = frame[frame["format"] != ""]
    return pd.DataFrame({"module": shown["module"], "format": shown["format"], "forward": shown["forward_dtype"],
                         "backward": shown["backward_dtype"], "FLOPs": shown["flops"].astype(int)},
                        columns=list(FORMAT_COLUMNS)).reset_index(drop=True)


def mixes_formats(trace: OpTrace) -> bool:
    """Whether a trace's modules ran in more than one format, or in a matmul format (a plan lane, a block-scaled or
    FP8 lane, kept modules): then the page shows `format_table`."""
    formats = set(trace.formats.values())
    return len(formats) > 1 or bool(formats - {"fp32", "bf16", "fp16"})
