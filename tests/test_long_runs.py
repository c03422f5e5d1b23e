"""Long runs: columnar records, the multi-resolution summary (exact against a brute-force pass), the chunked store
(real SQLite) read while other processes write it, migration of a schema-1 store, damaged chunks, newer stores, and
liveness of writers (real subprocesses: kill -9, another pid namespace, a reused pid)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
from cli_process import is_url, start_cli_run, store_sql, stored_steps, wait_for_stored_steps
from streamlit.testing.v1 import AppTest

from amp_core.cli import main
from amp_core.config import RunConfig
from amp_core.race.runner import Run, RunManager
from amp_core.records import STEP_COLUMNS, StepRecord
from amp_core.records.chunks import CHUNK_MAX, CHUNK_MIN
from amp_core.records.levels import FIELD_INDEX, FLAG_FIELDS, SUMMARY_FIELDS, level_steps
from amp_core.records.opening import open_store
from amp_core.records.query import MAX_POINTS, aggregate, read_lane
from amp_core.records.sink import RecordSink
from amp_core.records.store import SCHEMA_VERSION, StoreError
from amp_core.records.tracks import TrackRecords, marked
from amp_core.views import compare
from amp_core.views.live import RecordFollower

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=10, device="cpu")


def synthetic(start: int, count: int, seed: int, every: int = 1) -> dict[str, np.ndarray]:
    """Records with everything a summary must not lose: spikes, NaN and inf losses, inf gradient norms on skipped
    steps, a scale that backs off, step-time stalls (steps `every` apart: a Monitor may log every few steps)."""
    rng = np.random.default_rng(seed)
    steps = start + every * np.arange(count)
    loss = (2.0 * np.exp(-steps / 40_000) + 0.05 * rng.random(count)).astype(np.float32)
    loss[rng.random(count) < 0.002] = np.nan
    loss[rng.random(count) < 0.001] = np.inf
    loss[rng.random(count) < 0.001] *= 50
    skipped = rng.random(count) < 0.003
    grad_norm = rng.random(count).astype(np.float32)
    grad_norm[skipped] = np.inf
    step_ms = (1 + rng.exponential(0.1, count)).astype(np.float32)
    step_ms[rng.random(count) < 0.001] += 80
    return {"step": steps, "t_wall_s": 1.7e9 + steps * 1e-3, "loss": loss, "step_ms": step_ms,
            "samples_per_s": (64e3 / step_ms).astype(np.float32), "lr": 1e-3 * (1 + (steps // 5000) % 3),
            "scale": (2.0 ** (16 - (steps // 777) % 4)).astype(np.float32), "skipped": skipped,
            "grad_norm": grad_norm, "params_bytes": np.full(count, 4000), "grads_bytes": np.full(count, 4000),
            "optim_bytes": np.where(steps > 0, 8000, 0), "activations_bytes": 100 * (steps % 7),
            "peak_above_start_bytes": np.where(steps % 2 == 0, np.nan, 2.0**20 + steps),
            "lane_peak_bytes": np.where(steps % 2 == 0, np.nan, 2.0**20 + 16_000 + steps),
            "probe_ms": np.where(steps % 25 == 0, 0.5, 0.0).astype(np.float32)}


def write_run(path: Path, run_id: str, pieces: list[int], seed: int = 0, every: int = 1,
              close: bool = True) -> dict[str, np.ndarray]:
    """A two-lane run written by a RecordSink in flushes of the given sizes; returns lane 1's records."""
    sink = RecordSink(run_id, open_store(path))
    sink.open(CONFIG.to_dict(), "cpu", "test")
    start, written = 0, []
    for i, count in enumerate(pieces):
        for lane, mode in enumerate(CONFIG.modes):
            columns = synthetic(start, count, seed + 31 * i + lane, every)
            sink.extend_steps(lane, mode, columns)
            if lane == 1:
                written.append(columns)
        sink.flush()
        start += count * every
    if close:
        sink.close("finished", [(0, "finished", ""), (1, "finished", "")])
    return {name: np.concatenate([w[name] for w in written]) for name in written[0]}


