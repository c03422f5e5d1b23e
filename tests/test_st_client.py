"""The bench's protocol viewer against a real server: it opens a session on a page, receives the page's deltas, and
keeps a live part redrawing on the server's timer as a browser would (bench/st_client.py)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import pytest
from cli_process import start_cli_run, stored_steps
from streamlit_server import serving

from bench.room import protocol_room
from bench.st_client import Room, Viewer, stream_url


def test_stream_url():
    assert stream_url("http://127.0.0.1:8501/") == "ws://127.0.0.1:8501/_stcore/stream"
    assert stream_url("https://lab.example/amp") == "wss://lab.example/amp/_stcore/stream"


class Redraws:
    """The elements a viewer received in its page's fragment runs (the live part redrawn on its timer; the cost
    panel's, while its probe races)."""

    def __init__(self):
        self.elements: Counter = Counter()
        self.runs = 0
        self._in_fragment = False

    def see(self, viewer: Viewer, msg) -> None:
        kind = msg.WhichOneof("type")
        if kind == "new_session":
            self._in_fragment = bool(msg.metadata.run.fragment_ids)
            self.runs += self._in_fragment
        elif kind == "delta" and self._in_fragment and msg.delta.WhichOneof("type") == "new_element":
            self.elements[msg.delta.new_element.WhichOneof("type")] += 1


def test_viewers_open_pages_and_follow_a_live_run(fresh_store):
    redraws = Redraws()
    cli = start_cli_run(fresh_store, "--workload", "mlp_regression", "--modes", "32-true", "--steps", "10000000")
    try:
        deadline = time.monotonic() + 60
        while stored_steps(fresh_store) == 0:  # a live run with records before the pages open
            assert time.monotonic() < deadline, "the CLI run wrote no records"
            time.sleep(0.1)
        with serving(fresh_store) as url:
            train, compare = Viewer(url, on_message=redraws.see), Viewer(url, "compare")
            room = Room([train, compare]).start()
            try:
                # The Train page's live board, drawn once, then moved from its feed's files (fetched as the board's
                # page fetches them, at the refresh period) while the page's script does not rerun.
                assert room.wait(lambda: train.feed_updates >= 4 or train.error, 90), (train.kinds, train.error)
                assert room.wait(lambda: compare.runs_finished >= 1 or compare.error, 60), compare.kinds
            finally:
                room.stop()
    finally:
        cli.send_signal(signal.SIGINT)
        cli.wait(60)
    assert not train.error and not compare.error
    assert "Train" in train.texts
    assert any("Run status: **running**" in text for text in train.texts)
    assert train.elements["component_instance"] >= 1 and train.feed_fetches >= train.feed_updates >= 4
    assert train.board_seq >= 3 and train.feed_wholes >= 1  # its first fetch: the whole board
    assert "Compare runs" in compare.texts
    assert compare.elements["dataframe"] >= 1
    assert train.elements["radio"] >= 1 and train.elements["slider"] >= 1  # the options, in the page's first run
    # No redraw of the live part sent the board again: its script ran with the page only.
    assert redraws.elements["component_instance"] == 0, redraws.elements


def test_the_protocol_room_times_each_page_to_its_first_run_with_its_title_drawn(fresh_store):
    # bench.room's room of laptops: sessions opened at one instant over the protocol, each done when its page's first
    # script run ended with the page's title among its texts, and no traceback or page-edge line on it.
    with serving(fresh_store) as url:
        visits = asyncio.run(protocol_room(url, [("formats", "Number formats"), ("compare", "Compare runs")], 120))
        assert [(one.path, one.failed) for one in visits] == [("formats", False), ("compare", False)]
        assert all(one.usable_s > 0 for one in visits)
        with pytest.raises(TimeoutError):  # a title the page never draws is never usable
            asyncio.run(protocol_room(url, [("formats", "A title no page has")], 5))
