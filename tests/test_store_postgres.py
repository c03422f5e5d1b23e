"""The PostgreSQL store on the tests' own server: a server that goes away mid-run, credentials, many processes
opening one database at once, a foreign or newer database, the backlog bound, copying runs between stores."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from cli_process import ROOT, start_cli_run, store_sql, wait_for_stored_steps

from amp_core.cli import main
from amp_core.config import RunConfig
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from amp_core.records.sink import RecordSink
from amp_core.records.store import SCHEMA_VERSION, StoreError, StoreUnreachable

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

CONFIG = RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=10)


@pytest.fixture
def database(pg_cluster) -> str:
    """A fresh database's URL (the superuser's: no password)."""
    return pg_cluster.url(pg_cluster.new_database())


def columns(start: int, count: int, skipped_every: int = 0) -> dict[str, np.ndarray]:
    from amp_core.records.schema import STEP_COLUMNS

    steps = np.arange(start, start + count, dtype=np.int64)
    out = {name: np.ones(count, dtype=dtype) for name, dtype in STEP_COLUMNS.items()}
    out["step"], out["t_wall_s"], out["skipped"] = steps, 1.7e9 + steps.astype(float), np.zeros(count, dtype=bool)
    out["loss"] = 1.0 / (1.0 + steps).astype(np.float32)
    if skipped_every:
        out["skipped"][steps % skipped_every == 0] = True
    return out


def test_a_cli_run_outlives_its_server_going_away_and_writes_every_record(pg_cluster, database):
    """The server stops for a few seconds mid-run (a real CLI process): the run trains on, says once in its log and
    as an event that it waited, and once the server is back writes what it made meanwhile; stopped (Ctrl-C) after
    that, the store holds every step of every lane that the run made. (A run long enough for any machine, stopped when
    the records show it went on: a fixed step count either outlives the outage on a slow machine only or trains for
    a minute on this one.)"""
    # Started so that its Ctrl-C below reaches it even when the tests run in the background (one suite started
    # with `&` ignored it, and the run went on until communicate's timeout).
    proc = start_cli_run(database, "--workload", "mlp_regression", "--modes", "32-true,16-mixed", "--steps",
                         "10000000", output=True)
    try:
        stored = wait_for_stored_steps(database, proc, more_than=0)
        pg_cluster.stop()
        time.sleep(3)  # the outage itself (what the test is about), not a wait for something to happen
        assert proc.poll() is None, "the run ended while its server was away"
        pg_cluster.start()
        wait_for_stored_steps(database, proc, more_than=stored)  # what it made meanwhile, written once it is back
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    store = open_store(database)
    (run_id,) = store.runs()["run_id"]
    assert f"run {run_id}: stopped" in out
    assert store.run(run_id)["status"] == "stopped"
    frame = store.steps(run_id)
    made = [frame[frame["lane"] == lane]["step"].tolist() for lane in (0, 1)]
    for steps in made:  # every step made, none lost in the outage
        assert steps == list(range(len(steps)))
    assert len(made[0]) - len(made[1]) in (0, 1)  # lanes step in turn: the stop may come between them
    events = store.events(run_id)
    kinds = events["kind"].tolist()
    assert kinds.count("store_unreachable") == 1 and kinds.count("store_waited") == 1
    assert kinds.index("store_unreachable") < kinds.index("store_waited")
    assert events.set_index("kind").loc["store_waited", "data"]["waited_s"] > 1.0
    assert err.count("cannot be reached") == 1 and "Traceback" not in err  # said once, however many retries


def test_kill_9_of_a_writer_leaves_an_interrupted_run_with_its_records(database):
    proc = start_cli_run(database, "--workload", "mlp_regression", "--modes", "32-true", "--steps", "1000000")
    try:
        first = wait_for_stored_steps(database, proc, more_than=500)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    store = open_store(database)
    (run_id,) = store.runs()["run_id"]
    assert store.run(run_id)["status"] == "interrupted"
    frame = store.steps(run_id)
    assert len(frame) >= first and frame["step"].tolist() == list(range(len(frame)))
    assert "interrupted" in set(store.events(run_id)["kind"])


def test_a_password_is_never_printed_logged_stored_or_shown(pg_cluster, tmp_path, capsys):
    password = f"pw-{uuid.uuid4().hex}"
    role = f"u_{uuid.uuid4().hex[:8]}"
    name = pg_cluster.new_database()
    pg_cluster.sql(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    pg_cluster.sql(f"ALTER DATABASE {name} OWNER TO {role}")
    url = pg_cluster.url(name, user=role, password=password)
    run = subprocess.run([sys.executable, "-m", "amp_core", "--store", url, "run", "--workload", "mlp_regression",
                          "--modes", "32-true", "--steps", "30"], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr
    # The listings in this process (`python -m amp_core` is this `main`; it sets up no logging of its own): what
    # they print is captured as a terminal would show it.
    capsys.readouterr()
    assert main(["--store", url, "list"]) == 0
    listed = capsys.readouterr()
    assert main(["--store", url.replace(password, "wrong"), "list"]) == 2
    wrong = capsys.readouterr()
    assert wrong.err.startswith("error: ") and len(wrong.err.splitlines()) == 1
    assert "password authentication failed" in wrong.err and "wrong" not in wrong.err
    store = open_store(url)
    assert store.location == f"postgresql://{role}@127.0.0.1:{pg_cluster.port}/{name}"
    stored = [json.dumps(row, default=str) for table in ("runs", "lanes", "tracks", "events")
              for row in store_sql(url, f"SELECT * FROM {table}")]
    assert len(stored) > 4
    said = [run.stdout, run.stderr, listed.out, listed.err, wrong.out, wrong.err, store.location, *stored]
    assert not [text for text in said if password in text]
    (run_id,) = store.runs()["run_id"]
    assert password not in json.dumps(store.run(run_id)["config"])


def test_processes_opening_a_new_database_at_once_make_one_schema(database):
    code = "import sys; from amp_core.records.opening import open_store; open_store(sys.argv[1]).runs()"
    procs = [subprocess.Popen([sys.executable, "-c", code, database], cwd=ROOT, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, errors
    assert store_sql(database, "SELECT version FROM amp_lab_schema") == [(SCHEMA_VERSION,)]
    open_store(database)  # again: idempotent
    assert store_sql(database, "SELECT version FROM amp_lab_schema") == [(SCHEMA_VERSION,)]


def test_another_programs_tables_or_a_newer_schema_are_refused_and_left_untouched(pg_cluster, database):
    store_sql(database, "CREATE TABLE runs (invoice INTEGER)")
    with pytest.raises(StoreError, match="another program's tables"):
        open_store(database).runs()
    newer = pg_cluster.url(pg_cluster.new_database())
    made = "import sys; from amp_core.records.opening import open_store; open_store(sys.argv[1]).runs()"
    subprocess.run([sys.executable, "-c", made, newer], cwd=ROOT, check=True)  # (this process checks a store once)
    store_sql(newer, "UPDATE amp_lab_schema SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match="newer AMP Lab"):
        open_store(newer).runs()
    assert store_sql(newer, "SELECT version FROM amp_lab_schema") == [(SCHEMA_VERSION + 1,)]


def test_an_unreachable_server_is_one_line_from_the_cli(pg_cluster, capsys):
    url = f"postgresql://amp@127.0.0.1:{pg_cluster.port + 1}/nowhere"  # nothing listens there
    assert main(["--store", url, "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the store's server at postgresql://amp@127.0.0.1") and len(err.splitlines()) == 1
    store = open_store(url)  # opening never fails for an absent server; reading says so
    assert not store.reachable()
    with pytest.raises(StoreUnreachable):
        store.runs()


def test_past_the_backlog_bound_the_oldest_summarised_detail_is_dropped_and_said(pg_cluster, database):
    """The server is away while 3 x 4096 steps arrive and the writer may hold 5000: the oldest detail the summary
    covers is dropped (every skipped step kept), and an event says which steps; the newest detail is all there."""
    sink = RecordSink("r", open_store(database, backlog_records=5000))
    sink.open(CONFIG.to_dict(), "cpu", "test")
    sink.extend_steps(0, "32-true", columns(0, 100, skipped_every=7))
    assert sink.flush()
    pg_cluster.stop()
    try:
        for start in range(100, 3 * 4096, 1000):
            sink.extend_steps(0, "32-true", columns(start, min(1000, 3 * 4096 - start), skipped_every=7))
            assert not sink.flush()
    finally:
        pg_cluster.start()
    sink.close("finished", [(0, "finished", "")])
    store = open_store(database)
    dropped = store.events("r").query("kind == 'store_dropped'")
    assert len(dropped) >= 1 and {"store_unreachable", "store_waited"} <= set(store.events("r")["kind"])
    gone = sum(event["records"] for event in dropped["data"])
    assert 3 * 4096 - 100 - gone <= 5000
    frame = store.steps("r")
    all_steps = np.arange(3 * 4096)
    kept = frame["step"].to_numpy()
    missing = np.setdiff1d(all_steps, kept)
    assert len(missing) > 0 and not (missing % 7 == 0).any()  # no skipped step was dropped
    assert missing.max() < 2 * 4096  # only summarised (complete-block) detail was dropped
    assert kept[-1] == 3 * 4096 - 1 and frame["skipped"].sum() == (all_steps % 7 == 0).sum()
    (track,) = store.track_sources("r")
    assert track.complete(1, 0, 64)["count"].sum() == 4096  # the summary still covers every dropped step


@pytest.mark.both_stores
def test_store_copy_moves_runs_between_sqlite_and_postgresql(fresh_store, pg_cluster, tmp_path, capsys):
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=40, gradstats_every=10),
              open_store(fresh_store)).start()
    run.join(60)
    other = str(tmp_path / "other.sqlite3") if str(fresh_store).startswith("postgresql") else \
        pg_cluster.url(pg_cluster.new_database())
    assert main(["store", "copy", str(fresh_store), other]) == 0
    assert f"copied 1 run ({run.run_id})" in capsys.readouterr().out
    source, copy = open_store(fresh_store), open_store(other)
    assert copy.run(run.run_id)["config"] == source.run(run.run_id)["config"]
    assert copy.steps(run.run_id).equals(source.steps(run.run_id))
    assert copy.events(run.run_id)["kind"].tolist() == source.events(run.run_id)["kind"].tolist()
    assert copy.grad_stat_steps(run.run_id, 1) == source.grad_stat_steps(run.run_id, 1) != []
    assert main(["store", "copy", str(fresh_store), other]) == 0  # again: nothing twice
    assert "already there" in capsys.readouterr().out and len(copy.runs()) == 1


def test_a_dashboard_says_its_server_is_unreachable_and_recovers_by_itself(pg_cluster, database, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("AMP_LAB_STORE", database)
    run = Run(CONFIG, open_store(database)).start()
    run.join(60)
    pg_cluster.stop()
    try:
        app = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
        app.run()
        assert not app.exception
        assert any("cannot be reached" in warning.value for warning in app.warning)
        assert not [text for text in (warning.value for warning in app.warning) if "amp:" in text]  # no password form
    finally:
        pg_cluster.start()
    app.run()  # the page's watcher would do this by itself once the server answers
    assert not app.exception and not any("cannot be reached" in warning.value for warning in app.warning)