def brute_force_check(series, raw: dict[str, np.ndarray]) -> None:
    """Every bucket against a pass over the raw records it covers; every marked record present, exactly."""
    in_range = (raw["step"] >= series.start) & (raw["step"] < series.stop)
    steps = raw["step"][in_range]
    if series.raw is not None:
        assert series.raw["step"].tolist() == steps.tolist()
        assert np.array_equal(series.raw["loss"], raw["loss"][in_range], equal_nan=True)
        return
    b = series.buckets
    assert b["count"].sum() == len(steps)
    assert (b["first_step"][1:] > b["last_step"][:-1]).all()
    held = sum(raw[name].astype(float) for name in ("params_bytes", "grads_bytes", "optim_bytes",
                                                    "activations_bytes"))
    for j in range(len(b["id"])):
        rows = np.flatnonzero(in_range & (raw["step"] >= b["first_step"][j]) & (raw["step"] <= b["last_step"][j]))
        assert len(rows) == b["count"][j] and raw["step"][rows[0]] == b["first_step"][j]
        assert raw["step"][rows[-1]] == b["last_step"][j]
        assert b["flags"][j, FLAG_FIELDS.index("skipped")] == raw["skipped"][rows].sum()
        for name in SUMMARY_FIELDS:
            i = FIELD_INDEX[name]
            values = held[rows] if name == "held_bytes" else raw[name][rows].astype(float)
            finite = np.isfinite(values)
            assert b["n"][j, i] == finite.sum()
            assert (math.isnan(b["last"][j, i]) and math.isnan(values[-1])) or b["last"][j, i] == values[-1]
            if finite.any():
                assert b["min"][j, i] == values[finite].min() and b["max"][j, i] == values[finite].max(), name
                assert b["argmin"][j, i] == raw["step"][rows][np.flatnonzero(values == values[finite].min())[0]]
                assert b["argmax"][j, i] == raw["step"][rows][np.flatnonzero(values == values[finite].max())[0]]
                assert b["sum"][j, i] == pytest.approx(values[finite].sum(), rel=1e-9)
            else:
                assert math.isnan(b["min"][j, i]) and b["argmin"][j, i] == -1
    marked = in_range & (raw["skipped"] | ~np.isfinite(raw["loss"]) | ~np.isfinite(raw["grad_norm"]))
    assert series.marks["step"].tolist() == raw["step"][marked].tolist()
    for figure in ("loss", "grad_norm"):  # each chart draws the skipped steps and its figure's non-finite values
        x, y = series.points(figure)
        at = dict(zip(x.tolist(), y.tolist(), strict=True))
        drawn = in_range & (raw["skipped"] | ~np.isfinite(raw[figure]))
        for step, value in zip(raw["step"][drawn].tolist(), raw[figure][drawn].tolist(), strict=True):
            assert step in at and (at[step] == value or (math.isnan(at[step]) and math.isnan(value)))
    assert series.skipped()[0].tolist() == raw["step"][in_range & raw["skipped"]].tolist()


RANGES = [(None, None), (0, 1500), (123, 7000), (4097, 60_001), (33_333, 250_000), (250_000, 251_000)]


@pytest.fixture(scope="module")
def sealed_track() -> tuple[TrackRecords, dict[str, np.ndarray]]:
    """250,001 records appended in bulk, each append sealed as a flush would, and the records themselves: built once
    for every range the in-memory test reads (reading never changes a track)."""
    raw = synthetic(0, 250_001, seed=1)
    track = TrackRecords("r", 0, "16-mixed")
    for at in range(0, 250_001, 30_000):
        track.extend({name: values[at:at + 30_000] for name, values in raw.items()})
        track.seal()
    return track, raw


@pytest.mark.parametrize(("start", "stop"), RANGES)
def test_envelope_is_exact_in_memory(sealed_track, start, stop):
    track, raw = sealed_track
    series = read_lane(track, start, stop, max_points=2000)
    brute_force_check(series, raw)
    assert len(series.points("loss")[0]) <= 2000 + len(series.marks["step"]) + 10


@pytest.fixture(scope="module")
def envelope_runs() -> dict[tuple[bool, int], tuple[Path | str, dict[str, np.ndarray]]]:
    """The run each (PostgreSQL?, steps apart) case of the store test wrote, and its lane 1's records: the first range
    read writes it, the module's other ranges read the same stored records (reading never changes a store)."""
    return {}


