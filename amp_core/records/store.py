"""RunStore: runs, lanes, columnar step chunks, summary levels, events and gradient statistics, so a CLI run, a
Monitor script or a torchrun job can write while a dashboard reads; liveness of writers, export, copying runs between
stores. `records.opening.open_store(target)` opens one: a `postgresql://` URL opens the PostgreSQL store
(records/postgres.py, for clusters and teams), anything else a SQLite file (stdlib sqlite3, WAL; the embedded
default, with migration of older files).

Every query here is written once, in the SQL both engines speak (`?` parameters, `ON CONFLICT ... DO UPDATE`); what
differs (connections, transactions, column types, versioning, which errors mean "the server is gone") is in the two
store classes and `postgres.dialect_schema`.

Schema 2 (this one): a track (one lane's records from one rank) is stored as chunks — `chunks` holds a chunk's step
range, record count and its marked records, `chunk_columns` one encoded array per column (see records/chunks.py and
records/codec.py) — and as summary blocks in `levels` (records/levels.py). `tracks` holds each track's record count
and last step, updated in the same transaction as its chunks: listing runs reads it and never counts records.
`gradstats` holds one row per sampled lane step: every parameter's statistics as zlib-compressed JSON (a histogram of
161 mostly-zero bins compresses ~10x; schema 1's row per parameter took a 4 KiB overflow page each).
Schema 1 (one row per step in `steps`) is migrated in place after a backup copy.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sqlite3
import threading
import time
import zlib
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil

from amp_core.records.chunks import TrackFlush, encode_track
from amp_core.records.codec import DamagedData, decode_array, decode_columns, decode_rows
from amp_core.records.levels import (
    BLOCK_BUCKETS,
    BUCKET_COLUMNS,
    Buckets,
    concat,
    empty_buckets,
    level_steps,
    select,
)
from amp_core.records.schema import STEP_COLUMNS, Event, GradStats, empty_steps_frame, steps_frame, typed
from amp_core.records.tracks import TrackRecords

APPLICATION_ID = 0x414D504C  # "AMPL": marks a file as ours, so a foreign database is never touched
SCHEMA_VERSION = 3
"""3: the requests table (a page asks a live process for a probe at its next step); a schema-2 file gains it when
opened (nothing else changes, so the migration is that CREATE TABLE)."""
LIVE_STATUSES = ("pending", "running", "paused")
TRAINING_STATUSES = ("pending", "running")
"""A run starting or training: its writer is using the cores (a paused one is live but idle)."""
STALE_AFTER_S = 60.0
"""A run written from another host or pid namespace is interrupted once its writer has not flushed for this long."""
LIVENESS_EVERY_S = 2.0
"""Readers look for interrupted runs at most this often."""
CACHE_BYTES = 64 * 2**20
"""Decoded chunk columns a StoredTrack keeps (chunks never change once a later one exists)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, name TEXT NOT NULL, workload TEXT NOT NULL, modes TEXT NOT NULL,
    status TEXT NOT NULL, config TEXT NOT NULL, device TEXT NOT NULL, torch_version TEXT NOT NULL,
    host TEXT NOT NULL, pid INTEGER NOT NULL, created_at REAL NOT NULL, ended_at REAL,
    process_started_at REAL, pid_namespace TEXT NOT NULL DEFAULT '', heartbeat_at REAL);
CREATE TABLE IF NOT EXISTS lanes (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, mode TEXT NOT NULL, status TEXT NOT NULL,
    error TEXT NOT NULL DEFAULT '', meta TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (run_id, lane));
