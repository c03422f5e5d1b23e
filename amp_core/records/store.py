"""RunStore: runs, steps, events and gradient statistics in SQLite (stdlib sqlite3, WAL); reload and export."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import pandas as pd
import psutil

from amp_core.probes.gradstats import GradStats
from amp_core.records import STEP_FIELDS, Event

APPLICATION_ID = 0x414D504C  # "AMPL": marks a file as ours, so a foreign database is never touched
SCHEMA_VERSION = 1
SQLITE_HEADER = b"SQLite format 3\x00"
LIVE_STATUSES = ("pending", "running", "paused")

_STEP_TYPES = {"run_id": "TEXT NOT NULL", "lane": "INTEGER NOT NULL", "mode": "TEXT NOT NULL",
               "step": "INTEGER NOT NULL", "skipped": "INTEGER NOT NULL"}
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, name TEXT NOT NULL, workload TEXT NOT NULL, modes TEXT NOT NULL,
    status TEXT NOT NULL, config TEXT NOT NULL, device TEXT NOT NULL, torch_version TEXT NOT NULL,
    host TEXT NOT NULL, pid INTEGER NOT NULL, created_at REAL NOT NULL, ended_at REAL);
CREATE TABLE IF NOT EXISTS lanes (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, mode TEXT NOT NULL, status TEXT NOT NULL,
    error TEXT NOT NULL DEFAULT '', PRIMARY KEY (run_id, lane));
CREATE TABLE IF NOT EXISTS steps (
    {", ".join(f"{name} {_STEP_TYPES.get(name, 'REAL')}" for name in STEP_FIELDS)},
    PRIMARY KEY (run_id, lane, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, lane INTEGER, step INTEGER,
    kind TEXT NOT NULL, message TEXT NOT NULL, t_wall_s REAL NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_run ON events (run_id, id);
CREATE TABLE IF NOT EXISTS gradstats (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, step INTEGER NOT NULL, param TEXT NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (run_id, lane, step, param)) WITHOUT ROWID;
"""


class StoreError(RuntimeError):
    """The store file cannot be used (damaged, or another program's). The file is left untouched."""


def default_path() -> Path:
    """$AMP_LAB_STORE, else ~/.amp_lab/runs.sqlite3."""
    env = os.environ.get("AMP_LAB_STORE")
    return Path(env).expanduser() if env else Path.home() / ".amp_lab" / "runs.sqlite3"


