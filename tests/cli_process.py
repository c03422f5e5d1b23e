"""A CLI run in a process of its own, waiting for what it writes to the store both processes share, and SQL run on a
store as another program would (a SQLite file or a PostgreSQL URL; never through AMP Lab's own store code)."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def is_url(store) -> bool:
    return str(store).startswith("postgresql://")


def store_sql(store, statement: str, params: tuple = ()) -> list[tuple]:
    """Run one statement (`?` parameters) on the store directly; its rows (none for a write)."""
    if is_url(store):
        import psycopg

        with psycopg.connect(str(store), autocommit=True) as conn:
            cursor = conn.execute(statement.replace("?", "%s"), params or None)
            return cursor.fetchall() if cursor.description else []
    with closing(sqlite3.connect(store)) as conn, conn:
        return conn.execute(statement, params).fetchall()


def start_cli_run(store: Path | str, *run_args: str, prefix: tuple[str, ...] = (),
                  output: bool = False) -> subprocess.Popen:
    """`python -m amp_core --store STORE run RUN_ARGS...` from the checkout's root (stdout and stderr discarded, or
    with `output` piped as text for `communicate`); `prefix`: a command it runs under (e.g. `unshare ...`).

    Ctrl-C (SIGINT) reaches it as it would from a terminal, even when the tests themselves were started in the
    background (where a shell ignores SIGINT, and a child would inherit that).
    """
    stream = subprocess.PIPE if output else subprocess.DEVNULL
    return subprocess.Popen([*prefix, sys.executable, "-m", "amp_core", "--store", str(store), "run", *run_args],
                            cwd=ROOT, stdout=stream, stderr=stream, text=output,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stored_steps(store: Path | str) -> int:
    """Step records in the store so far, as its tracks count them (0 before the other process has made it)."""
    if not is_url(store) and not Path(store).exists():
        return 0
    try:
        return int(store_sql(store, "SELECT COALESCE(SUM(records), 0) FROM tracks")[0][0])
    except Exception as exc:  # the other process has not made its tables yet (sqlite3's or psycopg's error)
        if "tracks" in str(exc):
            return 0
        raise


def wait_for_stored_steps(store: Path | str, proc: subprocess.Popen, more_than: int, timeout_s: float = 60.0) -> int:
    """Wait until the store holds more than `more_than` step records; return how many it holds then.

    The writer is another process, so no event or condition reaches this one: the store file is read every 50 ms
    (the writer flushes every 0.5 s). Fails if the process exits first or the time runs out.
    """
    deadline = time.monotonic() + timeout_s
    while (count := stored_steps(store)) <= more_than:
        assert proc.poll() is None, f"the CLI run exited with {proc.returncode} before writing {more_than} steps"
        assert time.monotonic() < deadline, f"the store held {count} steps after {timeout_s} s"
        time.sleep(0.05)
    return count