@pytest.mark.both_stores
@pytest.mark.parametrize(("start", "stop"), [*RANGES, (1, 2)])
@pytest.mark.parametrize("every", [1, 3])
def test_envelope_is_exact_from_the_store(fresh_store, envelope_runs, start, stop, every):
    """Flushes of every size (small ones coalesced into one chunk, big ones split), steps 1 or 3 apart."""
    key = (is_url(fresh_store), every)
    if key not in envelope_runs:
        pieces = [7, 100, 300, 50, 9000, 2, 20_000, 4000, 1, 30_000, 17_000]
        envelope_runs[key] = (fresh_store, write_run(fresh_store, "r", pieces, every=every))
    written, raw = envelope_runs[key]
    store = open_store(written)
    with store.snapshot():
        (source,) = [s for s in store.track_sources("r") if s.lane == 1]
        series = read_lane(source, start, stop, max_points=2000)
    brute_force_check(series, raw)
    assert series.stats.records == len(raw["step"]) and series.stats.skipped_steps == raw["skipped"].sum()
    assert series.stats.median_step_ms == np.median(raw["step_ms"])
    assert not series.problems
    sizes = [r[0] for r in store_sql(written, "SELECT records FROM chunks WHERE lane = 1 ORDER BY first_step")]
    assert max(sizes) <= CHUNK_MAX and all(size >= CHUNK_MIN for size in sizes[:-1])


def test_aggregate_over_any_range_equals_the_records():
    raw = synthetic(0, 70_000, seed=2)
    track = TrackRecords("r", 0, "16-mixed")
    track.extend(raw)
    track.seal()
    rng = np.random.default_rng(3)
    for _ in range(25):
        start, stop = sorted(rng.integers(0, 70_001, 2).tolist())
        bucket = aggregate(track, start, stop)
        rows = (raw["step"] >= start) & (raw["step"] < stop)
        assert (bucket["count"].sum() if len(bucket["id"]) else 0) == rows.sum()
        if rows.any():
            values = raw["step_ms"][rows].astype(float)
            assert bucket["max"][0, FIELD_INDEX["step_ms"]] == values.max()
            assert bucket["sum"][0, FIELD_INDEX["step_ms"]] == pytest.approx(values.sum(), rel=1e-9)


@pytest.mark.both_stores
def test_a_chart_reads_a_few_thousand_points_of_a_long_run(fresh_store):
    write_run(fresh_store, "r", [100_000] * 3)
    manager = RunManager(open_store(fresh_store))
    series = manager.lane_series("r")
    assert [s.stats.records for s in series] == [300_000, 300_000]
    for lane in series:
        assert lane.bucket_steps == level_steps(3) and len(lane.buckets["id"]) <= MAX_POINTS // 3
    zoomed = manager.lane_series("r", 150_000, 150_000 + MAX_POINTS)  # a range of at most MAX_POINTS: every record
    assert all(s.bucket_steps == 1 and len(s.raw["step"]) == MAX_POINTS for s in zoomed)


def test_in_memory_columns_are_compact():
    track = TrackRecords("r", 0, "16-mixed")
    raw = synthetic(0, 100_000, seed=4)
    for at in range(0, 100_000, 1000):
        track.extend({name: values[at:at + 1000] for name, values in raw.items()})
        track.seal()
    assert track.nbytes() / 100_000 < 130  # ~85 B of columns + ~16 B of summary levels + the last chunk's slack
    compact = {"step": "int64", "t_wall_s": "float64", "loss": "float32", "step_ms": "float32",
               "samples_per_s": "float32", "lr": "float64", "scale": "float32", "skipped": "bool",
               "grad_norm": "float32", "params_bytes": "int64", "lane_peak_bytes": "float64",
               "probe_ms": "float32"}
    assert {name: str(STEP_COLUMNS[name]) for name in compact} == compact
    assert all(dtype.itemsize <= 8 for dtype in STEP_COLUMNS.values())


