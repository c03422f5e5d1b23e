"""The bench's protocol viewer against a real server: it opens a session on a page, receives the page's deltas, and
keeps a live part redrawing on the server's timer as a browser would (bench/st_client.py)."""

from __future__ import annotations

import signal
import time

from cli_process import start_cli_run, stored_steps
from streamlit_server import serving

from bench.st_client import Room, Viewer, stream_url


def test_stream_url():
    assert stream_url("http://127.0.0.1:8501/") == "ws://127.0.0.1:8501/_stcore/stream"
    assert stream_url("https://lab.example/amp") == "wss://lab.example/amp/_stcore/stream"


def test_viewers_open_pages_and_follow_a_live_run(fresh_store):
    cli = start_cli_run(fresh_store, "--workload", "mlp_regression", "--modes", "32-true", "--steps", "10000000")
    try:
        deadline = time.monotonic() + 60
        while stored_steps(fresh_store) == 0:  # a live run with records before the pages open
            assert time.monotonic() < deadline, "the CLI run wrote no records"
            time.sleep(0.1)
        with serving(fresh_store) as url:
            train, compare = Viewer(url), Viewer(url, "compare")
            room = Room([train, compare]).start()
            try:
                # The Train page's live view, drawn, then redrawn on its own (the fragment's timer, run by the client).
                assert room.wait(lambda: train.fragment_runs >= 2 or train.error, 90), train.kinds
                assert room.wait(lambda: compare.runs_finished >= 1 or compare.error, 60), compare.kinds
            finally:
                room.stop()
    finally:
        cli.send_signal(signal.SIGINT)
        cli.wait(60)
    assert not train.error and not compare.error
    assert "Train" in train.texts
    assert any("Run status: **running**" in text for text in train.texts)
    assert train.elements["component_instance"] >= 4 and train.kinds["auto_rerun"] >= 1  # its live charts
    assert "Compare runs" in compare.texts
    assert compare.elements["dataframe"] >= 1