CREATE TABLE IF NOT EXISTS tracks (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, rank INTEGER NOT NULL, mode TEXT NOT NULL,
    records INTEGER NOT NULL, first_step INTEGER NOT NULL, last_step INTEGER NOT NULL, t_last REAL,
    stats TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (run_id, lane, rank)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS chunks (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, rank INTEGER NOT NULL, first_step INTEGER NOT NULL,
    last_step INTEGER NOT NULL, records INTEGER NOT NULL, marks INTEGER NOT NULL, marks_data BLOB,
    PRIMARY KEY (run_id, lane, rank, first_step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS chunk_columns (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, rank INTEGER NOT NULL, name TEXT NOT NULL,
    first_step INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (run_id, lane, rank, name, first_step));
CREATE TABLE IF NOT EXISTS levels (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, rank INTEGER NOT NULL, level INTEGER NOT NULL,
    block INTEGER NOT NULL, data BLOB NOT NULL, PRIMARY KEY (run_id, lane, rank, level, block));
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, lane INTEGER, step INTEGER,
    kind TEXT NOT NULL, message TEXT NOT NULL, t_wall_s REAL NOT NULL, data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_run ON events (run_id, id);
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
    asked_at REAL NOT NULL, answered_at REAL, message TEXT NOT NULL DEFAULT '', answer BLOB);
CREATE INDEX IF NOT EXISTS requests_run ON requests (run_id, status);
CREATE TABLE IF NOT EXISTS gradstats (
    run_id TEXT NOT NULL, lane INTEGER NOT NULL, step INTEGER NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (run_id, lane, step));
"""


def pack_grad_stats(stats: list[GradStats]) -> bytes:
    """One sampled lane step's gradient statistics (every parameter) as zlib-compressed JSON."""
    return _pack_stats([s.to_dict() for s in stats])


def unpack_grad_stats(data: bytes) -> list[GradStats]:
    """What `pack_grad_stats` packed, by parameter name."""
    return [GradStats(**fields) for fields in sorted(json.loads(zlib.decompress(data)), key=lambda f: f["param"])]


def _pack_stats(stats: list[dict]) -> bytes:
    return zlib.compress(json.dumps(stats, default=str).encode(), 6)


def _create_tables(conn, schema: str = SCHEMA) -> None:
    """`schema` statement by statement, in the caller's transaction (sqlite3's executescript would commit it)."""
    for statement in schema.split(";"):
        if statement.strip():
            conn.execute(statement)


class StoreError(RuntimeError):
    """The store cannot be used (a damaged file, another program's tables, a newer AMP Lab's schema), or some of its
    records cannot be read. The store is left untouched."""


class StoreUnreachable(StoreError):
    """The store's server cannot be reached now (it went away, or is not up yet). A writer keeps its records and
    tries again; a page says so and looks again."""


BACKLOG_RECORDS = 1_000_000
"""Default bound on the step records a writer holds for a store it cannot reach (`AMP_LAB_STORE_BACKLOG`)."""
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def default_target() -> str:
    """$AMP_LAB_STORE (a file path or a PostgreSQL URL), else ~/.amp_lab/runs.sqlite3."""
    return os.environ.get("AMP_LAB_STORE") or str(Path.home() / ".amp_lab" / "runs.sqlite3")


def is_postgres_url(target: str | os.PathLike) -> bool:
    return isinstance(target, str) and target.startswith(POSTGRES_SCHEMES)


def backlog_setting() -> int:
    """$AMP_LAB_STORE_BACKLOG (step records), else BACKLOG_RECORDS; StoreError naming the setting if it is bad."""
    raw = os.environ.get("AMP_LAB_STORE_BACKLOG", "")
    try:
        value = int(raw) if raw else BACKLOG_RECORDS
    except ValueError:
        value = -1
    if value < 1:
        raise StoreError(f"AMP_LAB_STORE_BACKLOG must be a whole number of step records >= 1, got {raw!r}")
    return value


def _pid_namespace() -> str:
    """This process's pid namespace ('' where there is none to read): pids compare only inside one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_identity() -> tuple[str, int, float, str]:
    """(host, pid, process start time, pid namespace): what tells this writer apart from a later one with its pid."""
    return socket.gethostname(), os.getpid(), psutil.Process().create_time(), _pid_namespace()


def _dicts(cursor) -> list[dict[str, Any]]:
    """A cursor's rows as dicts by column name (both engines' cursors have `description`)."""
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _frame(cursor) -> pd.DataFrame:
    """A cursor's rows as a frame (numbers with NULLs as float NaN, as pandas reads SQL)."""
    names = [column[0] for column in cursor.description]
    return pd.DataFrame.from_records(cursor.fetchall(), columns=names, coerce_float=True)


class RunStore:
    """What every store does, written once in the SQL both engines speak. Safe to use from several threads and
    processes: a write is one transaction; reads use one connection per thread, and nested reads one transaction.
    Open one with `records.opening.open_store`; the subclasses supply connections, transactions and their engine's
    errors."""

    location: str
    """Where the store is, safe to show (a PostgreSQL URL without its password)."""
    DRIVER_ERRORS: tuple[type[Exception], ...] = ()
    """The driver's exceptions; they leave the store as StoreError (StoreUnreachable when the server is gone)."""
    BEGIN_WRITE = "BEGIN"
    BEGIN_READ = "BEGIN"

    def __init__(self, *, stale_after_s: float = STALE_AFTER_S, backlog_records: int = BACKLOG_RECORDS):
        self.stale_after_s = stale_after_s
        self.backlog_records = backlog_records
        """Step records a writer holds for this store while it cannot be reached (see RecordSink)."""
        self._local = threading.local()
        self._liveness_at = 0.0

    # --- what a subclass supplies ----------------------------------------------------------------------------
    def _connect(self):
        """A new connection (autocommit; transactions are begun explicitly)."""
        raise NotImplementedError

    def _writer(self):
        """A context manager giving the connection one write transaction runs on."""
        raise NotImplementedError

    def _error(self, exc: Exception) -> StoreError:
        return StoreError(f"store {self.location}: {exc}")

    def _broken(self, conn) -> bool:
        """Whether a connection is lost for good (the server went away) and must be opened again."""
        return False

    def _release_reader(self) -> None:
        """A read transaction ended on this thread (SQLite keeps the thread's connection; PostgreSQL pools it)."""

    # --- transactions ----------------------------------------------------------------------------------------
    @contextmanager
    def _write(self):
        try:
            with self._writer() as conn:
                conn.execute(self.BEGIN_WRITE)
                try:
                    yield conn
                except BaseException:
                    with suppress(*self.DRIVER_ERRORS):  # a lost connection: the server rolled it back itself
                        conn.execute("ROLLBACK")
                    raise
                conn.execute("COMMIT")
        except self.DRIVER_ERRORS as exc:
            raise self._error(exc) from exc

    def _reader(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            self._local.depth = 0
            conn = self._local.conn = self._connect()
        return conn

    def _drop_reader(self) -> None:
        conn, self._local.conn, self._local.depth = getattr(self._local, "conn", None), None, 0
        if conn is not None:
            with suppress(*self.DRIVER_ERRORS):  # it was broken: closing it only frees it
                conn.close()

    def _begin_read(self):
        """This thread's connection in a new read transaction; a connection the server dropped since its last read
        (the server restarted) is opened again once."""
        conn = self._reader()
        try:
            conn.execute(self.BEGIN_READ)
        except self.DRIVER_ERRORS:
            if not self._broken(conn):
                raise
            self._drop_reader()
            conn = self._reader()
            conn.execute(self.BEGIN_READ)
        return conn

    @contextmanager
    def _read(self):
        """A read on this thread's connection; nested reads share one transaction (one consistent snapshot)."""
        try:
            conn = self._begin_read() if getattr(self._local, "depth", 0) == 0 else self._reader()
            self._local.depth += 1
            try:
                yield conn
            finally:
                self._local.depth -= 1
                if self._local.depth == 0:
                    conn.execute("COMMIT")
                    self._release_reader()
        except self.DRIVER_ERRORS as exc:
            if getattr(self._local, "depth", 0) == 0 and self._broken(getattr(self._local, "conn", None)):
                self._drop_reader()
            raise self._error(exc) from exc

    def snapshot(self):
        """Reads inside `with store.snapshot():` on this thread all see the store as it was at the first one."""
        return self._read()

    def reachable(self) -> bool:
        """Whether the store answers now (a page that showed it unreachable asks this to know when to redraw)."""
        try:
            with self._read() as conn:
                conn.execute("SELECT 1").fetchone()
        except StoreUnreachable:
            return False
        return True

    # --- writing -------------------------------------------------------------------------------------------
    def create_run(self, run_id: str, config: dict[str, Any], device: str, torch_version: str,
                   lane_meta: list[dict] | None = None, lane_modes: list[str] | None = None) -> None:
        """Register a run and its lanes: one per mode, or one per entry of `lane_modes` (a run of seed replicates has
        several lanes per mode); `lane_meta`: extra facts per lane, e.g. its seed."""
        modes = list(config["modes"])
        lanes = list(lane_modes) if lane_modes is not None else modes
        host, pid, started, namespace = _process_identity()
        now = time.time()
        meta = lane_meta or [{} for _ in lanes]
        with self._write() as conn:
            conn.execute(
                "INSERT INTO runs (run_id, name, workload, modes, status, config, device, torch_version, host, pid, "
                "created_at, process_started_at, pid_namespace, heartbeat_at) "
                "VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, config.get("name", ""), config["workload"], json.dumps(modes), json.dumps(config), device,
                 torch_version, host, pid, now, started, namespace, now))
            conn.executemany("INSERT INTO lanes (run_id, lane, mode, status, error, meta) "
                             "VALUES (?, ?, ?, 'running', '', ?)",
                             [(run_id, i, mode, json.dumps(m)) for i, (mode, m) in enumerate(zip(lanes, meta,
                                                                                                   strict=True))])

    def set_run_status(self, run_id: str, status: str, ended: bool = False) -> None:
        with self._write() as conn:
            conn.execute("UPDATE runs SET status = ?, ended_at = COALESCE(?, ended_at) WHERE run_id = ?",
                         (status, time.time() if ended else None, run_id))

    def set_lane_status(self, run_id: str, lane: int, status: str, error: str = "") -> None:
        with self._write() as conn:
            conn.execute("UPDATE lanes SET status = ?, error = ? WHERE run_id = ? AND lane = ?",
                         (status, error, run_id, lane))

    @staticmethod
    def _write_track(conn, run_id: str, flush: TrackFlush | None) -> None:
        if flush is None:
            return
        key = (run_id, flush.lane, flush.rank)
        for chunk in flush.chunks:
            conn.execute("INSERT INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, lane, rank, "
                         "first_step) DO UPDATE SET last_step = excluded.last_step, records = excluded.records, "
                         "marks = excluded.marks, marks_data = excluded.marks_data",
                         (*key, chunk.first_step, chunk.last_step, chunk.records, chunk.marks, chunk.marks_data))
            conn.executemany("INSERT INTO chunk_columns VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, lane, rank, "
                             "name, first_step) DO UPDATE SET data = excluded.data",
                             [(*key, name, chunk.first_step, data) for name, data in chunk.columns.items()])
        conn.executemany("INSERT INTO levels VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, lane, rank, level, block) "
                         "DO UPDATE SET data = excluded.data",
                         [(*key, level, block, data) for level, block, data in flush.blocks])
        conn.execute(
            "INSERT INTO tracks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, lane, rank) DO UPDATE SET "
            "records = excluded.records, last_step = excluded.last_step, t_last = excluded.t_last, "
            "stats = excluded.stats",
            (*key, flush.mode, flush.records, flush.first_step, flush.last_step, flush.t_last,
             json.dumps(flush.stats or {})))

    def write_flush(self, run_id: str, tracks: list[TrackFlush] = (), events: list[Event] = (),
                    grad_stats: list[tuple[int, int, bytes]] = ()) -> None:
        """One transaction for what a writer gathered since its last flush (a reader never sees half of it); it is
        also the writer's heartbeat. `grad_stats`: (lane, step, `pack_grad_stats` of that step)."""
        with self._write() as conn:
            for flush in tracks:
                self._write_track(conn, run_id, flush)
            conn.executemany(
                "INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(e.run_id, e.lane, e.step, e.kind, e.message, e.t_wall_s, json.dumps(e.data, default=str))
                 for e in events])
            conn.executemany("INSERT INTO gradstats VALUES (?, ?, ?, ?) ON CONFLICT (run_id, lane, step) "
                             "DO UPDATE SET data = excluded.data",
                             [(run_id, lane, step, data) for lane, step, data in grad_stats])
            now = time.time()
            revived = conn.execute("UPDATE runs SET status = 'running', ended_at = NULL WHERE run_id = ? AND "
                                   "status = 'interrupted'", (run_id,)).rowcount
            if revived:  # a reader elsewhere took this writer for gone (it was paused, or its steps are slow)
                conn.execute("UPDATE lanes SET status = 'running' WHERE run_id = ? AND status = 'interrupted'",
                             (run_id,))
                conn.execute("INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) "
                             "VALUES (?, NULL, NULL, 'resumed', ?, ?, '{}')",
                             (run_id, "the run's process is still writing: it had been marked interrupted", now))
            conn.execute("UPDATE runs SET heartbeat_at = ? WHERE run_id = ?", (now, run_id))

    def add_events(self, events: list[Event]) -> None:
        """Events about runs written after the fact by a process that is not their writer (a replay's report on a
        stored run): inserted only, the runs' status and heartbeat left as they are."""
        with self._write() as conn:
            conn.executemany(
                "INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(e.run_id, e.lane, e.step, e.kind, e.message, e.t_wall_s, json.dumps(e.data, default=str))
                 for e in events])

    # --- requests from a page to a live process (amp_core.records.requests) ---------------------------------
    def add_request(self, run_id: str, kind: str) -> int:
        """A new open request for run `run_id`'s process; its id."""
        with self._write() as conn:
            return int(conn.execute("INSERT INTO requests (run_id, kind, status, asked_at) VALUES (?, ?, 'open', ?) "
                                    "RETURNING id", (run_id, kind, time.time())).fetchall()[0][0])

    def take_requests(self, run_id: str) -> list[tuple[int, str]]:
        """The open requests of a run as (id, kind), now marked taken (the process performs them). A read first: a
        write transaction only when there is one (a process looks at every flush)."""
        with self._read() as conn:
            rows = conn.execute("SELECT id, kind FROM requests WHERE run_id = ? AND status = 'open' ORDER BY id",
                                (run_id,)).fetchall()
        taken = []
        if rows:
            with self._write() as conn:
                for request_id, kind in rows:
                    if conn.execute("UPDATE requests SET status = 'taken' WHERE id = ? AND status = 'open'",
                                    (request_id,)).rowcount:
                        taken.append((int(request_id), str(kind)))
        return taken

    def answer_request(self, request_id: int, status: str, message: str, answer: bytes | None = None) -> None:
        """Close a request: answered (with `answer`, zlib-compressed JSON) or refused, with a message for the page."""
        with self._write() as conn:
            conn.execute("UPDATE requests SET status = ?, message = ?, answer = ?, answered_at = ? WHERE id = ?",
                         (status, message, answer, time.time(), request_id))

    def request(self, request_id: int) -> dict[str, Any] | None:
        """One request: id, run_id, kind, status (open, taken, answered, refused), asked_at, answered_at, message,
        answer (bytes or None)."""
        with self._read() as conn:
            rows = _dicts(conn.execute("SELECT * FROM requests WHERE id = ?", (request_id,)))
        return rows[0] if rows else None

    # --- liveness ------------------------------------------------------------------------------------------
    def _writer_alive(self, row: dict[str, Any], now: float) -> bool:
        """In this host's pid namespace the writer is its pid *and* its start time (a pid can be reused: containers
        restart from pid 1); elsewhere (another host, another container) only its heartbeat can tell."""
        host, _, _, namespace = _process_identity()
        if row["host"] == host and (row["pid_namespace"] == namespace or not (row["pid_namespace"] and namespace)):
            try:
                started = psutil.Process(row["pid"]).create_time()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return False
            return row["process_started_at"] is None or abs(started - row["process_started_at"]) < 1.0
        return now - (row["heartbeat_at"] or row["created_at"]) < self.stale_after_s

    def mark_interrupted(self) -> list[str]:
        """Runs left live by a writer that is gone become 'interrupted' (their records stay)."""
        self._liveness_at = time.monotonic()
        now = time.time()
        with self._read() as conn:
            live = _dicts(conn.execute(f"SELECT * FROM runs WHERE status IN {LIVE_STATUSES}"))
        gone = [(row["run_id"], row["heartbeat_at"]) for row in live if not self._writer_alive(row, now)]
        if not gone:
            return []
        dead = []
        with self._write() as conn:
            for run_id, beat in gone:  # unless the writer flushed meanwhile
                if conn.execute(f"UPDATE runs SET status = 'interrupted', ended_at = ? WHERE run_id = ? AND status IN "
                                f"{LIVE_STATUSES} AND COALESCE(heartbeat_at, -1) = ?",
                                (now, run_id, -1 if beat is None else beat)).rowcount:
                    dead.append(run_id)
                    conn.execute("UPDATE lanes SET status = 'interrupted' WHERE run_id = ? AND status = 'running'",
                                 (run_id,))
                    conn.execute("INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) "
                                 "VALUES (?, NULL, NULL, 'interrupted', ?, ?, '{}')",
                                 (run_id, "the process running this run ended without finishing it", now))
        return dead

    def check_liveness(self) -> None:
        """`mark_interrupted`, at most every LIVENESS_EVERY_S (readers call this as they poll)."""
        if time.monotonic() - self._liveness_at >= LIVENESS_EVERY_S:
            self.mark_interrupted()

    # --- reading -------------------------------------------------------------------------------------------
    def runs(self) -> pd.DataFrame:
        """Every run, newest first, with the number of step records written (kept per track, not counted)."""
        with self._read() as conn:
            frame = _frame(conn.execute(
                "SELECT r.run_id, r.name, r.workload, r.modes, r.status, r.device, r.created_at, r.ended_at, "
                "CAST(COALESCE((SELECT SUM(t.records) FROM tracks t WHERE t.run_id = r.run_id), 0) AS BIGINT) "
                "AS steps_written FROM runs r ORDER BY r.created_at DESC"))
        frame["modes"] = [json.loads(modes) for modes in frame["modes"]]
        return frame

    def running_here(self) -> list[str]:
        """The runs starting or training (status pending or running) whose writer is on this host (by name;
        `check_liveness` first, so a writer that is gone is not counted), newest first."""
        host = _process_identity()[0]
        with self._read() as conn:
            rows = conn.execute("SELECT run_id FROM runs WHERE status IN (?, ?) AND host = ? ORDER BY created_at DESC",
                                (*TRAINING_STATUSES, host)).fetchall()
        return [row[0] for row in rows]

    def run(self, run_id: str) -> dict[str, Any] | None:
        """A run's row with its config (dict) and lanes (list of dicts, meta a dict); None if unknown."""
        with self._read() as conn:
            rows = _dicts(conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)))
            lanes = _dicts(conn.execute("SELECT * FROM lanes WHERE run_id = ? ORDER BY lane", (run_id,)))
        if not rows:
            return None
        for lane in lanes:
            lane["meta"] = json.loads(lane["meta"])
        out = rows[0]
        out["config"], out["modes"], out["lanes"] = json.loads(out["config"]), json.loads(out["modes"]), lanes
        return out

    def tracks(self, run_id: str) -> list[dict[str, Any]]:
        """A run's tracks: lane, rank, mode, records, first_step, last_step, t_last, stats."""
        with self._read() as conn:
            rows = conn.execute("SELECT lane, rank, mode, records, first_step, last_step, t_last, stats FROM tracks "
                                "WHERE run_id = ? ORDER BY lane, rank", (run_id,)).fetchall()
        return [{"lane": lane, "rank": rank, "mode": mode, "records": records, "first_step": first,
                 "last_step": last, "t_last": t_last, "stats": json.loads(stats)}
                for lane, rank, mode, records, first, last, t_last, stats in rows]

    def track_sources(self, run_id: str, reuse: list[StoredTrack] | None = None,
                      problems: list[str] | None = None) -> list[StoredTrack]:
        """A StoredTrack per track of a run; those in `reuse` are refreshed and kept (with what they cached). A
        StoredTrack is for one thread at a time. `problems`: a list the new ones report damage into."""
        known = {(t.lane, t.rank): t for t in reuse or () if isinstance(t, StoredTrack) and t.run_id == run_id}
        out = []
        for row in self.tracks(run_id):
            source = known.get((row["lane"], row["rank"])) or StoredTrack(self, run_id, row["lane"], row["mode"],
                                                                            row["rank"], problems)
            source.refresh(row)
            out.append(source)
        return out

    def lane_step_counts(self, run_id: str) -> dict[int, int]:
        """Step records written per lane (all ranks), as kept with the tracks."""
        counts: dict[int, int] = {}
        for track in self.tracks(run_id):
            counts[track["lane"]] = counts.get(track["lane"], 0) + track["records"]
        return counts

    def steps(self, run_id: str, start: int = 0, stop: int | None = None, strict: bool = True,
              problems: list[str] | None = None) -> pd.DataFrame:
        """Every step record of a run in [start, stop) (all tracks), ordered by step, then lane and rank.
        `strict`: StoreError if a chunk is damaged; else its records are left out and said in `problems`."""
        stop = np.iinfo(np.int64).max if stop is None else stop
        with self._read():
            parts = []
            for source in self.track_sources(run_id, problems=problems):
                source.strict = strict
                parts.append((run_id, source.lane, source.mode, source.rank, source.raw_rows(start, stop)))
        parts = [part for part in parts if len(part[-1]["step"])]
        if not parts:
            return empty_steps_frame()
        frame = steps_frame(parts)
        order = np.lexsort((frame["rank"].to_numpy(), frame["lane"].to_numpy(), frame["step"].to_numpy()))
        return frame.iloc[order].reset_index(drop=True)

    def events(self, run_id: str) -> pd.DataFrame:
        with self._read() as conn:
            frame = _frame(conn.execute("SELECT * FROM events WHERE run_id = ? ORDER BY id", (run_id,)))
        frame["data"] = frame["data"].map(json.loads)
        return frame

    def grad_stats(self, run_id: str, lane: int, step: int | None = None) -> list[GradStats]:
        """Gradient statistics of a lane at one step (all parameters), or at every sampled step."""
        query, params = "SELECT data FROM gradstats WHERE run_id = ? AND lane = ?", [run_id, lane]
        if step is not None:
            query, params = query + " AND step = ?", [*params, step]
        with self._read() as conn:
            rows = conn.execute(query + " ORDER BY step", params).fetchall()
        return [stats for (data,) in rows for stats in unpack_grad_stats(data)]  # by step, then parameter

    def grad_stat_steps(self, run_id: str, lane: int) -> list[int]:
        with self._read() as conn:
            rows = conn.execute("SELECT DISTINCT step FROM gradstats WHERE run_id = ? AND lane = ? ORDER BY step",
                                (run_id, lane)).fetchall()
        return [r[0] for r in rows]

    def export(self, run_id: str, fmt: str, out: str | Path) -> Path:
        """Write every step record of a run to CSV or Parquet; returns the path. StoreError if a chunk is damaged
        (an export never leaves records out silently)."""
        if fmt not in ("csv", "parquet"):
            raise ValueError(f"format must be csv or parquet, got {fmt!r}")
        if self.run(run_id) is None:
            raise KeyError(f"no run {run_id!r} in {self.location}")
        frame, out = self.steps(run_id), Path(out)
        if fmt == "csv":
            frame.to_csv(out, index=False)
        else:
            frame.to_parquet(out, index=False)
        return out


