"""Shared test set-up: a fresh store per test, Streamlit's shared manager reset, a check that run threads end.

The checkout itself is importable through pytest's `pythonpath` setting (pyproject.toml), not by editing sys.path.
"""

from __future__ import annotations

import sys
import threading

import pytest
from stepped_run import SteppedRun

from amp_core import runner


@pytest.fixture(autouse=True)
def fresh_store(tmp_path, monkeypatch):
    """Every test gets its own store file, and no RunManager survives from an earlier test."""
    path = tmp_path / "runs.sqlite3"
    monkeypatch.setenv("AMP_LAB_STORE", str(path))
    yield path
    _reset_streamlit_manager()


def _reset_streamlit_manager() -> None:
    if "pages.common" not in sys.modules:
        return
    common = sys.modules["pages.common"]
    try:
        manager = common.get_manager()
        manager.stop_all()
    finally:
        common.get_manager.clear()


@pytest.fixture
def no_leaked_threads():
    """Fails the test if it leaves run threads behind."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.name.startswith("amp-run-")]
    assert not leaked, f"threads outlived their runs: {leaked}"


@pytest.fixture
def stepped_launches(monkeypatch) -> type[SteppedRun]:
    """Runs a RunManager launches (the pages' too) are SteppedRuns: real runs a test can wait on instead of sleeping."""
    monkeypatch.setattr(runner, "Run", SteppedRun)
    return SteppedRun
