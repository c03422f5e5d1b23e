"""Server-side cost of the Train page's charts for a long run: 4 lanes x 20,000 steps from the store.

Writes one synthetic run (records in the runner's layout, 16-mixed with skipped steps and scale back-offs) to a
temporary store, then times the page's live view the way it works: a RecordFollower reads the run's records from
the store, the lanes are split once, the headline figures and the five Plotly figures are built (decimated to
about 2,000 points a trace), and each figure is turned into JSON as st.plotly_chart does.

- first view: a new follower, so all 80,000 records are read from the store (once per run per browser session);
- redraw: the follower already holds them and asks the store only for what is new (every refresh after that).

Medians of repeated rounds. Last line: render_ms=<median redraw>. Target: <= 100.

    python3 -m bench.render [--steps 20000] [--repeats 9]   (from the repository root)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import plotly.io as pio
from plotly.tools import return_figure_from_figure_or_data

from amp_core.config import RunConfig
from amp_core.records import STEP_FIELDS
from amp_core.records.store import RunStore
from amp_core.runner import RunManager
from amp_core.views import plots
from amp_core.views.live import RecordFollower
from amp_core.views.summary import lanes, summarize

MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def synthetic_rows(run_id: str, steps: int, seed: int = 0) -> list[tuple]:
    """Records as the runner writes them (lanes interleaved per step), with noise, spikes and skipped steps."""
    rng = np.random.default_rng(seed)
    rows = []
    step_index = np.arange(steps)
    for lane, mode in enumerate(MODES):
        loss = 2.0 * np.exp(-step_index / (steps / 4)) + 0.05 * rng.random(steps)
        step_ms = 1.0 + 0.3 * lane + rng.exponential(0.05, steps)
        skipped = (rng.random(steps) < 0.002) if mode == "16-mixed" else np.zeros(steps, dtype=bool)
        scale = 2.0 ** (16 - np.cumsum(skipped) + step_index // 2000) if mode == "16-mixed" else None
        for step in range(steps):
            rows.append((step, lane, (
                run_id, lane, mode, step, 1.7e9 + step * 0.01, float(loss[step]), float(step_ms[step]),
                64e3 / step_ms[step], 1e-3, float(scale[step]) if scale is not None else None, bool(skipped[step]),
                1.0, 40_000, 40_000, 80_000, 120_000, None)))
    rows.sort(key=lambda row: (row[0], row[1]))
    return [row for _, _, row in rows]


def redraw(manager: RunManager, follower: RecordFollower) -> tuple[float, float, float, int]:
    """What one refresh of the live view pays: (read_ms, build_ms, json_ms, points drawn)."""
    t0 = time.perf_counter()
    frame = follower.update(manager)
    t1 = time.perf_counter()
    series = lanes(frame)
    summarize(series)
    figures = plots.train_figures(series, smoothing=0.6)
    t2 = time.perf_counter()
    # What st.plotly_chart does with a figure on the server.
    specs = [pio.to_json(return_figure_from_figure_or_data(figure, True), validate=False)
             for figure in figures.values()]
    t3 = time.perf_counter()
    points = sum(len(trace.x) for figure in figures.values() for trace in figure.data if trace.x is not None)
    assert all(specs) and len(frame) == len(MODES) * len(frame[frame["lane"] == 0])
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, points


def medians(rounds: list[tuple[float, float, float, int]]) -> tuple[float, ...]:
    """Per-column medians, plus the median of the per-round totals (read + build + json)."""
    columns = [statistics.median(column) for column in zip(*rounds, strict=True)]
    return (*columns, statistics.median(sum(r[:3]) for r in rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        store = RunStore(Path(folder) / "bench.sqlite3")
        run_id = "bench-render"
        config = RunConfig(workload="digits_mlp", modes=MODES, steps=args.steps, device="cpu")
        store.create_run(run_id, config.to_dict(), "cpu", "bench")
        rows = synthetic_rows(run_id, args.steps)
        assert len(rows[0]) == len(STEP_FIELDS)
        store.write_batch(rows)
        manager = RunManager(store)
        redraw(manager, RecordFollower(run_id))  # warm-up: first imports and the sqlite page cache
        first = [redraw(manager, RecordFollower(run_id)) for _ in range(args.repeats)]
        follower = RecordFollower(run_id)
        redraw(manager, follower)
        again = [redraw(manager, follower) for _ in range(args.repeats)]
    print(f"lanes={len(MODES)} steps={args.steps} records={len(rows)} points_drawn={first[0][3]}")
    for name, rounds in (("first_view", first), ("redraw", again)):
        read_ms, build_ms, json_ms, _, total = medians(rounds)
        print(f"{name}: read_ms={read_ms:.1f} build_ms={build_ms:.1f} json_ms={json_ms:.1f} total_ms={total:.1f}")
    print(f"first_view_ms={medians(first)[-1]:.1f}")
    print(f"render_ms={medians(again)[-1]:.1f}")


if __name__ == "__main__":
    main()