class SQLiteStore(RunStore):
    """One SQLite file (WAL journal): writes open a connection each, reads use one connection per thread."""

    DRIVER_ERRORS = (sqlite3.DatabaseError,)
    BEGIN_WRITE = "BEGIN IMMEDIATE"

    def __init__(self, path: str | Path, *, stale_after_s: float = STALE_AFTER_S,
                 backlog_records: int = BACKLOG_RECORDS):
        super().__init__(stale_after_s=stale_after_s, backlog_records=backlog_records)
        self.path = Path(path)
        self.location = str(self.path)
        self.backup_path: Path | None = None
        """Where the copy of a store migrated from an older schema was put (None: nothing was migrated)."""
        version = self._check_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if version == 1:
            self._migrate_v1()
        with self._write() as conn:
            _create_tables(conn)
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self.mark_interrupted()

    def _check_file(self) -> int:
        """The file's schema version (0: new or empty); StoreError, touching nothing, if it is not ours to open."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return 0
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a folder, not a store file")
        # SQLite reads the header, never open(): closing any other descriptor of the file drops every POSIX lock
        # this process's connections hold on it (sqlite.org/howtocorrupt.html, 2.2); a writer in another process then
        # took itself for the last connection, checkpointed and removed the WAL under a reader here, whose next write
        # left the file malformed (a bench that opened a fresh RunStore while a server's run wrote).
        try:
            with closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)) as conn:
                app_id = conn.execute("PRAGMA application_id").fetchone()[0]
                tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
                version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            if exc.sqlite_errorcode == sqlite3.SQLITE_NOTADB:
                raise StoreError(f"{self.path} is not a SQLite database (damaged or another kind of file); AMP Lab "
                                 "left it untouched. Move it away or set AMP_LAB_STORE to another path.") from None
            raise StoreError(f"{self.path} is damaged ({exc}); AMP Lab left it untouched. "
                             "Move it away or set AMP_LAB_STORE to another path.") from None
        if app_id != APPLICATION_ID and tables:
            raise StoreError(f"{self.path} belongs to another program (tables: {', '.join(tables[:5])}); "
                             "AMP Lab left it untouched. Set AMP_LAB_STORE to another path.")
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path} was written by a newer AMP Lab (store schema {version}; this one reads "
                             f"schema {SCHEMA_VERSION} and older); AMP Lab left it untouched. Upgrade AMP Lab, or set "
                             "AMP_LAB_STORE to another path.")
        return version

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    @contextmanager
    def _writer(self):
        """This thread's write connection, kept open like its reader: opening one (and closing the file's last one,
        which checkpoints the WAL) cost about a third of a Monitor's flush."""
        conn = getattr(self._local, "writer", None)
        if conn is None:
            conn = self._local.writer = self._connect()
        yield conn

    def _migrate_v1(self) -> None:
        """Schema 1 (one row per step) -> 2, in place, in one transaction, after a backup copy of the file."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup = self.path.with_name(f"{self.path.stem}.schema1-backup-{stamp}{self.path.suffix}")
        try:
            with closing(sqlite3.connect(self.path, timeout=30)) as source, closing(sqlite3.connect(backup)) as copy:
                source.backup(copy)
        except (sqlite3.DatabaseError, OSError) as exc:
            raise StoreError(f"{self.path} uses an older store schema (1); a backup copy could not be made before "
                             f"migrating it ({exc}), so it was left untouched") from None
        self.backup_path = backup
        try:
            with self._write() as conn:
                if conn.execute("PRAGMA user_version").fetchone()[0] != 1:
                    return  # another process migrated it meanwhile
                for statement in ("ALTER TABLE runs ADD COLUMN process_started_at REAL",
                                  "ALTER TABLE runs ADD COLUMN pid_namespace TEXT NOT NULL DEFAULT ''",
                                  "ALTER TABLE runs ADD COLUMN heartbeat_at REAL",
                                  "ALTER TABLE lanes ADD COLUMN meta TEXT NOT NULL DEFAULT '{}'"):
                    conn.execute(statement)
                conn.execute("ALTER TABLE gradstats RENAME TO gradstats_schema1")
                _create_tables(conn)
                samples: dict[tuple[str, int, int], list[dict]] = {}
                for run_id, lane, step, data in conn.execute("SELECT run_id, lane, step, data FROM gradstats_schema1 "
                                                             "ORDER BY run_id, lane, step, param"):
                    samples.setdefault((run_id, lane, step), []).append(json.loads(data))
                conn.executemany("INSERT INTO gradstats VALUES (?, ?, ?, ?)",
                                 [(*key, _pack_stats(stats)) for key, stats in samples.items()])
                conn.execute("DROP TABLE gradstats_schema1")
                old = [row[1] for row in conn.execute("PRAGMA table_info(steps)")]
                tracks = conn.execute("SELECT DISTINCT run_id, lane FROM steps ORDER BY run_id, lane").fetchall()
                for run_id, lane in tracks:
                    rows = conn.execute(f"SELECT {', '.join(old)} FROM steps WHERE run_id = ? AND lane = ? "
                                        "ORDER BY step", (run_id, lane)).fetchall()
                    mode = rows[0][old.index("mode")]
                    track = TrackRecords(run_id, lane, mode)
                    track.extend({name: typed([row[old.index(name)] if name in old else None for row in rows], dtype)
                                  for name, dtype in STEP_COLUMNS.items()})
                    self._write_track(conn, run_id, encode_track(track))
                conn.execute("DROP TABLE steps")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (StoreError, ValueError) as exc:
            raise StoreError(f"{self.path} could not be migrated from store schema 1 ({exc}); it was left as it was "
                             f"(a copy is at {backup})") from None
        with closing(self._connect()) as conn:
            conn.execute("VACUUM")  # schema 1 rows took ~500 bytes a step; give the space back


COPIED_TABLES = ("runs", "lanes", "tracks", "chunks", "chunk_columns", "levels", "gradstats")
"""A run's rows, table by table, as they are (events apart: their ids are the target's own)."""


def copy_runs(source: RunStore, target: RunStore) -> tuple[list[str], list[str], list[str]]:
    """Copy every run of `source` that `target` does not hold and that has ended, each in one target transaction;
    returns (copied, already there, still live) run ids. Either store may be SQLite or PostgreSQL."""
    source.mark_interrupted()
    with source._read() as conn:
        runs = _dicts(conn.execute("SELECT run_id, status FROM runs ORDER BY created_at"))
    with target._read() as conn:
        present = {row[0] for row in conn.execute("SELECT run_id FROM runs")}
    copied, there, live = [], [], []
    for row in runs:
        run_id = row["run_id"]
        if run_id in present:
            there.append(run_id)
            continue
        if row["status"] in LIVE_STATUSES:
            live.append(run_id)
            continue
        with source._read() as src, target._write() as dst:
            for table in COPIED_TABLES:
                cursor = src.execute(f"SELECT * FROM {table} WHERE run_id = ?", (run_id,))
                names = [column[0] for column in cursor.description]
                rows = cursor.fetchall()
                if rows:
                    dst.executemany(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                                    rows)
            events = src.execute("SELECT run_id, lane, step, kind, message, t_wall_s, data FROM events "
                                 "WHERE run_id = ? ORDER BY id", (run_id,)).fetchall()
            dst.executemany("INSERT INTO events (run_id, lane, step, kind, message, t_wall_s, data) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)", events)
        copied.append(run_id)
    return copied, there, live


class _ByteCache:
    """Least recently used decoded arrays, up to a byte budget."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key):
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key, value: np.ndarray) -> None:
        self._items[key] = value
        self.used += value.nbytes
        while self.used > self.budget and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self.used -= old.nbytes


