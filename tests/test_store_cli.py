"""The SQLite store (real files) and the CLI (real subprocesses): round trip, damage, kill -9, bad input."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pandas as pd
import pytest
from cli_process import start_cli_run, wait_for_stored_steps

from amp_core.cli import main
from amp_core.config import FaultSpec, RunConfig, ScalerConfig
from amp_core.race.runner import Run
from amp_core.records import STEP_FIELDS
from amp_core.records.opening import open_store
from amp_core.records.store import StoreError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.both_stores
def test_a_run_round_trips_through_the_store(fresh_store):
    config = RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=30, gradstats_every=10,
                       scaler=ScalerConfig(init_scale=256.0),
                       faults=(FaultSpec(kind="grad_inf", step=12, modes=("16-mixed",)),), name="round trip")
    run = Run(config, open_store()).start()
    run.join(60)
    reopened = open_store(fresh_store)  # as after a restart
    info = reopened.run(run.run_id)
    assert info["status"] == "finished" and info["name"] == "round trip"
    assert RunConfig.from_dict(info["config"]) == config
    assert [lane["status"] for lane in info["lanes"]] == ["finished", "finished"]
    stored = reopened.steps(run.run_id)
    memory = run.frame().sort_values(["step", "lane"], ignore_index=True)
    pd.testing.assert_frame_equal(stored[list(STEP_FIELDS)], memory, check_dtype=False)
    events = reopened.events(run.run_id)
    assert {"started", "fault", "skipped_step", "scale_backoff", "finished"} <= set(events["kind"])
    assert reopened.grad_stat_steps(run.run_id, 1) == [0, 10, 12, 20]
    stats = reopened.grad_stats(run.run_id, 1, 12)
    assert {s.param for s in stats} == {"layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias"}
    assert next(s for s in stats if s.param == "layer1.weight").inf == 1


@pytest.mark.both_stores
def test_writes_are_batched_not_one_transaction_per_step(fresh_store):
    store = open_store()
    calls = []
    original = store.write_flush

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    store.write_flush = counting
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true",), steps=2000), store).start()
    run.join(120)
    assert store.lane_step_counts(run.run_id) == {0: 2000}
    assert len(store.steps(run.run_id)) == 2000
    assert len(calls) < 2000 / 20, f"{len(calls)} transactions for 2000 steps"


@pytest.mark.parametrize("content", [b"this is not a database at all" * 10, b"SQLite format 3\x00" + b"\xff" * 200])
def test_a_damaged_store_is_refused_and_left_untouched(tmp_path, content):
    path = tmp_path / "damaged.sqlite3"
    path.write_bytes(content)
    with pytest.raises(StoreError, match=r"left it untouched|damaged"):
        open_store(path)
    assert path.read_bytes() == content


def test_another_programs_database_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "foreign.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
        conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
    before = path.read_bytes()
    with pytest.raises(StoreError, match="belongs to another program \\(tables: invoices\\)"):
        open_store(path)
    assert path.read_bytes() == before


@pytest.mark.both_stores
def test_a_killed_process_leaves_an_interrupted_run_with_its_steps(fresh_store):
    """kill -9 mid-run: the run reads as interrupted, every record a committed flush wrote is there (no half chunk),
    and the last one is from less than 1.5 s before the kill (a flush every 0.5 s)."""
    proc = start_cli_run(fresh_store, "--workload", "mlp_regression", "--modes", "32-true,bf16-mixed",
                         "--steps", "1000000")
    try:
        first = wait_for_stored_steps(fresh_store, proc, more_than=500)
        wait_for_stored_steps(fresh_store, proc, more_than=first)  # a later flush landed: killed mid-run
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.time()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    store = open_store(fresh_store)
    runs = store.runs()
    assert runs["status"].tolist() == ["interrupted"]
    run_id = runs["run_id"][0]
    steps = store.steps(run_id)
    counts = store.lane_step_counts(run_id)
    assert len(steps) == sum(counts.values()) > first
    for lane, records in counts.items():  # each lane's records from step 0, none missing, none twice
        assert steps[steps["lane"] == lane]["step"].tolist() == list(range(records))
    # Flushed at least every 0.5 s: at most about a second of records is lost.
    assert killed_at - steps["t_wall_s"].max() < 1.5
    assert set(store.events(run_id)["kind"]) >= {"started", "interrupted"}


@pytest.mark.both_stores
def test_cli_run_prints_a_table_and_writes_the_store(fresh_store, capsys):
    code = main(["run", "--workload", "mlp_regression", "--modes", "32-true,bf16-mixed", "--steps", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert "ms/step" in out and "speedup" in out and "peak MiB" in out and "final loss" in out and "skipped" in out
    assert out.splitlines()[2].startswith("32-true ") and out.splitlines()[3].startswith("bf16-mixed ")
    run_id = out.split()[1].rstrip(":")
    assert len(open_store().steps(run_id)) == 40
    assert main(["list"]) == 0 and run_id in capsys.readouterr().out


@pytest.mark.both_stores
def test_cli_export_csv_and_parquet(fresh_store, tmp_path, capsys):
    assert main(["run", "--workload", "mlp_regression", "--modes", "32-true", "--steps", "5"]) == 0
    run_id = capsys.readouterr().out.split()[1].rstrip(":")
    assert main(["export", run_id, "--format", "csv", "--out", str(tmp_path / "r.csv")]) == 0
    assert main(["export", run_id, "--format", "parquet", "--out", str(tmp_path / "r.parquet")]) == 0
    csv, parquet = pd.read_csv(tmp_path / "r.csv"), pd.read_parquet(tmp_path / "r.parquet")
    assert len(csv) == len(parquet) == 5 and list(csv.columns) == list(STEP_FIELDS)


@pytest.mark.both_stores
def test_cli_run_samples_layer_amax_when_asked(fresh_store, capsys):
    assert main(["run", "--workload", "mlp_regression", "--modes", "16-mixed", "--steps", "12",
                 "--amax-every", "5"]) == 0
    run_id = capsys.readouterr().out.split()[1].rstrip(":")
    sampled = open_store().events(run_id).query("kind == 'layer_amax'")
    assert sampled["step"].tolist() == [0, 5, 10]  # after steps 0, 5 and 10 of the one lane


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--amax-every", "-1"], "error: amax_every: must be"),
    (["run", "--lr", "0"], "error: lr: must be > 0, got 0.0"),
    (["run", "--steps", "-5"], "error: steps: must be > 0, got -5"),
    (["run", "--modes", "32-true,fp7"], "error: modes: unknown mode 'fp7'"),
    (["run", "--workload", "gpt5"], "error: workload: unknown workload 'gpt5'"),
    (["run", "--fault", "meteor@3"], "error: faults.kind: unknown fault 'meteor'"),
    (["run", "--steps", "ten"], "error: argument --steps: invalid int value: 'ten'"),
    (["export", "nope", "--out", "x.csv"], "error: run_id: no run 'nope'"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message, capsys):
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors leave through SystemExit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().startswith(message), err
    assert len(err.strip().splitlines()) == 1


def test_cli_bad_input_in_a_real_process_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "amp_core", "run", "--lr", "-1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "error: lr: must be > 0, got -1.0\n"


def test_cli_refuses_a_damaged_store(tmp_path, capsys):
    bad = tmp_path / "bad.sqlite3"
    bad.write_bytes(b"garbage" * 100)
    assert main(["--store", str(bad), "list"]) == 2
    assert "not a SQLite database" in capsys.readouterr().err


def test_opening_the_store_again_keeps_the_locks_of_this_process(tmp_path):
    """A process that reads the store opens it again (a fresh RunStore): its first connection must keep its lock on
    the file. Closing any other descriptor of the file drops all of a process's POSIX locks on it; another process's
    connection then took itself for the last one and removed the WAL under the first (a reader's next write left the
    file malformed). Here the other process closes its connection: the WAL must stay, and everything still reads."""
    path = tmp_path / "runs.sqlite3"
    store = open_store(path)
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true",), steps=5), store).start()
    run.join(60)
    assert len(store.steps(run.run_id)) == 5  # this thread's connection is open, in WAL mode
    open_store(path)  # opened again, as a reader following the store does
    other = subprocess.run([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                            "c.execute('SELECT COUNT(*) FROM runs').fetchone(); c.close()", str(path)],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert Path(f"{path}-wal").exists(), "another process's close took the WAL away from this process's connection"
    assert len(store.steps(run.run_id)) == 5
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
