"""Long runs: what the records cost in memory and on disk, what a flush costs the run, and how fast the Train page
opens and redraws a long run, lists runs.

1. A real run, 3 lanes x 100,000 steps (`mlp_regression`, in this process, writing to a fresh store):
   - write_overhead: runner steps/s with the store / without it. The store's whole cost is the writer's encoding and
     writing in each flush (a run without a store does everything else alike), timed by the sink itself
     (`RecordSink.write_seconds`), so the figure is 1 - that time / the run's time, both of the same 100,000-step
     run. Side-by-side rounds of shorter runs with and without a store (alternating) are printed too, by wall clock
     and by CPU time: on a shared machine other programs swing those by several percent either way;
   - ram_bytes_per_step: RSS growth over the run / records held (after a warm-up run, so torch's own start-up
     allocations are not counted); store_bytes_per_step: the store file (WAL checkpointed) / records;
   - open_ms: the first view of the stored run as the Train page builds it (a new follower on a new manager: run
     info, every lane read through the summary, the headline summary, all five Train figures, each figure turned
     into JSON as st.plotly_chart does); redraw_ms: one live refresh of the run while this process holds it.
2. first_view_ms: the same first view of a stored 4 lanes x 20,000 steps run (synthetic records, like the old
   bench/render.py: noise, spikes, 16-mixed skipped steps and scale back-offs).
3. open_1m_ms: the same first view of a stored 4 lanes x 1,000,000 steps run (synthetic, written by a RecordSink in
   flush-sized pieces as a writer would).
4. list_runs_ms: RunManager.list_runs over a store holding 200 runs.

Medians of repeated rounds. Each figure on its own line `name=value`; the last line counts the targets met
(`scale_targets_met=K/N`: open_ms <= 150, redraw_ms <= 50, ram_bytes_per_step <= 200, store_bytes_per_step <= 100,
write_overhead >= 0.98, first_view_ms <= 100, open_1m_ms <= 300, list_runs_ms <= 50).

With `--store postgresql://user@host:port/db` every store is a fresh database on that server instead of a SQLite
file (the URL's role must be allowed to create databases; they are dropped at the end).

    python3 -m bench.scale [--steps 100000] [--rounds 6] [--skip-real] [--store URL]   (from the repository root)
"""

from __future__ import annotations

import argparse
import gc
import sqlite3
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import plotly.io as pio
import psutil
from plotly.tools import return_figure_from_figure_or_data

from amp_core.config import RunConfig
from amp_core.race.runner import Run, RunManager
from amp_core.records.opening import open_store
from amp_core.records.schema import STEP_COLUMNS
from amp_core.records.sink import RecordSink
from amp_core.records.store import RunStore, is_postgres_url
from amp_core.views import plots
from amp_core.views.live import RecordFollower
from amp_core.views.summary import lanes, summarize

REAL_MODES = ("32-true", "bf16-mixed", "16-mixed")
SYNTHETIC_MODES = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
FLUSH_RECORDS = 2000
"""Records per lane per flush for synthetic runs (what a fast runner gathers in 0.5 s)."""


TARGETS = {"open_ms": (False, 150, 1), "redraw_ms": (False, 50, 1), "ram_bytes_per_step": (False, 200, 1),
           "store_bytes_per_step": (False, 100, 1), "write_overhead": (True, 0.98, 3),
           "first_view_ms": (False, 100, 1), "open_1m_ms": (False, 300, 1), "list_runs_ms": (False, 50, 1)}
"""Each figure's target: (at least rather than at most, the bound, digits printed)."""


def page_view(manager: RunManager, follower: RecordFollower, run_id: str) -> int:
    """What one run of the Train page's live view does on the server; returns the points drawn."""
    manager.run_info(run_id)
    series = lanes(follower.update(manager))
    manager.run_info(run_id)
    summarize(series)
    figures = plots.train_figures(series, smoothing=0.6, bands=follower.bands)  # as the Train page draws
    specs = [pio.to_json(return_figure_from_figure_or_data(figure, True), validate=False)
             for figure in figures.values()]
    assert all(specs)
    return sum(len(trace.x) for figure in figures.values() for trace in figure.data if trace.x is not None)


def timed_ms(action, repeats: int, label: str) -> float:
    """Median wall ms of `action` over `repeats` rounds (after one warm-up); the CPU ms is printed beside it (on a
    shared machine wall time swings with other programs' load, CPU time much less)."""
    action()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        action()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    print(f"{label}: median wall {statistics.median(wall):.1f} ms, CPU {statistics.median(cpu):.1f} ms "
          f"(wall min {min(wall):.1f}, max {max(wall):.1f})")
    return statistics.median(wall)


