"""The Train page's live board as data: what a live run's board shows for one set of chart choices (its charts as
specs, its lanes table JSON-ready, the signal the page around it reruns on), rendered once per tick by
amp_core.views.live_feed and drawn by pages/live_chart.py's component; and the lanes table a still page draws."""

from __future__ import annotations

import pandas as pd

from amp_core.probes import SpikeRule
from amp_core.views import plots
from amp_core.views.chart_feed import figure_spec
from amp_core.views.live import LANE_COLUMNS, baseline_mode, lane_headers, lanes_table
from amp_core.views.shared import LiveFrame

BOARD_CHARTS = ("loss", "step_time", "scale", "memory", "lr", "ranks")
"""The live board's charts in its order, two columns (left, right, left, ...): the places the still page gives them."""
NUMBER_COLUMNS = frozenset({"steps", "loss now", "ms/step", "speed", "memory", "skipped", "scale"})
"""The lanes table's columns the board right-aligns."""


def lane_table(frame: LiveFrame) -> tuple[pd.DataFrame, dict[str, str], dict[str, int], str]:
    """Every headline figure of every lane, whole, in one narrow table (a column per figure, a row per lane): (the
    table, its headers, its text columns' widths, a caption naming the baseline where the headers do not)."""
    table = lanes_table(frame.info, frame.series)
    if len(table) == 1:  # one lane (a Monitor's run): nothing to compare with
        table = table.drop(columns=["speed", "memory"])
    labels, widths, against = lane_headers(table, baseline_mode(frame.series))
    return table, labels, widths, against


def board_table(frame: LiveFrame) -> dict:
    """The lanes table for the live board, JSON-ready: {columns: [{name, label, help, kind}], rows, caption}."""
    table, labels, _, against = lane_table(frame)
    kinds = {column: "progress" if column == "progress" else "number" if column in NUMBER_COLUMNS else "text"
             for column in table.columns}
    columns = [{"name": column, "label": labels.get(column, column), "help": LANE_COLUMNS[column],
                "kind": kinds[column]} for column in table.columns]
    rows = [[None if pd.isna(value) else value for value in row] for row in table.itertuples(index=False)]
    return {"columns": columns, "rows": rows, "caption": against}


def board_view(frame: LiveFrame, axis: str, smoothing: float, raw: bool, spike_rule: SpikeRule,
               seeds: dict[str, int]) -> dict:
    """A live run's board for one set of choices (LiveFeeds' render): its charts as specs (plots.ChartSpec: no plotly
    Figure built each tick), its lanes table, and its signal: what the page around it draws (status, lanes' states,
    which charts, a constant LR), so that the page reruns when, and only when, that changes."""
    with plots.specs_only():
        figures = plots.train_figures(frame.series, loss_axis=axis, smoothing=smoothing, raw_step_times=raw,
                                      bands=frame.bands, seeds=seeds, spikes=spike_rule)
    lr = plots.constant_lr(frame.series)
    names = [name for name in BOARD_CHARTS if name in figures and (name != "lr" or lr is None)]
    info = frame.info
    signal = [info.status, info.controllable, [lane.status for lane in info.lanes], [str(p) for p in info.problems],
              names, None if lr is None else f"{lr:.3g}"]
    return {"charts": {name: figure_spec(figures[name]) for name in names}, "table": board_table(frame),
            "signal": signal}