@pytest.mark.both_stores
def test_records_of_each_rank_are_their_own_track(fresh_store):
    sink = RecordSink("r", open_store(fresh_store))
    sink.open(CONFIG.to_dict(), "cpu", "test")
    for step in range(5):
        for rank in (0, 1):
            sink.step(StepRecord("r", 0, "32-true", step, 1.0 + step, 1.0 + rank, 2.0, 3.0, 1e-3, None, False, 1.0,
                                 1, 1, 1, 1, None, None, 0.0, rank=rank))
    sink.close("finished", [(0, "finished", "")])
    frame = open_store(fresh_store).steps("r")
    assert frame["rank"].tolist() == [0, 1] * 5 and frame.loc[frame["rank"] == 1, "loss"].eq(2.0).all()
    assert [(t["lane"], t["rank"], t["records"]) for t in open_store(fresh_store).tracks("r")] == [(0, 0, 5), (0, 1, 5)]
    with pytest.raises(ValueError, match="steps must increase"):
        sink.step(StepRecord("r", 0, "32-true", 4, 1.0, 1.0, 2.0, 3.0, 1e-3, None, False, 1.0, 1, 1, 1, 1, None, None,
                             0.0))


@pytest.mark.both_stores
def test_a_column_added_later_reads_as_missing_in_older_chunks(fresh_store):
    """A store written before a StepRecord field existed: its chunks lack that column, which reads as NaN / 0."""
    write_run(fresh_store, "r", [300])
    store_sql(fresh_store, "DELETE FROM chunk_columns WHERE name IN ('grad_norm', 'optim_bytes')")
    frame = open_store(fresh_store).steps("r")
    assert len(frame) == 600 and frame["grad_norm"].isna().all() and (frame["optim_bytes"] == 0).all()


# --- processes ------------------------------------------------------------------------------------------------------
RUN_ARGS = ("--workload", "mlp_regression", "--modes", "32-true,16-mixed", "--steps", "1000000")


