"""Start, wait for and stop a real dashboard server on a free local port (browser and CLI tests, cold-start bench)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(port: int, store: Path, output=None) -> subprocess.Popen:
    """`streamlit run app.py` on 127.0.0.1:`port` with its run store at `store` (output: see `start_command`)."""
    return start_command(["-m", "streamlit", "run", "app.py", "--server.port", str(port), "--server.address",
                          "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
                          "--server.fileWatcherType", "none"], store, output)


def start_command(args: list[str], store: Path, output=None) -> subprocess.Popen:
    """`python ARGS` from the checkout's root with its run store at `store`; stdout and stderr go to `output`, by
    default the file `log_path(store)`: never a pipe nobody reads (a server that prints more than a pipe holds, 64 KiB,
    blocks in its write, training thread and all). A caller that passes subprocess.PIPE reads it."""
    env = dict(os.environ, AMP_LAB_STORE=str(store), PYTHONFAULTHANDLER="1")
    with ExitStack() as opened:  # a log file opened here is closed after the start: the child holds its own copy
        stream = output if output is not None else opened.enter_context(open(log_path(store), "a"))
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT,
                                text=True)
    if output is None:
        proc.log_path = log_path(store)
    return proc


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 60.0, poll_s: float = 0.2) -> None:
    """Return once /_stcore/health answers 200; RuntimeError if the server exits, TimeoutError if too slow."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else printed(proc)
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


def log_path(store: Path) -> Path:
    """Where a server on `store` started without an `output` writes what it prints: a file beside the store."""
    return store.with_name(store.name + ".server.log")


def printed(proc: subprocess.Popen, chars: int = 12000) -> str:
    """The last `chars` characters that `proc`, started by `start_command` without an `output`, printed."""
    try:
        return proc.log_path.read_text(errors="replace")[-chars:]
    except (AttributeError, FileNotFoundError):
        return ""


def dump_stacks(proc: subprocess.Popen) -> None:
    """Make a server started by `start_command` print every thread's stack to its output and end (faulthandler, which
    its environment turns on, answers SIGABRT so): what a server that hangs was doing."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


SERVING: dict[str, subprocess.Popen] = {}
"""The servers `serving` runs now, by URL (tests/conftest.py reports a failed test's server from it)."""


@contextmanager
def serving(store: Path) -> Iterator[str]:
    """The app served on a free port with its run store at `store`, healthy: its URL; stopped afterwards. What it
    printed is in `log_path(store)`; when the body fails, every thread's stack and the tail of that are printed
    (pytest shows them with the failure)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(port, store)
    SERVING[url] = proc
    try:
        wait_healthy(port, proc)
        yield url
    except BaseException:
        dump_stacks(proc)
        print(f"--- what the server printed, every thread's stack last (the tail of {proc.log_path}) ---\n"
              f"{printed(proc)}")
        raise
    finally:
        SERVING.pop(url, None)
        stop(proc)
