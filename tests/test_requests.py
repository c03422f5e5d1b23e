"""Requests from a page to a live attached process through the store (amp_core.records.requests): a monitored script
in a process of its own answers "trace the next step" asked from the Op inspector page (AppTest) and "layer numerics at
the next step"; a request to a process that died says so; a request on an ended run is refused, saying why."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_monitor import said
from test_monitor import start_script as start

from amp_core.records import requests
from amp_core.records.opening import open_store

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "monitor_script.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}




def go_on(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()


def inspector() -> AppTest:
    page = AppTest.from_file(str(ROOT / "pages" / "op_inspector.py"), default_timeout=120).run()
    page.radio(key="opi_source").set_value("An attached run").run()
    assert not page.exception
    return page


@pytest.mark.both_stores
def test_a_trace_asked_from_the_op_inspector_is_answered_by_the_running_process(fresh_store):
    proc = start(fresh_store, "--steps", "30", "--pause-at", "5,12")
    try:
        paused = said(proc)
        page = inspector()
        assert page.selectbox(key="opi_attached_run").value == paused["run_id"]
        page.button(key="opi_ask_trace").click().run()
        assert not page.exception
        assert any("waiting for the process to read it" in info.value for info in page.info)
        go_on(proc)
        said(proc)  # its flush at step 12 took the request: the step after next is traced
        go_on(proc)
        said(proc)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    page.run()
    assert not page.exception
    assert any(success.value.startswith("Answered: every op of step") for success in page.success)
    assert page.metric[0].label == "Ops (forward + backward)" and int(page.metric[0].value) > 10
    tables = [frame.value for frame in page.dataframe]
    assert any("addmm" in " ".join(map(str, table.get("op", []))) for table in tables)  # the model's Linear layers
    events = open_store(fresh_store).events(paused["run_id"])
    assert "traced" in events["kind"].tolist()


@pytest.mark.both_stores
def test_layer_numerics_asked_at_the_next_step_are_answered(fresh_store):
    proc = start(fresh_store, "--steps", "20", "--pause-at", "4,10")
    store = open_store(fresh_store)
    try:
        paused = said(proc)
        request_id = requests.ask(store, paused["run_id"], requests.LAYERS)
        assert requests.state(store, request_id).status == "open"
        go_on(proc)
        said(proc)
        go_on(proc)
        said(proc)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    answered = requests.state(store, request_id)
    assert answered.status == "answered" and answered.message.startswith("layer numerics of step")
    layers = answered.answer["layers"]
    assert layers["modules"] == ["0", "1", "2", "(root)"] and layers["why"] == "requested"
    assert set(layers["shares"]["output"]) == {"fp16", "bf16", "fp8 e4m3fn", "fp8 e5m2"}


@pytest.mark.both_stores
def test_a_request_to_a_process_that_died_says_so_and_one_on_an_ended_run_is_refused(fresh_store):
    proc = start(fresh_store, "--steps", "40", "--pause-at", "5")
    try:
        paused = said(proc)
        page = inspector()
        page.button(key="opi_ask_trace").click().run()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        proc.kill()
    page.run()
    assert not page.exception
    assert any("Not answered: the process ended (interrupted) before it answered" in w.value for w in page.warning)
    store = open_store(fresh_store)
    with pytest.raises(requests.RequestRefused, match=r"the run has ended \(interrupted\): no process is left"):
        requests.ask(store, paused["run_id"], requests.TRACE)
    page.run()
    assert page.button(key="opi_ask_trace").disabled  # the page offers no request on an ended run
    assert any("the process ended (interrupted)" in w.value for w in page.warning)