def wait_for(condition, timeout: float = 60.0, what: str = "") -> None:
    """Poll another process's effect on the store (nothing else can wake this one)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.both_stores
def test_a_page_follows_a_run_another_process_is_writing(fresh_store):
    """A CLI run in its own process; the page's manager (its own RunStore) follows it: records arrive while the
    writer is still running, every lane grows, and nothing is read twice."""
    proc = start_cli_run(fresh_store, *RUN_ARGS)
    try:
        wait_for_stored_steps(fresh_store, proc, more_than=0)
        manager = RunManager(open_store(fresh_store))
        (run_id,) = manager.list_runs()["run_id"]
        follower = RecordFollower(run_id)
        seen = []
        for _ in range(4):
            series = follower.update(manager)
            seen.append([lane.stats.records for lane in series])
            wait_for_stored_steps(fresh_store, proc, more_than=sum(seen[-1]))  # the writer's next flush
        assert proc.poll() is None, "the writer ended before the test looked"
        assert manager.run_info(run_id).status == "running"
        assert len(seen[-1]) == 2 and seen[-1][0] > seen[0][0] > 0 and seen == sorted(seen)
        for lane in series:
            steps = lane.points("step_ms")[0]
            assert (np.diff(steps) > 0).all() and lane.stats.last_step == lane.stats.records - 1
    finally:
        proc.send_signal(signal.SIGINT)  # the CLI stops the run cleanly on Ctrl-C
        proc.wait(30)
    assert RunManager(open_store(fresh_store)).run_info(run_id).status == "stopped"


@pytest.mark.both_stores
def test_kill_9_loses_at_most_the_last_second_and_never_half_a_chunk(fresh_store):
    proc = start_cli_run(fresh_store, *RUN_ARGS)
    try:
        first = wait_for_stored_steps(fresh_store, proc, more_than=2000)
        wait_for_stored_steps(fresh_store, proc, more_than=first)  # a later flush landed: killed mid-run
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.time()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    store = open_store(fresh_store)
    (run_id,) = store.runs()["run_id"]
    assert store.run(run_id)["status"] == "interrupted"
    frame = store.steps(run_id)
    tracks = store.tracks(run_id)
    assert len(frame) == sum(t["records"] for t in tracks) > 2000
    for track in tracks:
        lane = frame[frame["lane"] == track["lane"]]
        assert lane["step"].tolist() == list(range(track["records"]))
    assert killed_at - frame["t_wall_s"].max() < 1.5


def _unshare_available() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.both_stores
@pytest.mark.skipif(not _unshare_available(), reason="needs root and unshare to start a writer in its own pid "
                                                      "namespace")
def test_a_writer_in_another_pid_namespace_is_judged_by_its_heartbeat(fresh_store):
    """The writer is pid 1 of its own namespace: here pid 1 is init, alive with another start time, so a pid check
    says 'gone' (and the old pid_exists check would say 'alive' forever). Its heartbeat keeps the run live; once it
    is killed the heartbeat goes stale and the run is interrupted."""
    proc = start_cli_run(fresh_store, *RUN_ARGS, prefix=("unshare", "-p", "-f", "--mount-proc"))
    try:
        wait_for_stored_steps(fresh_store, proc, more_than=0)
        store = open_store(fresh_store, stale_after_s=3.0)
        (run_id,) = store.runs()["run_id"]
        row = store.run(run_id)
        assert row["pid"] == 1 and row["pid_namespace"] != os.readlink("/proc/self/ns/pid")
        watched_from = time.time()

        def live_past_the_stale_limit() -> bool:  # checked at every poll until the writer has beaten for 4.5 s
            assert store.mark_interrupted() == [] and store.run(run_id)["status"] == "running"
            return store.run(run_id)["heartbeat_at"] > watched_from + 4.5

        wait_for(live_past_the_stale_limit, timeout=60, what="4.5 s of heartbeats")
        writer = psutil.Process(proc.pid).children()[0]
        writer.kill()
        proc.wait(10)
        assert store.run(run_id)["status"] == "running"  # not yet: its last heartbeat is fresh
        wait_for(lambda: store.mark_interrupted() == [run_id], timeout=10, what="a stale heartbeat")
        assert store.run(run_id)["status"] == "interrupted"
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        if proc.poll() is None:
            proc.kill()


@pytest.mark.both_stores
def test_a_reused_pid_does_not_keep_a_dead_run_live(fresh_store):
    """The writer is killed and its pid goes to another process (as in a restarted container): that process has
    another start time, so the run is interrupted."""
    proc = start_cli_run(fresh_store, *RUN_ARGS)
    wait_for_stored_steps(fresh_store, proc, more_than=0)
    proc.kill()
    proc.wait(10)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store_sql(fresh_store, "UPDATE runs SET pid = ?", (other.pid,))  # the pid now names `other`, a live process
        assert psutil.pid_exists(other.pid)
        store = open_store(fresh_store)
        assert store.runs()["status"].tolist() == ["interrupted"]
    finally:
        other.kill()
        other.wait()


@pytest.mark.both_stores
def test_a_live_writer_marked_interrupted_by_mistake_says_so_and_goes_on(fresh_store):
    store = open_store(fresh_store)
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true",), steps=100_000), store).start()
    try:
        wait_for(lambda: stored_steps(fresh_store) > 0, what="the first flush")
        # as a reader on another host whose stale limit passed would
        store_sql(fresh_store, "UPDATE runs SET status = 'interrupted'")
        wait_for(lambda: store.run(run.run_id)["status"] == "running", timeout=10, what="the next flush")
    finally:
        run.stop()
    assert "resumed" in set(store.events(run.run_id)["kind"])


# --- schema changes and damage --------------------------------------------------------------------------------------
SCHEMA_1 = """
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, name TEXT NOT NULL, workload TEXT NOT NULL, modes TEXT NOT NULL,
    status TEXT NOT NULL, config TEXT NOT NULL, device TEXT NOT NULL, torch_version TEXT NOT NULL,
    host TEXT NOT NULL, pid INTEGER NOT NULL, created_at REAL NOT NULL, ended_at REAL);
CREATE TABLE lanes (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, mode TEXT NOT NULL, status TEXT NOT NULL,
    error TEXT NOT NULL DEFAULT '', PRIMARY KEY (run_id, lane));
CREATE TABLE steps (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, mode TEXT NOT NULL, step INTEGER NOT NULL, t_wall_s REAL,
    loss REAL, step_ms REAL, samples_per_s REAL, lr REAL, scale REAL, skipped INTEGER NOT NULL, grad_norm REAL,
    params_bytes REAL, grads_bytes REAL, optim_bytes REAL, activations_bytes REAL, cuda_peak_bytes REAL,
    PRIMARY KEY (run_id, lane, step)) WITHOUT ROWID;
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, lane INTEGER, step INTEGER,
    kind TEXT NOT NULL, message TEXT NOT NULL, t_wall_s REAL NOT NULL, data TEXT NOT NULL);
