"""Shared test set-up: a fresh store per test (a SQLite file; tests marked `both_stores` run again on a fresh database
of the tests' own PostgreSQL server), Streamlit's shared manager and probes reset and every thread the app
started stopped and joined after each test, a check that run threads end; OpenMP's idle threads asleep in every test
process and child (tests/child_env.py: a test that judges a speed runs on the device's own policy).

The checkout itself is importable through pytest's `pythonpath` setting (pyproject.toml), not by editing sys.path.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading

from child_env import quiet_the_suite

# OpenMP's idle threads sleep in every test process and child (tests/child_env.py): set before the imports below load
# torch, as libgomp reads the policy once, when it loads.
quiet_the_suite()

import pytest  # noqa: E402
from pg_cluster import Cluster, missing  # noqa: E402
from stepped_run import SteppedRun  # noqa: E402

from amp_core import background  # noqa: E402
from amp_core.config import RunConfig  # noqa: E402
from amp_core.extras import missing_extras  # noqa: E402
from amp_core.precision import CPU_NATIVE_ENV  # noqa: E402
from amp_core.race import runner  # noqa: E402
from amp_core.race.runner import RunManager  # noqa: E402
from amp_core.records.opening import open_store  # noqa: E402
from tests import streamlit_server  # noqa: E402

# The suite runs on the device as it is: an override exported in the shell would change what the workshop expects
# (the tests that exercise the override set it themselves).
os.environ.pop(CPU_NATIVE_ENV, None)


def pytest_collection_modifyitems(items):
    """A test marked `extra("recipes", ...)` skips where one of those extras is not installed, saying which and the
    line that installs it (the README's promise: the suite passes with any set of extras).

    The files that take minutes (a test marked `browser` or `slow`) are collected first: pytest-xdist hands whole
    files to its two workers in collection order (`--dist loadfile --no-loadscope-reorder`, pyproject.toml), so the
    long ones start at once and the short ones fill the gaps, instead of one long file running alone at the end."""
    for item in items:
        for marker in item.iter_markers("extra"):
            missing = missing_extras(marker.args)
            if missing:
                item.add_marker(pytest.mark.skip(reason="; ".join(
                    f"the {extra.name} extra is not installed ({extra.install})" for extra in missing)))
    long_files = {item.path for item in items if item.get_closest_marker("browser") or item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in long_files)  # a stable sort: files and tests keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed on a timeout (a wait on a run, a process) prints every thread's stack right away, while the
    thread that hung is still where it hung: a sporadic hang in CI then names its wait in the log. (AppTest stops its
    script thread before it raises: pyproject's faulthandler_timeout prints the stacks while such a run still hangs.)

    A failed test with a dashboard server in its fixtures (`streamlit_server.serving`) gets that server's output in its
    report, with every thread of it as it stood (the server is then ended: its fixture's teardown stops it anyway)."""
    report = yield
    if report.failed and call.excinfo is not None and "timed out" in str(call.excinfo.value).lower():
        print(f"\n--- {item.nodeid}: every thread's stack at the timeout ---", file=sys.stderr, flush=True)
        # A stderr with no file descriptor (output not captured by file): the report stands as it is.
        with contextlib.suppress(AttributeError, ValueError, OSError):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    if report.failed and call.when == "call":
        for url, proc in streamlit_server.SERVING.items():  # a browser test's server (its fixture yields the URL)
            if url in getattr(item, "funcargs", {}).values():
                streamlit_server.dump_stacks(proc)
                report.sections.append((f"what the server at {url} printed, every thread's stack last",
                                        streamlit_server.printed(proc)))
    return report


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("both_stores"):
        metafunc.parametrize("fresh_store", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture(scope="session")
def pg_cluster():
    """The tests' own PostgreSQL server for the session (skips where its binaries are absent); stopped by PID."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = Cluster()
    yield cluster
    cluster.remove()


@pytest.fixture(autouse=True)
def fresh_store(request, tmp_path, monkeypatch):
    """Every test gets its own store (a file path, or under `both_stores` also a fresh PostgreSQL database's URL),
    and no RunManager, cost probe or app thread survives from an earlier one (a page's probe still racing would run
    into the next test, and into its thread checks)."""
    if getattr(request, "param", "sqlite") == "postgresql":
        cluster = request.getfixturevalue("pg_cluster")
        target = cluster.url(cluster.new_database())
    else:
        target = tmp_path / "runs.sqlite3"
    monkeypatch.setenv("AMP_LAB_STORE", str(target))
    yield target
    _reset_streamlit_resources()
    left = background.stop_all(timeout_s=60)
    assert not left, f"threads the app started did not stop: {left}"


def _reset_streamlit_resources() -> None:
    if "pages.common" not in sys.modules:
        return
    common = sys.modules["pages.common"]
    try:
        common.get_manager().stop_all()
    finally:
        common.get_manager.clear()
        common.probe_board.clear()


@pytest.fixture
def no_leaked_threads():
    """Fails the test if it leaves run threads behind (a page's cost probe races on: the test's end stops it)."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.name.startswith("amp-run-")
              and not t.name.startswith("amp-run-probe-")]
    assert not leaked, f"threads outlived their runs: {leaked}"


@pytest.fixture
def stepped_launches(monkeypatch) -> type[SteppedRun]:
    """Runs a RunManager launches (the pages' too) are SteppedRuns: real runs a test can wait on instead of sleeping."""
    monkeypatch.setattr(runner, "Run", SteppedRun)
    return SteppedRun


@pytest.fixture
def live_run(stepped_launches, fresh_store, monkeypatch):
    """A real run (mlp_regression, two lanes) training in a RunManager, paused after 4 lane steps, then 10, then 16."""
    manager = RunManager(open_store(fresh_store))
    monkeypatch.setattr(stepped_launches, "pause_after", frozenset({4, 10, 16}))  # not the class's for good
    run = manager.launch(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=100_000,
                                   batch_size=16))
    run.wait_until(stepped_launches.parked)
    yield manager, run
    run.stop()
    run.join()


@pytest.fixture
def fragment_timers(monkeypatch) -> dict:
    """How often each live part of a page redraws itself (`st.fragment`'s run_every), by function name: AppTest runs
    no timers, so the period is read where the fragment is declared."""
    import streamlit as st

    timers, fragment = {}, st.fragment

    def recorded(func=None, *, run_every=None):
        if func is None:
            return lambda inner: recorded(inner, run_every=run_every)
        timers[func.__name__] = run_every
        return fragment(func, run_every=run_every)

    monkeypatch.setattr(st, "fragment", recorded)
    return timers
