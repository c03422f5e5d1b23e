"""Cold start of the dashboard: seconds from `streamlit run app.py` to a healthy `/_stcore/health`.

Each round starts a fresh server process on a free local port with an empty temporary store, polls the health
endpoint every 20 ms, and stops the server. Median of the rounds. Last line: coldstart_s=<median>. Target: <= 5.

    python3 -m bench.coldstart [--rounds 3] [--timeout 60]   (from the repository root)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tests import streamlit_server


def one_start(timeout_s: float) -> float:
    port = streamlit_server.free_port()
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        proc = streamlit_server.start(port, Path(folder) / "runs.sqlite3", output=subprocess.DEVNULL)
        try:
            streamlit_server.wait_healthy(port, proc, timeout_s, poll_s=0.02)
            return time.perf_counter() - started
        finally:
            streamlit_server.stop(proc)


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