def _missing(name: str, count: int) -> np.ndarray:
    """A column a chunk written before the column existed does not hold: NaN, or 0 / False."""
    dtype = STEP_COLUMNS[name]
    return np.full(count, np.nan if dtype.kind == "f" else 0, dtype=dtype)


class StoredTrack:
    """One track in the store, read as a track source (see amp_core.records.query). It remembers what never changes
    (complete summary blocks, chunks other than the last), so a reader that polls reads only what is new.

    A chunk or block that cannot be decoded is left out and said in `problems` (or StoreError when `strict`)."""

    def __init__(self, store: RunStore, run_id: str, lane: int, mode: str, rank: int = 0,
                 problems: list[str] | None = None):
        self.store, self.run_id, self.lane, self.mode, self.rank = store, run_id, lane, mode, rank
        self.strict = False
        self.problems: list[str] = [] if problems is None else problems
        self._extent = (0, 0, -1)
        self._stats: dict = {}
        self._blocks: dict[tuple[int, int], Buckets] = {}
        """Decoded columns of summary blocks (each column decoded when first asked for)."""
        self._block_blobs: dict[tuple[int, int], bytes | None] = {}
        self._columns = _ByteCache(CACHE_BYTES)
        self._median = (-1, float("nan"))
        self._marks: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    @property
    def _key(self) -> tuple[str, int, int]:
        return self.run_id, self.lane, self.rank

    def refresh(self, row: dict) -> None:
        self._extent = (row["records"], row["first_step"], row["last_step"]) if row["records"] else (0, 0, -1)
        self._stats = row["stats"]

    def extent(self) -> tuple[int, int, int]:
        return self._extent

    def _damaged(self, what: str, why: Exception) -> None:
        message = (f"Run {self.run_id}, lane {self.lane} ({self.mode}{f', rank {self.rank}' if self.rank else ''}): "
                   f"{what} could not be read ({why}); they are left out, the rest of the run is shown.")
        if self.strict:
            raise StoreError(message.replace("; they are left out, the rest of the run is shown.", "."))
        if message not in self.problems:
            self.problems.append(message)

    def _chunks(self, conn, start: int, stop: int, where: str = "", columns: str = "first_step, last_step, records"):
        return conn.execute(
            f"SELECT {columns} FROM chunks WHERE run_id = ? AND lane = ? AND rank = ? AND first_step >= COALESCE("
            "(SELECT MAX(first_step) FROM chunks WHERE run_id = ? AND lane = ? AND rank = ? AND first_step <= ?), ?) "
            f"AND first_step < ? {where} ORDER BY first_step", (*self._key, *self._key, start, start, stop)).fetchall()

    def _read_chunks(self, conn, chunks: list[tuple[int, int, int]], names: list[str]) -> list[dict[str, np.ndarray]]:
        wanted = [(chunk, name) for chunk in chunks for name in names if self._columns.get((*chunk, name)) is None]
        if wanted:
            firsts = sorted({chunk[0] for chunk, _ in wanted})
            needed = sorted({name for _, name in wanted})
            rows = conn.execute(
                f"SELECT name, first_step, data FROM chunk_columns WHERE run_id = ? AND lane = ? AND rank = ? AND "
                f"name IN ({', '.join('?' * len(needed))}) AND first_step BETWEEN ? AND ?",
                (*self._key, *needed, firsts[0], firsts[-1])).fetchall()
            by_chunk = {chunk[0]: chunk for chunk, _ in wanted}
            for name, first, data in rows:
                chunk = by_chunk.get(first)
                if chunk is None:
                    continue
                try:
                    values = decode_array(data)
                    if len(values) < chunk[2]:
                        raise DamagedData(f"{len(values)} values where {chunk[2]} records were written")
                except DamagedData as exc:
                    self._damaged(f"the records of steps {chunk[0]}–{chunk[1]} ('{name}')", exc)
                    values = None
                self._columns.put((*chunk, name), values if values is not None else np.empty(0))
        out = []
        for chunk in chunks:
            columns = {}
            for name in names:
                values = self._columns.get((*chunk, name))
                if values is None:  # the chunk was written before this column existed
                    values = _missing(name, chunk[2])
                columns[name] = values
            if any(len(values) < chunk[2] for values in columns.values()):
                continue  # damaged: left out (said in problems)
            out.append({name: values[:chunk[2]] for name, values in columns.items()})
        return out

    def raw_rows(self, start: int, stop: int, names=None) -> dict[str, np.ndarray]:
        names = list(dict.fromkeys(["step", *(names or STEP_COLUMNS)]))
        with self.store._read() as conn:
            chunks = self._chunks(conn, start, stop)
            parts = self._read_chunks(conn, chunks, names)
        return _cut(parts, names, start, stop)

    def tail(self, records: int, names=None) -> dict[str, np.ndarray]:
        names = list(dict.fromkeys(["step", *(names or STEP_COLUMNS)]))
        chunks, held = [], 0
        with self.store._read() as conn:
            for chunk in conn.execute("SELECT first_step, last_step, records FROM chunks WHERE run_id = ? AND "
                                      "lane = ? AND rank = ? ORDER BY first_step DESC", self._key):
                chunks.insert(0, chunk)
                held += chunk[2]
                if held >= records:
                    break
            parts = self._read_chunks(conn, chunks, names)
        out = _cut(parts, names, 0, np.iinfo(np.int64).max)
        return {name: values[-records:] if records else values[:0] for name, values in out.items()}

    def level_bound(self, level: int) -> int:
        """Bucket ids below this are in complete stored blocks (the writer stores a block once it is complete)."""
        return (self._extent[2] // level_steps(level)) // BLOCK_BUCKETS * BLOCK_BUCKETS if self._extent[0] else 0

    def complete(self, level: int, lo: int, hi: int, names=None) -> Buckets:
        """`names`: the bucket columns the caller reads (default all; `id` always): only those are decoded."""
        names = ["id", *(name for name in names or BUCKET_COLUMNS if name != "id")]
        first, last = lo // BLOCK_BUCKETS, (hi - 1) // BLOCK_BUCKETS
        missing = [block for block in range(first, last + 1) if (level, block) not in self._block_blobs]
        if missing:
            with self.store._read() as conn:
                rows = conn.execute("SELECT block, data FROM levels WHERE run_id = ? AND lane = ? AND rank = ? AND "
                                    "level = ? AND block BETWEEN ? AND ?", (*self._key, level, missing[0],
                                                                          missing[-1])).fetchall()
            found = dict(rows)
            for block in missing:
                self._block_blobs[(level, block)] = found.get(block)
        parts = []
        for block in range(first, last + 1):
            decoded = self._blocks.setdefault((level, block), {})
            wanted = [name for name in names if name not in decoded]
            blob = self._block_blobs[(level, block)]
            if wanted and blob is None:
                decoded.update(empty_buckets())
            elif wanted:
                try:
                    decoded.update(decode_columns(blob, wanted))
                except DamagedData as exc:
                    span = level_steps(level) * BLOCK_BUCKETS
                    self._damaged(f"the summary of steps {block * span}–{(block + 1) * span - 1}", exc)
                    decoded.update(empty_buckets())
            parts.append({name: decoded[name] for name in names})
        buckets = concat(parts)
        return select(buckets, (buckets["id"] >= lo) & (buckets["id"] < hi))

    def marks(self, start: int, stop: int) -> dict[str, np.ndarray]:
        names = list(STEP_COLUMNS)
        parts = []
        with self.store._read() as conn:
            chunks = self._chunks(conn, start, stop, "AND marks > 0", "first_step, last_step")
            unread = [chunk for chunk in chunks if chunk not in self._marks]
            if unread:
                rows = conn.execute("SELECT first_step, last_step, marks_data FROM chunks WHERE run_id = ? AND "
                                    "lane = ? AND rank = ? AND marks > 0 AND first_step BETWEEN ? AND ?",
                                    (*self._key, unread[0][0], unread[-1][0])).fetchall()
                wanted = set(unread)
                for first, last, data in rows:
                    if (first, last) not in wanted:
                        continue
                    try:
                        found = decode_rows(data, STEP_COLUMNS)
                        self._marks[(first, last)] = {name: found.get(name, _missing(name, len(found["step"])))
                                                      for name in names}
                    except DamagedData as exc:
                        self._damaged(f"the skipped steps and non-finite values of steps {first}–{last}", exc)
                        self._marks[(first, last)] = _cut([], names, 0, 0)
        parts = [self._marks[chunk] for chunk in chunks if chunk in self._marks]
        return _cut(parts, names, start, stop)

    def median_step_ms(self) -> float:
        """Exact: kept with a finished track, else computed from its step times (remembered per record count)."""
        records = self._extent[0]
        if self._stats.get("records") == records and "median_step_ms" in self._stats:
            return float(self._stats["median_step_ms"])
        if self._median[0] != records:
            times = self.raw_rows(self._extent[1], self._extent[2] + 1, ["step_ms"])["step_ms"]
            self._median = (records, float(np.median(times)) if len(times) else float("nan"))
        return self._median[1]


def _cut(parts: list[dict[str, np.ndarray]], names: list[str], start: int, stop: int) -> dict[str, np.ndarray]:
    """Chunks' columns joined, keeping steps in [start, stop)."""
    if not parts:
        return {name: np.empty(0, dtype=STEP_COLUMNS[name]) for name in names}
    joined = {name: np.concatenate([part[name] for part in parts]) if len(parts) > 1 else parts[0][name]
              for name in names}
    steps = joined["step"]
    lo, hi = np.searchsorted(steps, start), np.searchsorted(steps, stop)
    return {name: values[lo:hi] for name, values in joined.items()}