class RunStore:
    """One SQLite file. Safe to use from several threads and processes: a connection per call, WAL journal."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_path()
        self._check_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._read() as conn:
            conn.executescript(SCHEMA)
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self.mark_interrupted()

    def _check_file(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a folder, not a store file")
        with open(self.path, "rb") as f:
            header = f.read(len(SQLITE_HEADER))
        if header != SQLITE_HEADER:
            raise StoreError(f"{self.path} is not a SQLite database (damaged or another kind of file); "
                             "AMP Lab left it untouched. Move it away or set AMP_LAB_STORE to another path.")
        try:
            with closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)) as conn:
                app_id = conn.execute("PRAGMA application_id").fetchone()[0]
                tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
                version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is damaged ({exc}); AMP Lab left it untouched. "
                             "Move it away or set AMP_LAB_STORE to another path.") from None
        if app_id != APPLICATION_ID and tables:
            raise StoreError(f"{self.path} belongs to another program (tables: {', '.join(tables[:5])}); "
                             "AMP Lab left it untouched. Set AMP_LAB_STORE to another path.")
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} was written by a newer AMP Lab (schema {version} > {SCHEMA_VERSION})")

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    @contextmanager
    def _write(self):
        try:
            with closing(self._connect()) as conn:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"store {self.path}: {exc}") from exc

    @contextmanager
    def _read(self):
        try:
            with closing(self._connect()) as conn:
                yield conn
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"store {self.path}: {exc}") from exc

    # --- writing -------------------------------------------------------------------------------------------
    def create_run(self, run_id: str, config: dict[str, Any], device: str, torch_version: str) -> None:
        modes = list(config["modes"])
        with self._write() as conn:
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, NULL)",
                (run_id, config.get("name", ""), config["workload"], json.dumps(modes), json.dumps(config), device,
                 torch_version, socket.gethostname(), os.getpid(), time.time()))
            conn.executemany("INSERT INTO lanes VALUES (?, ?, ?, 'running', '')",
                             [(run_id, i, mode) for i, mode in enumerate(modes)])

    def set_run_status(self, run_id: str, status: str, ended: bool = False) -> None:
        with self._write() as conn:
            conn.execute("UPDATE runs SET status = ?, ended_at = COALESCE(?, ended_at) WHERE run_id = ?",
                         (status, time.time() if ended else None, run_id))

    def set_lane_status(self, run_id: str, lane: int, status: str, error: str = "") -> None:
        with self._write() as conn:
            conn.execute("UPDATE lanes SET status = ?, error = ? WHERE run_id = ? AND lane = ?",
                         (status, error, run_id, lane))

    def write_batch(self, steps: list[tuple] = (), events: list[Event] = (),
                    grad_stats: list[tuple[str, int, int, GradStats]] = ()) -> None:
        """One transaction for what the runner gathered since its last flush."""
        if not (steps or events or grad_stats):
            return
        with self._write() as conn:
            conn.executemany(f"INSERT OR REPLACE INTO steps VALUES ({', '.join('?' * len(STEP_FIELDS))})", steps)
            conn.executemany(
                "INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(e.run_id, e.lane, e.step, e.kind, e.message, e.t_wall_s, json.dumps(e.data, default=str))
                 for e in events])
            conn.executemany("INSERT OR REPLACE INTO gradstats VALUES (?, ?, ?, ?, ?)",
                             [(run_id, lane, step, s.param, json.dumps(s.to_dict()))
                              for run_id, lane, step, s in grad_stats])

    def mark_interrupted(self) -> list[str]:
        """Runs left live by a process that is gone become 'interrupted' (their steps stay)."""
        host = socket.gethostname()
        with self._write() as conn:
            live = conn.execute(f"SELECT run_id, host, pid FROM runs WHERE status IN {LIVE_STATUSES}").fetchall()
            dead = [run_id for run_id, run_host, pid in live if run_host == host and not psutil.pid_exists(pid)]
            for run_id in dead:
                conn.execute("UPDATE runs SET status = 'interrupted', ended_at = ? WHERE run_id = ?",
                             (time.time(), run_id))
                conn.execute("UPDATE lanes SET status = 'interrupted' WHERE run_id = ? AND status = 'running'",
                             (run_id,))
                conn.execute("INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) "
                             "VALUES (?, NULL, NULL, 'interrupted', ?, ?, '{}')",
                             (run_id, "the process running this run ended without finishing it", time.time()))
        return dead

    # --- reading -------------------------------------------------------------------------------------------
    def runs(self) -> pd.DataFrame:
        """Every run, newest first, with the number of steps written."""
        with self._read() as conn:
            frame = pd.read_sql_query(
                "SELECT r.run_id, r.name, r.workload, r.modes, r.status, r.device, r.created_at, r.ended_at, "
                "(SELECT COUNT(*) FROM steps s WHERE s.run_id = r.run_id) AS steps_written "
                "FROM runs r ORDER BY r.created_at DESC", conn)
        frame["modes"] = frame["modes"].map(json.loads)
        return frame

    def run(self, run_id: str) -> dict[str, Any] | None:
        """A run's row with its config (dict) and lanes (list of dicts); None if unknown."""
        with self._read() as conn:
            conn.row_factory = sqlite3.Row
            row = conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:
                return None
            lanes = [dict(r) for r in conn.execute("SELECT * FROM lanes WHERE run_id = ? ORDER BY lane", (run_id,))]
        out = dict(row)
        out["config"], out["modes"], out["lanes"] = json.loads(out["config"]), json.loads(out["modes"]), lanes
        return out

    def steps(self, run_id: str, since_step: int = -1) -> pd.DataFrame:
        """Step records of a run (all lanes), ordered by step then lane."""
        with self._read() as conn:
            frame = pd.read_sql_query("SELECT * FROM steps WHERE run_id = ? AND step > ? ORDER BY step, lane",
                                      conn, params=(run_id, since_step))
        frame["skipped"] = frame["skipped"].astype(bool)
        return frame

    def lane_step_counts(self, run_id: str) -> dict[int, int]:
        """Step records written per lane (counted by SQLite, not by reading them)."""
        with self._read() as conn:
            rows = conn.execute("SELECT lane, COUNT(*) FROM steps WHERE run_id = ? GROUP BY lane", (run_id,))
            return dict(rows.fetchall())

    def events(self, run_id: str) -> pd.DataFrame:
        with self._read() as conn:
            frame = pd.read_sql_query("SELECT * FROM events WHERE run_id = ? ORDER BY id", conn, params=(run_id,))
        frame["data"] = frame["data"].map(json.loads)
        return frame

    def grad_stats(self, run_id: str, lane: int, step: int | None = None) -> list[GradStats]:
        """Gradient statistics of a lane at one step (all parameters), or at every sampled step."""
        query, params = "SELECT data FROM gradstats WHERE run_id = ? AND lane = ?", [run_id, lane]
        if step is not None:
            query, params = query + " AND step = ?", [*params, step]
        with self._read() as conn:
            rows = conn.execute(query + " ORDER BY step, param", params).fetchall()
        return [GradStats(**json.loads(r[0])) for r in rows]

    def grad_stat_steps(self, run_id: str, lane: int) -> list[int]:
        with self._read() as conn:
            rows = conn.execute("SELECT DISTINCT step FROM gradstats WHERE run_id = ? AND lane = ? ORDER BY step",
                                (run_id, lane)).fetchall()
        return [r[0] for r in rows]

    def export(self, run_id: str, fmt: str, out: str | Path) -> Path:
        """Write a run's step records to CSV or Parquet; returns the path."""
        if self.run(run_id) is None:
            raise KeyError(f"no run {run_id!r} in {self.path}")
        frame, out = self.steps(run_id), Path(out)
        if fmt == "csv":
            frame.to_csv(out, index=False)
        elif fmt == "parquet":
            frame.to_parquet(out, index=False)
        else:
            raise ValueError(f"format must be csv or parquet, got {fmt!r}")
        return out
