"""The Train page's live board in a real browser against a real server: its charts move from the files the run's
publisher writes (pages/live_chart.py, amp_core/views/live_feed.py), each update carrying only the new points, while
the session's script does not rerun per tick (counted on the websocket as the browser receives it)."""

from __future__ import annotations

import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

from bench.room_watch import LAST_DRAWN
from tests import streamlit_server
from tests.cli_process import start_cli_run, stored_steps
from tests.test_browser import LOSS_POINTS, SETTLED

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
STATUS_LINE = "Run status: **"
"""The live view's status line (pages/train.py): drawn at each of its runs."""
MOVES = 3
BOARD_ENDS = """() => Object.fromEntries(Array.from(document.querySelectorAll('iframe'))
    .flatMap(frame => frame.contentDocument ? Array.from(frame.contentDocument.querySelectorAll('.chart')) : [])
    .map(div => [div.dataset.name, (div.data || []).map(trace => (trace.x || []).length)
        .reduce((sum, points) => sum + points, 0) && div.querySelectorAll('.trace').length
        ? Math.max(...div.data.map(trace => (trace.x || []).length ? trace.x[trace.x.length - 1] : -1)) : null]))"""
"""Each chart of the live board by name: the last x it has drawn (its traces painted), null when it has drawn none."""
"""Times the loss chart's last step must move while the runs are counted."""

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason="Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"),
]


COST_RACING = "Racing the modes through the runner"
"""The cost panel's caption while its probe races (pages/train.py)."""


class ScriptRuns:
    """Script runs the server started for the browser's session, read off its websocket: whole runs, and the live
    view's runs (the fragment runs that drew the run's status line; the cost panel's fragment reruns on its own timer
    while its probe races, and is not counted)."""

    def __init__(self):
        self.whole = 0
        self.live_view = 0
        self._fragment = False

    def listen(self, ws) -> None:
        def frame(payload) -> None:
            if isinstance(payload, str):
                return
            msg = ForwardMsg()
            msg.ParseFromString(payload)
            kind = msg.WhichOneof("type")
            if kind == "new_session":
                self._fragment = bool(msg.metadata.run.fragment_ids)
                self.whole += not self._fragment
            elif kind == "delta" and self._fragment and msg.delta.new_element.WhichOneof("type") == "markdown":
                self.live_view += STATUS_LINE in msg.delta.new_element.markdown.body

        ws.on("framereceived", frame)


