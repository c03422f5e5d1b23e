"""Cold start of the dashboard: seconds from `streamlit run app.py` to a healthy `/_stcore/health`.

Each round starts a fresh server process on a free local port with an empty temporary store, polls the health
endpoint every 20 ms, and stops the server. Median of the rounds. Last line: coldstart_s=<median>. Target: <= 5.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_start(timeout_s: float) -> float:
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, AMP_LAB_STORE=str(Path(folder) / "runs.sqlite3"))
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port), "--server.address",
             "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while time.perf_counter() - started < timeout_s:
                if proc.poll() is not None:
                    raise RuntimeError(f"streamlit exited with {proc.returncode} before it was healthy")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as response:
                        if response.status == 200:
                            return time.perf_counter() - started
                except OSError:
                    time.sleep(0.02)
            raise TimeoutError(f"not healthy within {timeout_s} s")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    times = [one_start(args.timeout) for _ in range(args.rounds)]
    print("rounds_s=" + ",".join(f"{t:.2f}" for t in times))
    print(f"coldstart_s={statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