CREATE INDEX events_run ON events (run_id, id);
CREATE TABLE gradstats (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, step INTEGER NOT NULL, param TEXT NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (run_id, lane, step, param)) WITHOUT ROWID;
PRAGMA application_id = 1095585868;
PRAGMA user_version = 1;
"""
"""Schema 1 as AMP Lab wrote it before this change (amp_core/records/store.py at the house commit)."""
SCHEMA_1_STEP_FIELDS = ["run_id", "lane", "mode", "step", "t_wall_s", "loss", "step_ms", "samples_per_s", "lr",
                        "scale", "skipped", "grad_norm", "params_bytes", "grads_bytes", "optim_bytes",
                        "activations_bytes"]
"""Schema 1's step columns (then cuda_peak_bytes, a process-wide CUDA peak that schema 2 does not keep)."""


def schema_1_store(path: Path) -> Run:
    """A store as the landed code left it: a real finished run (one row per step) and a run a killed process left
    'running'."""
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=300, gradstats_every=100,
                        name="old run")).start()
    run.join()
    frame = run.frame()
    old_fields = SCHEMA_1_STEP_FIELDS
    with sqlite3.connect(path) as conn:
        conn.executescript(SCHEMA_1)
        conn.execute("PRAGMA journal_mode=WAL")
        for run_id, status, pid in ((run.run_id, "finished", os.getpid()), ("gone-run", "running", 2**22 + 7)):
            conn.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, 'cpu', 'x', ?, ?, ?, NULL)",
                         (run_id, "old run", "mlp_regression", json.dumps(["32-true", "16-mixed"]), status,
                          json.dumps(run.config.to_dict()), os.uname().nodename, pid, time.time()))
            conn.executemany("INSERT INTO lanes VALUES (?, ?, ?, ?, '')",
                             [(run_id, i, mode, status) for i, mode in enumerate(["32-true", "16-mixed"])])
        conn.executemany(f"INSERT INTO steps VALUES ({', '.join('?' * (len(old_fields) + 1))})",
                         [(*(None if pd.isna(v) else v.item() if hasattr(v, "item") else v for v in row), None)
                          for row in frame[old_fields].itertuples(index=False)])  # cuda_peak_bytes: a CPU run
        conn.executemany("INSERT INTO steps (run_id, lane, mode, step, t_wall_s, loss, step_ms, skipped) "
                         "VALUES ('gone-run', 0, '32-true', ?, ?, 1.0, 1.0, 0)", [(s, 1.7e9 + s) for s in range(50)])
        conn.executemany("INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         [(e.run_id, e.lane, e.step, e.kind, e.message, e.t_wall_s, json.dumps(e.data, default=str))
                          for e in run.events()])
        conn.executemany("INSERT INTO gradstats VALUES (?, ?, ?, ?, ?)",
                         [(rid, lane, step, s.param, json.dumps(s.to_dict()))
                          for rid, lane, step, s in run.grad_stats()])
    return run


