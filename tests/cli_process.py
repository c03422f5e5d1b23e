"""A CLI run in a process of its own, and waiting for what it writes to the store both processes share."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_cli_run(store: Path, *run_args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python -m amp_core --store STORE run RUN_ARGS...` from the checkout's root (stdout and stderr discarded);
    `prefix`: a command it runs under (e.g. `unshare ...`).

    Ctrl-C (SIGINT) reaches it as it would from a terminal, even when the tests themselves were started in the
    background (where a shell ignores SIGINT, and a child would inherit that).
    """
    return subprocess.Popen([*prefix, sys.executable, "-m", "amp_core", "--store", str(store), "run", *run_args],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stored_steps(store: Path) -> int:
    """Step records in the store file so far, as its tracks count them (0 before the other process has made it)."""
    if not store.exists():
        return 0
    with sqlite3.connect(store) as conn:
        try:
            return conn.execute("SELECT COALESCE(SUM(records), 0) FROM tracks").fetchone()[0]
        except sqlite3.OperationalError:  # the other process has not made its tables yet
            return 0


def wait_for_stored_steps(store: Path, proc: subprocess.Popen, more_than: int, timeout_s: float = 60.0) -> int:
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
