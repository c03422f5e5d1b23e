"""Start, wait for and stop a real dashboard server on a free local port (browser and CLI tests, cold-start bench)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(port: int, store: Path, output=subprocess.PIPE) -> subprocess.Popen:
    """`streamlit run app.py` on 127.0.0.1:`port` with its run store at `store`."""
    return start_command(["-m", "streamlit", "run", "app.py", "--server.port", str(port), "--server.address",
                          "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
                          "--server.fileWatcherType", "none"], store, output)


def start_command(args: list[str], store: Path, output=subprocess.PIPE) -> subprocess.Popen:
    """`python ARGS` from the checkout's root with its run store at `store` (stderr joins `output`)."""
    env = dict(os.environ, AMP_LAB_STORE=str(store))
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                            text=True)


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 60.0, poll_s: float = 0.2) -> None:
    """Return once /_stcore/health answers 200; RuntimeError if the server exits, TimeoutError if too slow."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"streamlit exited with {proc.returncode} before it was healthy: {output}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(poll_s)
    raise TimeoutError(f"streamlit was not healthy within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def serving(store: Path) -> Iterator[str]:
    """The app served on a free port with its run store at `store`, healthy: its URL; stopped afterwards."""
    port = free_port()
    proc = start(port, store)
    try:
        wait_healthy(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
