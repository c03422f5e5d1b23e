"""A run as one self-contained HTML file to share: every chart, the summary, the configuration and the events.

The file opens offline: plotly.js is inlined once for the whole file (not once per chart), and each chart's figure
is a JSON block the one script at the end draws; nothing is fetched from the network. Every string that comes from
a user or a run (a run's name, a lane's error, an event's message, the configuration) is HTML-escaped, and the
figures' JSON escapes `<`, `>` and `/` (plotly's encoder), so no text can close a tag or open a script.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd
import plotly.io as pio
from plotly.offline import get_plotlyjs

from amp_core.config import FINAL_LOSS_WINDOW
from amp_core.views import compare, compiled, plots
from amp_core.views.live import what_ran_warnings
from amp_core.views.summary import (
    DIFFERENCE_RULE,
    difference_sentences,
    has_replicates,
    lane_key,
    lane_seeds,
    replicate_differences,
    replicate_table,
    summarize,
)

if TYPE_CHECKING:
    from amp_core.records.store import RunStore
    from amp_core.runs import LaneInfo, RunInfo, RunReader

LAST_K = FINAL_LOSS_WINDOW
"""The final-loss window of the report's summary (the Compare page's default)."""
MAX_EVENTS = 2000
"""Events listed at most (a long run sampling layer amax has one per lane every few steps); the rest are counted."""
STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #222; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.5rem 0; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } .meta { color: #555; } .note { color: #555; font-size: 0.85rem; }
.chart { width: 100%; min-height: 340px; margin: 0.5rem 0 1.5rem; }
pre { background: #f7f7f7; padding: 0.75rem; overflow-x: auto; font-size: 0.8rem; }
.warning { background: #fff4e5; border-left: 4px solid #f0a030; padding: 0.5rem 0.75rem; }
"""
DRAW_SCRIPT = """
document.querySelectorAll('script[type="application/json"].figure').forEach(function (block) {
  var figure = JSON.parse(block.textContent);
  Plotly.newPlot(block.dataset.target, figure.data, figure.layout, {responsive: true, displaylogo: false});
});
"""


def _reader(source: RunReader | RunStore) -> RunReader:
    from amp_core.records.store import RunStore
    from amp_core.runs import RunReader

    return RunReader(source) if isinstance(source, RunStore) else source


def lane_labels(run_id: str, lanes_info: Sequence[LaneInfo]) -> dict[str, str]:
    """Lane key -> "mode", or "mode · seed N" in a run with several lanes of one mode (seed replicates); the FSDP2
    policy after the mode of a sharded lane (compare.lane_name)."""
    replicated = len({lane.mode for lane in lanes_info}) < len(lanes_info)
    return {lane_key(run_id, lane.lane): compare.lane_name(lane, replicated) for lane in lanes_info}


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, escape=True, border=0, na_rep="—")


def _figure_block(index: int, figure) -> str:
    """A chart's place and its figure as a JSON block (drawn by DRAW_SCRIPT)."""
    target = f"chart-{index}"
    payload = pio.to_json(figure, validate=False)  # escapes <, > and /: the JSON cannot end its script block
    return (f'<div class="chart" id="{target}"></div>\n'
            f'<script type="application/json" class="figure" data-target="{target}">{payload}</script>')


def report_figures(reader: RunReader, run_id: str, info: RunInfo) -> list:
    """The report's charts, in order: the Train page's (loss, step time, memory, scale, LR, ranks when a job had
    several), loss against time at median speed, and loss minus the baseline's when there are several lanes."""
    series = reader.lane_series(run_id)
    if not series:
        return []
    seeds = lane_seeds(run_id, info.lanes)
    labels = lane_labels(run_id, info.lanes)
    bands = plots.StepTimeBands()
    train = plots.train_figures(series, bands=bands, seeds=seeds)
    figures = [train[name] for name in ("loss", "step_time", "memory", "scale", "lr", "ranks") if name in train]
    figures.append(compare.loss_vs_time_figure(series, labels, bands=bands, seeds=seeds))
    if len({lane.key for lane in series}) > 1:
        baseline = summarize(series).query("is_baseline")
        key = lane_key(run_id, int(baseline["lane"].iloc[0]))
        figures.append(compare.loss_difference_figure(series, key, labels))
    return figures


def _events_section(events: pd.DataFrame, labels: dict[str, str], run_id: str) -> str:
    if events.empty:
        return "<p>No events.</p>"
    shown = events.head(MAX_EVENTS)

    def lane_name(lane) -> str:
        return "run" if lane is None or pd.isna(lane) else labels.get(lane_key(run_id, int(lane)), str(lane))

    frame = pd.DataFrame({
        "step": ["" if step is None or pd.isna(step) else str(int(step)) for step in shown["step"]],
        "lane": [lane_name(lane) for lane in shown["lane"]],
        "kind": shown["kind"].astype(str).tolist(),
        "message": shown["message"].astype(str).tolist(),
    })
    left = len(events) - len(shown)
    more = f'<p class="note">{left:,} more events left out.</p>' if left > 0 else ""
    return _table(frame) + more