def test_the_live_board_moves_from_the_published_files_without_a_rerun_per_tick(tmp_path):
    from playwright.sync_api import sync_playwright

    store = tmp_path / "runs.sqlite3"
    # 16-mixed: a lane with a GradScaler, so that every chart of the board has something to draw.
    cli = start_cli_run(store, "--workload", "mlp_regression", "--modes", "32-true,16-mixed", "--steps", "10000000")
    runs = ScriptRuns()
    updates: list[dict] = []  # the feed's updates the browser fetched (latest.json's and the ones in between)
    wholes: list[dict] = []  # the whole boards it fetched (its first)
    try:
        deadline = time.monotonic() + 60
        while stored_steps(store) == 0:
            assert time.monotonic() < deadline, "the CLI run wrote no records"
            time.sleep(0.1)
        with streamlit_server.serving(store) as url, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 900})
                page.on("websocket", runs.listen)

                def fetched(response) -> None:
                    name = response.url.split("?")[0].rsplit("/", 1)[-1]
                    if "/feed/" not in response.url or not response.ok:
                        return
                    body = response.json()
                    if name == "whole.json":
                        wholes.append(body)
                        return
                    known = {update["seq"] for update in updates}
                    updates.extend(u for u in body.get("updates", [body]) if u["seq"] not in known)

                page.on("response", fetched)
                page.goto(url)
                page.wait_for_function(f"() => ({LAST_DRAWN})() !== null", timeout=120_000)
                page.get_by_text("Run status: running").wait_for(timeout=30_000)
                # The cost panel races the modes once when the page opens, and its end draws the page once more (one
                # whole run, by design; under load it came while the chart moved): the counts start after it.
                page.wait_for_function(f"() => !document.body.innerText.includes({COST_RACING!r})", timeout=180_000)
                page.wait_for_function(SETTLED, timeout=60_000)
                whole_runs, live_runs, seen = runs.whole, runs.live_view, len(updates)
                ends = [page.evaluate(BOARD_ENDS)]
                steps = [page.evaluate(LAST_DRAWN)[1]]
                for _ in range(MOVES):  # the chart moves on its own: the board fetches the feed at the 1 s refresh
                    page.wait_for_function(f"() => ({LAST_DRAWN})()[1] > {steps[-1]}", timeout=30_000)
                    steps.append(page.evaluate(LAST_DRAWN)[1])
                ends.append(page.evaluate(BOARD_ENDS))
                table = page.evaluate("""() => Array.from(document.querySelectorAll('iframe'))
                    .map(f => f.contentDocument && f.contentDocument.getElementById('table'))
                    .filter(t => t).map(t => t.innerText).join('\\n')""")
                after = (runs.whole - whole_runs, runs.live_view - live_runs)
                # The run ends (Ctrl-C where it runs): the board's signal changes, its value reruns the live view,
                # and the page follows with no timer of its own.
                cli.send_signal(signal.SIGINT)
                cli.wait(60)
                page.get_by_text(re.compile(r"Run status: (stopped|interrupted)")).wait_for(timeout=60_000)
                page.wait_for_function(f"() => ['32-true', '16-mixed'].every(mode => mode in ({LOSS_POINTS})())",
                                       timeout=60_000)
                ended = page.evaluate(LOSS_POINTS)
            finally:
                browser.close()
    finally:
        cli.send_signal(signal.SIGINT)
        cli.wait(60)
    # Three moves of the chart, and the session's script did not run again: not a whole run, not a fragment's.
    assert steps == sorted(set(steps)), steps
    assert after == (0, 0), after
    # Every chart of the board drawn, and those over steps moved with the run (the memory chart is bars per lane).
    assert set(ends[0]) == {"loss", "step_time", "scale", "memory"} and None not in ends[-1].values(), ends
    assert all(ends[-1][name] > ends[0][name] for name in ("loss", "step_time", "scale")), ends
    assert {"32-true", "16-mixed"} <= set(ended)  # the ended run's charts, drawn by Streamlit
    assert "32-true" in table and "16-mixed" in table and "loss now" in table
    moved = [u["charts"]["loss"] for u in updates[seen:] if "loss" in u["charts"]]
    extends = [u for u in moved if u["kind"] == "extend" and u["extend"] and not u["replace"]]
    assert len(extends) >= 2, [u["kind"] for u in moved]
    assert wholes, "the board never fetched its whole figures"
    whole = sum(len(trace.get("x") or []) for trace in wholes[-1]["charts"]["loss"]["figure"]["data"])
    for update in extends:
        sent = sum(len(item["points"]["x"]) for item in update["extend"])
        assert 0 < sent < whole / 4, (sent, whole)  # the new points (and the bucket still filling), not the figure


def test_a_session_follows_pause_and_resume_pressed_in_another(tmp_path):
    """Two browsers on a run of the server's: one pauses and resumes it; the other session's live view, which has no
    timer, follows each change (its board's signal changed), controls and all."""
    from playwright.sync_api import sync_playwright

    from tests.test_browser import enter_number, open_train_page

    with streamlit_server.serving(tmp_path / "runs.sqlite3") as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            presenter, watcher = (browser.new_page(viewport={"width": 1440, "height": 900}) for _ in range(2))
            launch = open_train_page(presenter, url)
            enter_number(presenter, "Steps", 10_000_000)
            launch.click()
            presenter.get_by_text("Run status: running").wait_for(timeout=120_000)
            watcher.goto(url)
            watcher.get_by_text("Run status: running").wait_for(timeout=120_000)
            watcher.wait_for_function(f"() => ({LAST_DRAWN})() !== null", timeout=60_000)
            # The last two: the watcher resumes (its own rerun), then the presenter pauses: the watcher's board asks to
            # follow "paused" again, a signal it asked with before.
            pages = {"presenter": presenter, "watcher": watcher}
            for who, button, status, offered in (("presenter", "Pause", "paused", "Resume"),
                                                 ("presenter", "Resume", "running", "Pause"),
                                                 ("presenter", "Pause", "paused", "Resume"),
                                                 ("watcher", "Resume", "running", "Pause"),
                                                 ("presenter", "Pause", "paused", "Resume")):
                pages[who].get_by_test_id("stMainBlockContainer").get_by_role("button", name=button,
                                                                              exact=True).click()
                for page in sorted(pages.values(), key=lambda page: page is not pages[who]):  # the actor first
                    page.get_by_text(f"Run status: {status}").wait_for(timeout=60_000)
                    page.get_by_test_id("stMainBlockContainer").get_by_role("button", name=offered,
                                                                            exact=True).wait_for(timeout=30_000)
        finally:
            browser.close()
