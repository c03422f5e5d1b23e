"""Block-scaled numerics shaped for people: the per-layer table (terminal text and a page's frame), the verdict lines,
a heatmap of each layer's operand SNR per format, and over a run's sampled steps (its `block_sample` events) a
heatmap of each layer's SNR per step with the latest verdicts."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from amp_core.probes.block_numerics import BlockNumericsReport
from amp_core.probes.block_watch import BLOCK_SAMPLE_EVENT, ROW_FIELDS
from amp_core.views.plots import chart_layout, empty_figure

COLUMNS = {"layer": "layer", "operand": "operand", "format": "format", "snr_db": "SNR dB",
           "flush_share": "→0 in block", "saturated_share": "scale sat.", "underflow_share": "scale underfl."}
"""The table's columns with their short headers."""
LEGEND = ("SNR dB: signal-to-noise of the values beside each block's largest; →0 in block: share of non-zero values "
          "that quantise to zero; scale sat. / underfl.: share of blocks whose scale hit the top / bottom of its "
          "format")


def display_frame(report: BlockNumericsReport) -> pd.DataFrame:
    """The per-operand table with short headers, in forward order."""
    frame = report.frame()
    if frame.empty:
        return pd.DataFrame(columns=list(COLUMNS.values()))
    return frame[list(COLUMNS)].rename(columns=COLUMNS)


def _cell(value: float, column: str) -> str:
    if column == "snr_db":
        return "exact" if math.isinf(value) and value > 0 else f"{value:.1f}"
    return f"{value:.1%}" if value >= 0.001 else ("<0.1%" if value else "0")


def report_text(report: BlockNumericsReport) -> str:
    """The terminal's report: the table, its legend, what was not measured, and last one verdict line per format."""
    frame = report.frame()
    lines = [f"{report.label}: one bf16-mixed forward + backward, each Linear's GEMM operands quantised as each "
             f"recipe does (loss {report.loss:.6g})", ""]
    if frame.empty:
        lines.append("no Linear layer could be measured in these formats")
    else:
        shown = pd.DataFrame({COLUMNS[c]: ([_cell(v, c) for v in frame[c]] if c.endswith(("_db", "_share"))
                                           else frame[c]) for c in COLUMNS})
        lines += [shown.to_string(index=False), f"  {LEGEND}"]
    if report.skipped:
        lines += ["", "not measured: " + "; ".join(f"{name}: {why}" for name, why in report.skipped.items())]
    lines += [""] + [report.verdict(name) for name in report.formats]
    return "\n".join(lines)


def snr_heatmap(report: BlockNumericsReport) -> go.Figure:
    """Layers (forward order, top to bottom) x (format, operand): SNR in dB, red where it is low; each cell labelled."""
    frame = report.frame()
    title = f"Quantisation SNR of each GEMM operand · {report.label}"
    if frame.empty:
        return empty_figure(title, "no Linear layer could be measured in these formats")
    frame = frame.assign(column=frame["format"] + " · " + frame["operand"])
    layers = list(dict.fromkeys(frame["layer"]))
    columns = list(dict.fromkeys(frame["column"]))
    table = frame.pivot_table(index="layer", columns="column", values="snr_db", aggfunc="min").reindex(
        index=layers, columns=columns)
    finite = table.clip(upper=60.0)  # an exactly represented operand (inf dB) draws as the top of the scale
    text = [[_cell(v, "snr_db") if not pd.isna(v) else "" for v in row] for row in table.to_numpy()]
    heatmap = {"type": "heatmap", "x": columns, "y": layers, "z": finite.to_numpy().tolist(), "text": text,
               "texttemplate": "%{text}", "colorscale": "RdYlGn", "zmin": 0, "zmax": 40, "xgap": 1, "ygap": 1,
               "colorbar": {"title": {"text": "SNR dB"}},
               "hovertemplate": "%{y} · %{x}: %{text} dB<extra></extra>"}
    layout = chart_layout(f"{title}<br><sup>red: little signal left beside each block's largest value</sup>", "",
                          height=max(280, 120 + 26 * len(layers)), hovermode="closest",
                          margin={"l": 140, "r": 20, "t": 70, "b": 80},
                          yaxis={"autorange": "reversed", "automargin": True, "type": "category"},
                          xaxis={"title": {"text": "format · operand"}, "type": "category"})
    return go.Figure({"data": [heatmap], "layout": layout})


# --- over sampled steps ---------------------------------------------------------------------------------------------