def _compiled_section(reader: RunReader, run_id: str, labels: dict[str, str]) -> list[str]:
    """The compiled lanes' compile figures and drift against eager (nothing when no lane compiles)."""
    compiles, drift, drift_table = compiled.compiled_view(reader, [run_id])
    if compiles.empty:
        return []
    parts = ["<h2>Compiled lanes</h2>", _table(compiles.drop(columns="run_id")),
             f'<p class="note">{html.escape(compiled.COMPILE_NOTE)}</p>']
    if not drift_table.empty:
        parts += [_table(drift_table.drop(columns="run_id")), _figure_block(900, compiled.drift_figure(drift, labels)),
                  f'<p class="note">{html.escape(compiled.DRIFT_NOTE)}</p>']
    return parts


def run_report_html(source: RunReader | RunStore, run_id: str) -> str:
    """Run `run_id` as one self-contained HTML page (see the module's docstring); ValueError if the run is unknown."""
    reader = _reader(source)
    info = reader.run_info(run_id)
    if info is None:
        raise ValueError(f"no run {run_id!r}")
    settings = info.settings
    labels = lane_labels(run_id, info.lanes)
    series = reader.lane_series(run_id)
    esc = html.escape
    name = settings.name or run_id
    parts = [f"<h1>AMP Lab report · {esc(str(name))}</h1>",
             f'<p class="meta">run <code>{esc(run_id)}</code> · {esc(str(settings.workload))} · modes '
             f'{esc(", ".join(map(str, settings.modes)))}'
             + (f" · {int(settings.seeds)} seeds per mode" if int(settings.seeds) > 1 else "")
             + f" · status <b>{esc(info.status)}</b> · report written "
               f"{esc(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}</p>"]
    for problem in info.problems:
        parts.append(f'<p class="warning">{esc(str(problem))}</p>')
    events = reader.events(run_id)
    for message in what_ran_warnings(events):
        parts.append(f'<p class="warning">{esc(message)}</p>')
    for lane in info.lanes:
        if lane.status in ("failed", "diverged", "interrupted"):
            label = labels.get(lane_key(run_id, lane.lane), lane.mode)
            parts.append(f'<p class="warning">Lane <b>{esc(label)}</b> {esc(lane.status)}'
                         + (f": {esc(lane.error)}" if lane.error else "") + "</p>")

    parts.append("<h2>Summary</h2>")
    if series:
        summary = summarize(series, last_k=LAST_K)
        baseline = lane_key(run_id, int(summary.loc[summary["is_baseline"], "lane"].iloc[0]))
        parts.append(_table(compare.format_summary(summary, labels, baseline, LAST_K)))
        parts.append(f'<p class="note">★ baseline. Speedup = baseline median ms/step ÷ the lane\'s (above 1× is '
                     f'faster). Final loss: mean of the last {LAST_K} steps\' losses (inf/NaN left out); latest loss: '
                     f'the last step\'s.</p>')
        seeds = lane_seeds(run_id, info.lanes)
        if has_replicates(series, seeds):
            replicates = replicate_table(series, seeds, LAST_K)
            parts.append("<h3>Across seeds</h3>" + _table(compare.format_replicates(replicates, LAST_K)))
            items = "".join(f"<li>{esc(sentence).replace('**', '')}</li>"
                            for sentence in difference_sentences(replicate_differences(replicates)))
            parts.append(f"<ul>{items}</ul><p class=\"note\">Mean ± sample standard deviation across seeds; "
                         f"{esc(DIFFERENCE_RULE)}. Charts: each mode's mean across seeds inside the band from the "
                         f"lowest to the highest seed.</p>")
    else:
        parts.append("<p>No steps recorded.</p>")

    parts += _compiled_section(reader, run_id, labels)
    figures = report_figures(reader, run_id, info)
    parts.append("<h2>Charts</h2>")
    parts += [_figure_block(i, figure) for i, figure in enumerate(figures)] or ["<p>No steps to chart.</p>"]
    parts.append("<h2>Events</h2>" + _events_section(events, labels, run_id))
    saved = json.dumps(info.config, indent=2, sort_keys=True, default=str)  # as the writer saved it, every key
    parts.append(f"<h2>Configuration</h2><pre>{esc(saved)}</pre>")

    title = esc(f"AMP Lab report · {name}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{title}</title><style>{STYLE}</style>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n<body>\n"
            + "\n".join(parts)
            + f"\n<script type=\"text/javascript\">{DRAW_SCRIPT}</script>\n</body></html>\n")