def test_a_schema_1_store_is_migrated_in_place_after_a_backup(fresh_store):
    run = schema_1_store(fresh_store)
    with sqlite3.connect(fresh_store) as conn:
        original = list(conn.iterdump())
    store = open_store(fresh_store)
    with sqlite3.connect(store.backup_path) as conn:  # the backup holds the store as it was, schema 1
        assert list(conn.iterdump()) == original and conn.execute("PRAGMA user_version").fetchone()[0] == 1
    with sqlite3.connect(fresh_store) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "steps" not in tables and {"tracks", "chunks", "chunk_columns", "levels"} <= tables
    info = store.run(run.run_id)
    assert (info["status"], info["name"], [lane["status"] for lane in info["lanes"]]) == (
        "finished", "old run", ["finished", "finished"])
    migrated = store.steps(run.run_id)
    pd.testing.assert_frame_equal(migrated[SCHEMA_1_STEP_FIELDS], run.frame()[SCHEMA_1_STEP_FIELDS])
    # Figures schema 1 never had read as not measured (NaN).
    assert migrated["lane_peak_bytes"].isna().all() and migrated["probe_ms"].isna().all()
    assert store.run("gone-run")["status"] == "interrupted"  # its pid is gone: the old rule still applies
    assert len(store.steps("gone-run")) == 50
    assert set(store.events(run.run_id)["kind"]) == {e.kind for e in run.events()}
    assert store.grad_stat_steps(run.run_id, 1) == sorted({s for _, ln, s, _ in run.grad_stats() if ln == 1})
    assert {0, 100, 200} <= set(store.grad_stat_steps(run.run_id, 0))
    assert store.grad_stats(run.run_id, 0, 100) == sorted(
        (s for _, ln, st, s in run.grad_stats() if ln == 0 and st == 100), key=lambda s: s.param)
    series = RunManager(store).lane_series(run.run_id)
    assert [s.stats.records for s in series] == [300, 300]
    assert open_store(fresh_store).backup_path is None  # opened again: nothing more to migrate


def test_a_store_from_a_newer_schema_is_refused_and_left_byte_identical(fresh_store):
    write_run(fresh_store, "r", [100])
    with sqlite3.connect(fresh_store) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = fresh_store.read_bytes()
    with pytest.raises(StoreError, match=rf"newer AMP Lab \(store schema {SCHEMA_VERSION + 1}.*left it untouched"):
        open_store(fresh_store)
    assert fresh_store.read_bytes() == before
    assert main(["--store", str(fresh_store), "list"]) == 2


def damage_one_chunk(path: Path, run_id: str, name: str = "loss", order: str = "ASC") -> tuple[int, int]:
    """Flip bytes inside one column of lane 1's second chunk (`order` DESC: its second to last)."""
    with sqlite3.connect(path) as conn:
        first, data = conn.execute("SELECT first_step, data FROM chunk_columns WHERE run_id = ? AND lane = 1 AND "
                                   f"name = ? ORDER BY first_step {order} LIMIT 1 OFFSET 1", (run_id, name)).fetchone()
        damaged = data[:30] + bytes(b ^ 0x5A for b in data[30:60]) + data[60:]
        conn.execute("UPDATE chunk_columns SET data = ? WHERE run_id = ? AND lane = 1 AND name = ? AND first_step = ?",
                     (damaged, run_id, name, first))
        (last,) = conn.execute("SELECT last_step FROM chunks WHERE run_id = ? AND lane = 1 AND first_step = ?",
                               (run_id, first)).fetchone()
    return first, last


def test_a_damaged_chunk_is_reported_for_its_run_and_every_other_run_opens(fresh_store, tmp_path, capsys):
    write_run(fresh_store, "damaged", [3000, 3000, 3000])
    write_run(fresh_store, "intact", [3000, 3000, 3000], seed=9)
    first, last = damage_one_chunk(fresh_store, "damaged")
    manager = RunManager(open_store(fresh_store))
    series = manager.lane_series("damaged", max_points=100_000)  # every record: the damaged ones must be missing
    lane = series[1]
    assert lane.problems and f"steps {first}–{last}" in lane.problems[0] and "lane 1 (16-mixed)" in lane.problems[0]
    assert len(lane.raw["step"]) == 9000 - (last - first + 1) and len(series[0].raw["step"]) == 9000
    assert manager.run_info("damaged").problems == list(lane.problems)
    assert not manager.lane_series("intact")[1].problems and manager.run_info("intact").problems == []
    assert len(manager.steps("intact")) == 18_000
    assert len(compare.gather_lanes(manager, ["intact/1", "damaged/0"])) == 2
    assert main(["--store", str(fresh_store), "list"]) == 0
    assert main(["--store", str(fresh_store), "export", "damaged", "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Run damaged, lane 1 (16-mixed): the records of steps") and "Traceback" not in err
    assert main(["--store", str(fresh_store), "export", "intact", "--out", str(tmp_path / "y.csv")]) == 0
    assert len(pd.read_csv(tmp_path / "y.csv")) == 18_000


def test_the_train_page_shows_a_damaged_run_with_a_message(fresh_store):
    """The page reads the last records of every lane (its latest figures): one of those chunks is damaged."""
    write_run(fresh_store, "damaged", [3000, 3000, 3000, 100])
    damage_one_chunk(fresh_store, "damaged", "loss", order="DESC")
    at = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=60)
    at.session_state["train_run_id"] = "damaged"
    at.run()
    assert not at.exception
    assert any("could not be read" in w.value and "lane 1" in w.value for w in at.warning)
    assert len(at.get("plotly_chart")) == 5


