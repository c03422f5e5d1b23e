"""open_store: the one way every part of AMP Lab opens a store, SQLite or PostgreSQL (apart from store.py, which the
PostgreSQL store builds on, so that neither imports the other's module in a circle)."""

from __future__ import annotations

import os
from pathlib import Path

from amp_core.records.store import (
    STALE_AFTER_S,
    RunStore,
    SQLiteStore,
    backlog_setting,
    default_target,
    is_postgres_url,
)


def open_store(target: str | os.PathLike | None = None, *, stale_after_s: float = STALE_AFTER_S,
               backlog_records: int | None = None) -> RunStore:
    """The store at `target` (default: `default_target()`): a `postgresql://user@host:port/db` URL opens the
    PostgreSQL store, anything else is a SQLite file path. `backlog_records`: how many step records a writer holds
    while the store's server is unreachable (default `backlog_setting()`). The one way every part of AMP Lab (CLI,
    pages, Monitor, runner, integrations) opens a store."""
    target = default_target() if target is None else target
    backlog = backlog_setting() if backlog_records is None else backlog_records
    if is_postgres_url(target):
        from amp_core.records.postgres import PostgresStore  # psycopg only where a PostgreSQL store is asked for

        return PostgresStore(target, stale_after_s=stale_after_s, backlog_records=backlog)
    return SQLiteStore(Path(target).expanduser(), stale_after_s=stale_after_s, backlog_records=backlog)
