"""The Train page's live loss chart in a real browser: drawn whole once, then moved by updates that carry only the
points since its last draw (pages/live_chart.py), read off the websocket as the browser receives them."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

from bench.room_watch import LAST_DRAWN
from tests import streamlit_server
from tests.cli_process import start_cli_run, stored_steps

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]


def loss_updates(received: list[dict]):
    """A websocket listener that keeps every update the loss chart's component was sent (its arguments' `update`, and
    the bytes of its arguments)."""
    def frame(payload) -> None:
        if isinstance(payload, str):
            return
        msg = ForwardMsg()
        msg.ParseFromString(payload)
        if msg.WhichOneof("type") != "delta" or msg.delta.new_element.WhichOneof("type") != "component_instance":
            return
        instance = msg.delta.new_element.component_instance
        if instance.id.endswith("train_live_loss"):
            received.append(dict(json.loads(instance.json_args)["update"], bytes=len(instance.json_args)))

    return lambda ws: ws.on("framereceived", frame)


def plain_extends(updates: list[dict]) -> list[dict]:
    """The updates that only append new points (no trace replaced, no reset)."""
    return [u for u in updates if u["kind"] == "extend" and u["extend"] and not u["replace"]]

def test_the_live_loss_chart_moves_by_its_new_points(tmp_path):
    from playwright.sync_api import sync_playwright

    store = tmp_path / "runs.sqlite3"
    cli = start_cli_run(store, "--workload", "mlp_regression", "--modes", "32-true,bf16-mixed", "--steps", "10000000")
    received: list[dict] = []
    try:
        deadline = time.monotonic() + 60
        while stored_steps(store) == 0:
            assert time.monotonic() < deadline, "the CLI run wrote no records"
            time.sleep(0.1)
        with streamlit_server.serving(store) as url, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.on("websocket", loss_updates(received))
                page.goto(url)
                page.wait_for_function(f"() => ({LAST_DRAWN})() !== null", timeout=120_000)
                first = page.evaluate(LAST_DRAWN)[1]
                # The chart moves on its own (the live view's 1 s timer), drawn from updates, not whole figures.
                page.wait_for_function(f"() => ({LAST_DRAWN})()[1] > {first}", timeout=30_000)
                seen = len(received)
                page.wait_for_function(
                    "() => Array.from(document.querySelectorAll('iframe')).some(f => f.contentWindow.liveChart"
                    " && f.contentWindow.liveChart.extends + f.contentWindow.liveChart.updates > 5)", timeout=30_000)
                deadline = time.monotonic() + 60  # under load an update may also replace a trace: wait for plain ones
                while len(plain_extends(received[seen:])) < 2:
                    assert time.monotonic() < deadline, [u["kind"] for u in received]
                    page.wait_for_timeout(200)  # let the page's own event loop take the frames in
            finally:
                browser.close()
    finally:
        cli.send_signal(signal.SIGINT)
        cli.wait(60)
    resets = [u for u in received if u["kind"] == "reset"]
    extends = plain_extends(received)
    assert resets and len(extends) >= 2, [u["kind"] for u in received]
    whole = max(sum(len(trace.get("x") or []) for trace in u["figure"]["data"]) for u in resets)
    for update in extends:
        sent = sum(len(item["points"]["x"]) for item in update["extend"])
        assert 0 < sent < whole / 4, (sent, whole)  # the new points (and the bucket still filling), not the figure
        assert update["bytes"] * 4 < max(u["bytes"] for u in resets)