SAMPLE_COLUMNS = ["lane", "step", "order", *ROW_FIELDS]
LOWEST = "lowest"
"""The operand choice that draws each layer's lowest SNR over its three operands."""


def block_samples(events: pd.DataFrame) -> pd.DataFrame:
    """A run's block_sample events as one row per lane, step, layer, operand and format (order: the layer's place
    in the step's forward order); snr_db is inf where every value beside its block's largest quantised exactly."""
    if events.empty:
        return pd.DataFrame(columns=SAMPLE_COLUMNS)
    rows = []
    for event in events[events["kind"] == BLOCK_SAMPLE_EVENT].itertuples():
        order: dict[str, int] = {}
        for row in event.data.get("rows", []):
            values = dict(zip(ROW_FIELDS, row, strict=True))
            values["snr_db"] = math.inf if values["snr_db"] == "inf" else float(values["snr_db"])
            rows.append({"lane": int(event.lane), "step": int(event.step),
                         "order": order.setdefault(values["layer"], len(order)), **values})
    return pd.DataFrame(rows, columns=SAMPLE_COLUMNS)


def latest_verdicts(events: pd.DataFrame, lane: int) -> tuple[int | None, list[str]]:
    """(step, the verdict lines) of a lane's latest block_sample event: the first layer below the threshold in
    each format, and why."""
    if events.empty:
        return None, []
    picked = events[(events["kind"] == BLOCK_SAMPLE_EVENT) & (events["lane"] == lane)]
    if picked.empty:
        return None, []
    latest = picked.sort_values("step").iloc[-1]
    return int(latest["step"]), list(latest["data"].get("verdicts", {}).values())


def snr_over_steps(samples: pd.DataFrame, lane: int, mode: str, format_name: str,
                   operand: str = LOWEST) -> go.Figure:
    """Layers (forward order, top to bottom) x sampled steps: the quantisation SNR in dB of one operand (or each
    layer's lowest over its operands) in `format_name`, red where it is low; a layer losing signal step after step
    shows as a row reddening to the right."""
    which = "lowest operand" if operand == LOWEST else operand
    title = f"Quantisation SNR over steps · {format_name} · {which} · {mode}"
    picked = samples[(samples["lane"] == lane) & (samples["format"] == format_name)]
    if operand != LOWEST:
        picked = picked[picked["operand"] == operand]
    if picked.empty:
        return empty_figure(title, "this lane has no block-scaled samples in this format yet")
    layers = picked.sort_values(["step", "order"]).drop_duplicates("layer")["layer"].tolist()
    grid = picked.pivot_table(index="layer", columns="step", values="snr_db", aggfunc="min").reindex(layers)
    steps = [int(s) for s in grid.columns]
    table = grid.to_numpy(dtype=float)
    text = [[_cell(v, "snr_db") if not math.isnan(v) else "not sampled" for v in row] for row in table]
    shown = [[None if math.isnan(v) else min(v, 60.0) for v in row] for row in table]
    heatmap = {"type": "heatmap", "x": steps, "y": layers, "z": shown, "text": text, "colorscale": "RdYlGn",
               "zmin": 0, "zmax": 40, "xgap": 1, "ygap": 1, "colorbar": {"title": {"text": "SNR dB"}},
               "hovertemplate": "%{y} · step %{x}: %{text} dB<extra></extra>"}
    if len(steps) <= 12 and len(layers) <= 24:
        heatmap["texttemplate"] = "%{text}"
    layout = chart_layout(f"{title}<br><sup>red: little signal left beside each block's largest value</sup>", "",
                          height=max(280, 120 + 26 * len(layers)), hovermode="closest",
                          margin={"l": 140, "r": 20, "t": 70, "b": 45},
                          yaxis={"autorange": "reversed", "automargin": True, "type": "category"},
                          xaxis={"title": {"text": "step"}, "type": "category" if len(steps) < 30 else "linear"})
    return go.Figure({"data": [heatmap], "layout": layout})


def latest_table(samples: pd.DataFrame, lane: int) -> pd.DataFrame:
    """A lane's latest sample as the per-operand table (short headers), in forward order."""
    picked = samples[samples["lane"] == lane]
    if picked.empty:
        return pd.DataFrame(columns=list(COLUMNS.values()))
    latest = picked[picked["step"] == picked["step"].max()].sort_values("order", kind="stable")
    return latest[list(COLUMNS)].rename(columns=COLUMNS).reset_index(drop=True)
