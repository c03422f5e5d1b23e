"""What every page shares: the process-wide RunManager (one per server, every tab sees every run), pickers."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from amp_core.records.store import RunStore, StoreError
from amp_core.runner import RunManager

STATUS_ICONS = {"running": "🟢", "paused": "⏸️", "pending": "⏳", "finished": "✅", "stopped": "⏹️",
                "failed": "❌", "interrupted": "⚠️", "diverged": "💥"}


@st.cache_resource
def get_manager() -> RunManager:
    """The one RunManager of this server (its store at $AMP_LAB_STORE or ~/.amp_lab/runs.sqlite3)."""
    try:
        return RunManager(RunStore())
    except StoreError as exc:  # a damaged or foreign file: keep it untouched, run in memory, say why
        return RunManager(None, store_error=str(exc))


def store_banner(manager: RunManager) -> None:
    """A clear message when the store could not be opened (runs then live in memory only)."""
    if manager.store_error:
        st.error(f"The run store could not be opened, so runs are kept in memory only: {manager.store_error}")


def run_label(row: pd.Series) -> str:
    when = time.strftime("%m-%d %H:%M:%S", time.localtime(row["created_at"]))
    name = f"{row['name']} · " if row.get("name") else ""
    return (f"{STATUS_ICONS.get(row['status'], '')} {name}{row['workload']} · {', '.join(row['modes'])} · "
            f"{when} · {row['status']}")


def run_picker(manager: RunManager, key: str, label: str = "Run", default: str | None = None) -> str | None:
    """A selectbox over every run (live and stored, newest first); returns the run_id or None if there are none."""
    runs = manager.list_runs()
    if runs.empty:
        return None
    ids = runs["run_id"].tolist()
    labels = dict(zip(ids, (run_label(row) for _, row in runs.iterrows()), strict=True))
    index = ids.index(default) if default in ids else 0
    return st.selectbox(label, ids, index=index, format_func=labels.get, key=key)
