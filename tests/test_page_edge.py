"""A page's edge: anything a page (or a live part of it) raises while drawing is one line on the page and an entry with
its stack in the server's log, never a traceback; the next draw runs it again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core import catalog
from pages.common import PAGE_FAILED

ROOT = Path(__file__).resolve().parents[1]


class Kept(logging.Handler):
    """The records the pages' logger writes (Streamlit's loggers do not propagate to the root one)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def page_log():
    logger = logging.getLogger("amp_lab.pages")
    kept = Kept()
    logger.addHandler(kept)
    yield kept.records
    logger.removeHandler(kept)


def test_a_page_that_raises_says_one_line_logs_the_stack_and_draws_again(monkeypatch, page_log):
    """app.py's edge around the page: the Train page (the one app.py runs first, inside its navigation) broken on
    purpose where it lists the workloads."""

    def broken(*args, **kwargs):
        raise RuntimeError("the workload list broke on purpose")

    # The workload list, on either of its paths (the catalog's before torch is imported, the registry's after: an
    # earlier test in this process may have warmed it up).
    monkeypatch.setattr(catalog, "builtin_workloads", broken)
    monkeypatch.setattr(catalog, "WorkloadEntry", broken)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not at.exception  # no traceback on the page
    lines = [error.value for error in at.error if PAGE_FAILED in error.value]
    assert lines == ["The Train page could not be drawn (RuntimeError: the workload list broke on purpose). The "
                     "server's log has the details; reload the page to try again, and restart the server if it keeps "
                     "failing."]
    assert [title.value for title in at.title] == ["Train"]  # what it drew before the failure stays
    (record,) = [record for record in page_log if record.exc_info]
    assert record.getMessage() == f"The Train page {PAGE_FAILED}"
    assert record.levelno == logging.ERROR
    assert "workload_entries" in logging.Formatter().formatException(record.exc_info)

    monkeypatch.undo()
    at.run()  # the next draw: the page works again
    assert not at.exception
    assert not [error.value for error in at.error if PAGE_FAILED in error.value]
    assert at.button(key="train_launch")


def live_part_that_fails_once():
    """A page whose live part (a fragment, guarded like every page's) raises on its first draw only."""
    import streamlit as st

    from pages.common import store_guarded

    @st.fragment
    @store_guarded
    def live() -> None:
        st.session_state["draws"] = st.session_state.get("draws", 0) + 1
        if st.session_state["draws"] == 1:
            raise KeyError("lane 3")
        st.markdown(f"drawn {st.session_state['draws']} times")

    st.title("Live")
    live()
    st.button("again", key="again")


def test_a_live_part_that_raises_says_one_line_and_the_rest_of_the_page_draws(page_log):
    at = AppTest.from_function(live_part_that_fails_once, default_timeout=30).run()
    assert not at.exception
    assert [error.value for error in at.error] == [
        f"This part of the page {PAGE_FAILED} (KeyError: 'lane 3'). The server's log has the details; reload the page "
        "to try again, and restart the server if it keeps failing."]
    assert at.button(key="again")  # drawn after the failed part
    assert len([record for record in page_log if record.exc_info]) == 1
    at.button(key="again").click().run()
    assert not at.exception and not at.error
    assert [markdown.value for markdown in at.markdown] == ["drawn 2 times"]


def test_a_sidebar_that_raises_says_one_line_and_the_page_still_draws(monkeypatch, page_log):
    """The frame app.py draws around every page (links, sharing, device, store) has the same edge as the page."""
    import pages.common

    def broken(*args, **kwargs):
        raise RuntimeError("the sharing panel broke on purpose")

    monkeypatch.setattr(pages.common, "sharing_panel", broken)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not at.exception
    assert [error.value for error in at.error if PAGE_FAILED in error.value] == [
        f"The sidebar {PAGE_FAILED} (RuntimeError: the sharing panel broke on purpose). The server's log has the "
        "details; reload the page to try again, and restart the server if it keeps failing."]
    assert [title.value for title in at.title] == ["Train"] and at.button(key="train_launch")  # the page below
    (record,) = [record for record in page_log if record.exc_info]
    assert record.getMessage() == f"The sidebar {PAGE_FAILED}"

    monkeypatch.undo()
    at.run()
    assert not at.exception and not [error.value for error in at.error if PAGE_FAILED in error.value]
