"""`amp-lab ui` and the CLI's progress, in real processes: loopback by default, --share opens it, a bar or log lines."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time

import psutil
import pytest

from amp_core import cli
from tests import streamlit_server

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

RUN = ["-m", "amp_core", "run", "--workload", "mlp_regression", "--modes", "32-true", "--steps", "300"]


def listening_addresses(proc: subprocess.Popen, port: int) -> set[str]:
    """The addresses the server process listens on at `port` (asked of the kernel, not of the server)."""
    return {c.laddr.ip for c in psutil.Process(proc.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def non_loopback_ipv4() -> str | None:
    """One IPv4 address of this machine's that is not loopback (None if it has none)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


@pytest.fixture
def ui_server(tmp_path):
    """Starts `python -m amp_core ui ARGS...` on a free port; stops it at the end of the test."""
    started = []

    def start(*args: str) -> tuple[subprocess.Popen, int]:
        port = streamlit_server.free_port()
        proc = streamlit_server.start_command(["-m", "amp_core", "ui", "--port", str(port), *args,
                                               "--server.fileWatcherType", "none"], tmp_path / "runs.sqlite3")
        started.append(proc)
        streamlit_server.wait_healthy(port, proc)
        return proc, port

    yield start
    for proc in started:
        streamlit_server.stop(proc)


def test_ui_listens_on_loopback_only(ui_server):
    proc, port = ui_server()
    assert listening_addresses(proc, port) == {"127.0.0.1"}
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with pytest.raises(OSError):  # refused: nothing listens there
        socket.create_connection((address, port), timeout=3).close()


def test_share_listens_on_every_interface_and_says_what_that_exposes(ui_server):
    proc, port = ui_server("--share")
    assert listening_addresses(proc, port) == {"0.0.0.0"}
    streamlit_server.stop(proc)
    output = streamlit_server.printed(proc)
    assert "warning: AMP Lab listens on 0.0.0.0" in output and "read every run" in output
    assert "visitors from other machines watch read-only" in output  # the controls stay on this machine


def test_plain_streamlit_run_is_loopback_too(tmp_path):
    """`streamlit run app.py` with no address flag: .streamlit/config.toml keeps it on this machine."""
    port = streamlit_server.free_port()
    proc = streamlit_server.start_command(["-m", "streamlit", "run", "app.py", "--server.port", str(port),
                                           "--server.fileWatcherType", "none"], tmp_path / "runs.sqlite3")
    try:
        streamlit_server.wait_healthy(port, proc)
        assert listening_addresses(proc, port) == {"127.0.0.1"}
    finally:
        streamlit_server.stop(proc)


def test_ui_hands_its_store_to_the_dashboard(tmp_path):
    port, chosen = streamlit_server.free_port(), tmp_path / "workshop.sqlite3"
    proc = streamlit_server.start_command(["-m", "amp_core", "--store", str(chosen), "ui", "--port", str(port),
                                           "--server.fileWatcherType", "none"], tmp_path / "runs.sqlite3")
    try:
        streamlit_server.wait_healthy(port, proc)
        assert psutil.Process(proc.pid).environ()["AMP_LAB_STORE"] == str(chosen)  # the server process itself
    finally:
        streamlit_server.stop(proc)


def test_ui_without_the_source_checkout_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "APP_FILE", tmp_path / "site-packages" / "app.py")
    assert cli.main(["ui"]) == 2
    err = capsys.readouterr().err
    assert "needs the source checkout installed with `pip install -e .`" in err and len(err.splitlines()) == 1


def test_extra_arguments_are_only_for_ui(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["list", "--server.port", "9"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --server.port 9\n"


def test_progress_in_a_log_is_plain_lines(fresh_store):
    proc = subprocess.run([sys.executable, *RUN], cwd=streamlit_server.ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, AMP_LAB_STORE=str(fresh_store)))
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("mlp_regression:   0%") and "0/300" in lines[0]
    assert re.fullmatch(r"mlp_regression: 100%\|#+\| 300/300 \[\d\d:\d\d<00:00, +[\d.]+step/s\]", lines[-1]), lines


def test_progress_on_a_terminal_is_a_live_bar(fresh_store):
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, columns of a terminal
    proc = subprocess.Popen([sys.executable, *RUN], cwd=streamlit_server.ROOT, stdout=subprocess.PIPE,
                            stderr=terminal, env=dict(os.environ, AMP_LAB_STORE=str(fresh_store)))
    os.close(terminal)
    shown = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], deadline - time.monotonic())
        try:
            chunk = os.read(controller, 4096) if ready else b""
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    assert proc.wait(30) == 0
    text = shown.decode()
    redraws = [part for part in text.split("\r") if "step/s" in part]
    assert len(redraws) >= 2, text  # redrawn in place, not one line per update
    assert "300/300" in redraws[-1] and "█" in redraws[-1]