@pytest.mark.both_stores
def test_a_follower_of_a_stored_run_decodes_only_what_is_new(fresh_store, monkeypatch):
    """Chunks but a track's last never change, summary blocks never: a follower decodes each column once."""
    sink = RecordSink("r", open_store(fresh_store))
    sink.open(CONFIG.to_dict(), "cpu", "test")

    def flush(start: int, count: int) -> None:
        for lane, mode in enumerate(CONFIG.modes):
            sink.extend_steps(lane, mode, synthetic(start, count, seed=start + lane))
        sink.flush()

    for start in range(0, 15_000, 3000):
        flush(start, 3000)
    import amp_core.records.store as store_module

    decoded = []
    real_decode = store_module.decode_array
    monkeypatch.setattr(store_module, "decode_array", lambda blob: decoded.append(1) or real_decode(blob))
    manager = RunManager(open_store(fresh_store))
    follower = RecordFollower("r")
    first = follower.update(manager)
    assert decoded and [lane.stats.records for lane in first] == [15_000, 15_000]
    decoded.clear()
    assert [lane.stats.median_step_ms for lane in follower.update(manager)] == [
        lane.stats.median_step_ms for lane in first]
    assert decoded == []  # nothing new: nothing decoded
    flush(15_000, 2000)
    series = follower.update(manager)
    assert [lane.stats.records for lane in series] == [17_000, 17_000]
    assert len(decoded) == len(CONFIG.modes) * len(STEP_COLUMNS)  # the new chunk of each lane, each column once


@pytest.mark.both_stores
def test_compare_gathers_lanes_through_the_summary_in_the_order_asked(fresh_store):
    write_run(fresh_store, "a", [60_000])
    write_run(fresh_store, "b", [500], seed=3)
    manager = RunManager(open_store(fresh_store))
    series = compare.gather_lanes(manager, ["b/1", "a/0", "a/1", "nope/0"])
    assert [lane.key for lane in series] == ["b/1", "a/0", "a/1"]
    assert series[0].bucket_steps == 1 and series[1].bucket_steps > 1
    assert all(len(lane.points("loss")[0]) < 2500 for lane in series)
    assert [lane.stats.records for lane in series] == [500, 60_000, 60_000]


@pytest.mark.both_stores
def test_the_sink_times_what_storing_costs_the_run(fresh_store):
    """write_seconds is the store's whole cost to the writer (bench.scale's write_overhead reads it). 300 steps: the
    run opens, flushes and closes its records like a long one (the sum is what is checked, not its size)."""
    config = RunConfig(workload="mlp_regression", modes=("32-true",), steps=300)
    started = time.perf_counter()
    stored = Run(config, open_store(fresh_store)).start()
    stored.join()
    elapsed = time.perf_counter() - started
    unstored = Run(config).start()
    unstored.join()
    # Measured, and part of the run's own time; how small it is is bench.scale's figure (it depends on the disk).
    assert 0 < stored.sink.write_seconds < elapsed and unstored.sink.write_seconds == 0


def test_a_grad_norm_not_measured_marks_no_record_and_an_infinite_one_does():
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true",), steps=60, grad_norm_every=25,
                        gradstats_every=0)).start()
    run.join(120)
    frame = run.frame()
    assert frame["grad_norm"].isna().sum() >= 50  # measured on sampled steps only
    (track,) = run.sink.records.tracks()
    assert track.mark_rows.count == 0  # "not measured" is not a non-finite figure: nothing is kept apart
    columns = {name: np.zeros(3, dtype=dtype) for name, dtype in STEP_COLUMNS.items()}
    columns["grad_norm"] = np.array([np.nan, np.inf, 1.0], dtype=np.float32)
    assert marked(columns).tolist() == [1]
