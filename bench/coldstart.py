"""Cold start of the dashboard: from `streamlit run app.py` to a healthy server, and to a page a user can use.

Each round starts a fresh server process on a free local port with an empty temporary store and times, from the
process's start:
- coldstart_s: `/_stcore/health` answers 200 (polled every 20 ms);
- first_usable_s: a headless Chromium (Playwright; started before the round, as a user's browser is open already)
  that opened the page as soon as the server was healthy shows the Train page's Launch button;
- second_session_s: once the first session's page has drawn everything (its cost table), a second session (a fresh
  browser context: no cache, no cookies) opens the page; seconds from its request to Launch visible.
Median of the rounds each.

    python3 -m bench.coldstart [--rounds 3] [--timeout 60]   (from the repository root)
Last line: first_usable_s=<median>. Targets: first_usable_s <= 3, second_session_s <= 1.5.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.probe_agreement import COST_TABLE
from bench.viewers import CHROMIUM, CHROMIUM_ARGS, VIEWPORT
from tests import streamlit_server


def usable_after(browser, url: str, timeout_s: float) -> tuple[float, object]:
    """Open `url` in a fresh session; (seconds until the Launch button is visible, the session's context)."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    started = time.perf_counter()
    page.goto(url)
    page.get_by_role("button", name="Launch").wait_for(state="visible", timeout=timeout_s * 1e3)
    return time.perf_counter() - started, context


def one_start(browser, timeout_s: float) -> tuple[float, float, float]:
    """(healthy, first usable, second session) seconds for a fresh server."""
    port = streamlit_server.free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        proc = streamlit_server.start(port, Path(folder) / "runs.sqlite3", output=subprocess.DEVNULL)
        contexts = []
        try:
            streamlit_server.wait_healthy(port, proc, timeout_s, poll_s=0.02)
            healthy = time.perf_counter() - started
            _, first = usable_after(browser, url, timeout_s)
            usable = time.perf_counter() - started
            contexts.append(first)
            first.pages[0].wait_for_function(COST_TABLE, timeout=timeout_s * 4e3)  # the first page fully drawn
            second_s, second = usable_after(browser, url, timeout_s)
            contexts.append(second)
            return healthy, usable, second_s
        finally:
            for context in contexts:
                context.close()
            streamlit_server.stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            browser.new_page().goto("about:blank")  # the browser's own start is not the server's
            rounds = [one_start(browser, args.timeout) for _ in range(args.rounds)]
        finally:
            browser.close()
    healthy, usable, second = zip(*rounds, strict=True)
    print("healthy_rounds_s=" + ",".join(f"{t:.2f}" for t in healthy))
    print("first_usable_rounds_s=" + ",".join(f"{t:.2f}" for t in usable))
    print("second_session_rounds_s=" + ",".join(f"{t:.2f}" for t in second))
    print(f"coldstart_s={statistics.median(healthy):.2f}")
    print(f"second_session_s={statistics.median(second):.2f}")
    print(f"first_usable_s={statistics.median(usable):.2f}")


if __name__ == "__main__":
    main()