class Targets:
    """Where the bench's stores go: SQLite files in a folder, or fresh databases on a PostgreSQL server."""

    def __init__(self, folder: Path, server: str | None):
        self.folder, self.server, self.made = folder, server, []

    def __call__(self, name: str) -> Path | str:
        if not self.server:
            return self.folder / f"{name}.sqlite3"
        import psycopg

        database = f"bench_{name}_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(self.server, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {database}")
        self.made.append(database)
        return f"{self.server.rsplit('/', 1)[0]}/{database}"  # a password comes from PGPASSWORD or ~/.pgpass

    def drop_all(self) -> None:
        if not self.made:
            return
        import psycopg

        with psycopg.connect(self.server, autocommit=True) as conn:
            for database in self.made:
                conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


def first_view_ms(path: Path, run_id: str, repeats: int, label: str) -> float:
    """Median first view: each round a new manager and follower (nothing cached but the OS's file cache)."""
    def view() -> int:
        return page_view(RunManager(open_store(path)), RecordFollower(run_id), run_id)

    return timed_ms(view, repeats, f"{label} first view ({view()} points drawn)")


def store_bytes(path: Path | str) -> int:
    if is_postgres_url(path):
        import psycopg

        with psycopg.connect(str(path)) as conn:
            return conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def synthetic_columns(lane: int, mode: str, start: int, count: int, rng: np.random.Generator,
                      total: int) -> dict[str, np.ndarray]:
    """Records as a runner would write them: noisy decaying loss with rare spikes, jittery step times with stalls,
    16-mixed skipping about one step in 500 (inf gradient norm, scale halved, regrowing every 2,000 steps)."""
    steps = np.arange(start, start + count)
    loss = 2.0 * np.exp(-steps / (total / 4)) + 0.05 * rng.random(count)
    loss[rng.random(count) < 1e-4] *= 20
    step_ms = 1.0 + 0.3 * lane + rng.exponential(0.05, count)
    step_ms[rng.random(count) < 1e-3] += 30.0
    scaled = mode == "16-mixed"
    skipped = (rng.random(count) < 0.002) if scaled else np.zeros(count, dtype=bool)
    scale = 2.0 ** (16 - (steps // 997) % 5) if scaled else np.full(count, np.nan)
    grad_norm = rng.random(count) + 0.5
    grad_norm[skipped] = np.inf
    return {"step": steps, "t_wall_s": 1.7e9 + steps * 4e-3 + lane * 1e-3, "loss": loss, "step_ms": step_ms,
            "samples_per_s": 64e3 / step_ms, "lr": np.full(count, 1e-3), "scale": scale, "skipped": skipped,
            "grad_norm": grad_norm, "params_bytes": np.full(count, 40_000), "grads_bytes": np.full(count, 40_000),
            "optim_bytes": np.full(count, 80_000), "activations_bytes": 120_000 + (steps // 50) % 3 * 1000,
            "peak_above_start_bytes": np.full(count, np.nan),
            "lane_peak_bytes": 280_000 + (steps // 50) % 3 * 1000.0, "probe_ms": np.zeros(count, dtype=np.float32)}


def write_synthetic(path: Path, run_id: str, steps: int, modes=SYNTHETIC_MODES) -> None:
    store = open_store(path)
    sink = RecordSink(run_id, store)
    sink.open(RunConfig(workload="digits_mlp", modes=modes, steps=steps, device="cpu").to_dict(), "cpu", "bench")
    rng = np.random.default_rng(0)
    for start in range(0, steps, FLUSH_RECORDS):
        count = min(FLUSH_RECORDS, steps - start)
        for lane, mode in enumerate(modes):
            sink.extend_steps(lane, mode, synthetic_columns(lane, mode, start, count, rng, steps))
        sink.flush()
    sink.close("finished", [(lane, "finished", "") for lane in range(len(modes))])


def real_config(steps: int) -> RunConfig:
    return RunConfig(workload="mlp_regression", modes=REAL_MODES, steps=steps, device="cpu")


def lane_steps_per_s(store: RunStore | None, steps: int) -> tuple[float, float]:
    """(lane-steps per wall second, lane-steps per CPU second of this process) of one run. The run thread does all
    the work (steps, flushes, SQLite); the main thread only waits, so CPU seconds are the run's own, and much less
    swayed than wall seconds by other programs on a shared machine."""
    cpu = psutil.Process().cpu_times()
    run = Run(real_config(steps), store).start()
    run.join()
    after = psutil.Process().cpu_times()
    assert run.status == "finished", run.status
    frame = run.frame()
    wall = frame["t_wall_s"].max() - frame["t_wall_s"].min()
    return len(frame) / wall, len(frame) / (after.user + after.system - cpu.user - cpu.system)


def write_overhead(target: Targets, rounds: int, steps: int) -> None:
    """Print steps/s with the store / without it, by CPU time and by wall time; rounds alternate which goes first."""
    store = open_store(target("overhead"))
    with_store, without = [], []
    for i in range(rounds):
        pair = [(with_store, store), (without, None)]
        for out, target in pair if i % 2 == 0 else pair[::-1]:
            out.append(lane_steps_per_s(target, steps))
    wall = statistics.median(w for w, _ in with_store) / statistics.median(w for w, _ in without)
    cpu = statistics.median(c for _, c in with_store) / statistics.median(c for _, c in without)
    print(f"write_overhead rounds ({steps} steps x {len(REAL_MODES)} lanes): lane-steps per wall s with the store "
          f"{[round(w) for w, _ in with_store]}, without {[round(w) for w, _ in without]}; per CPU s with "
          f"{[round(c) for _, c in with_store]}, without {[round(c) for _, c in without]}")
    print(f"side by side: with / without the store {wall:.3f} by wall clock, {cpu:.3f} by CPU time")


def real_run(target: Targets, steps: int, rounds: int, repeats: int) -> dict[str, float]:
    write_overhead(target, rounds, max(2000, steps // 20))
    figures = {}
    path = target("real")
    manager = RunManager(open_store(path))
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    run = manager.launch(real_config(steps))
    run.join()
    run_s = time.perf_counter() - started
    figures["write_overhead"] = 1 - run.sink.write_seconds / run_s
    print(f"real run: {run_s:.1f} s, of which the store's encoding and writing {run.sink.write_seconds:.3f} s "
          f"({run.sink.write_seconds / run_s:.2%})")
    gc.collect()
    rss_after = psutil.Process().memory_info().rss
    records = len(run.sink.records)
    held = sum(track.nbytes() for track in run.sink.records.tracks())
    print(f"real run: {records} records, {len(REAL_MODES)} lanes, status {run.status}; "
          f"RSS +{rss_after - rss_before:,} B; record arrays allocated {held:,} B ({held / records:.1f} B/record)")
    figures["ram_bytes_per_step"] = (rss_after - rss_before) / records
    figures["store_bytes_per_step"] = store_bytes(path) / records
    follower = RecordFollower(run.run_id)
    figures["redraw_ms"] = timed_ms(lambda: page_view(manager, follower, run.run_id), repeats,
                                    "3 x 100,000 live redraw (the run held in this process)")
    figures["open_ms"] = first_view_ms(path, run.run_id, repeats, "3 x 100,000 stored")
    return figures


def many_runs_ms(target: Targets, runs: int, repeats: int) -> float:
    path = target("many")
    for i in range(runs):
        write_synthetic(path, f"run-{i:03d}", 500, modes=SYNTHETIC_MODES[:2])
    manager = RunManager(open_store(path))
    assert len(manager.list_runs()) == runs
    return timed_ms(manager.list_runs, repeats, f"list_runs over {runs} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000, help="steps of the real 3-lane run")
    parser.add_argument("--rounds", type=int, default=6, help="with/without-store rounds for write_overhead")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-real", action="store_true", help="only the synthetic figures (quick)")
    parser.add_argument("--store", default=None, metavar="URL",
                        help="a PostgreSQL server (postgresql://user@host:port/db): the stores are fresh databases "
                             "there, not SQLite files")
    args = parser.parse_args()
    assert set(STEP_COLUMNS) >= {"loss", "step_ms", "scale", "skipped"}
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        target = Targets(Path(tmp), args.store)
        print(f"stores: {'fresh databases on ' + open_store(args.store).location if args.store else 'SQLite files'}")
        try:
            if not args.skip_real:
                figures.update(real_run(target, args.steps, args.rounds, args.repeats))
            small = target("20k")
            write_synthetic(small, "bench-20k", 20_000)
            figures["first_view_ms"] = first_view_ms(small, "bench-20k", args.repeats, "4 x 20,000")
            start = time.perf_counter()
            big = target("1m")
            write_synthetic(big, "bench-1m", 1_000_000)
            print(f"4 x 1,000,000 synthetic records written in {time.perf_counter() - start:.1f} s; store "
                  f"{store_bytes(big) / 4e6:.1f} B/record")
            figures["open_1m_ms"] = first_view_ms(big, "bench-1m", args.repeats, "4 x 1,000,000")
            figures["list_runs_ms"] = many_runs_ms(target, 200, args.repeats)
        finally:
            target.drop_all()
    for name, (_, _, digits) in TARGETS.items():
        if name in figures:
            print(f"{name}={figures[name]:.{digits}f}")
    met = [name for name, (above, bound, _) in TARGETS.items()
           if name in figures and (figures[name] >= bound if above else figures[name] <= bound)]
    print(f"scale_targets_met={len(met)}/{len([name for name in TARGETS if name in figures])}")


if __name__ == "__main__":
    main()
