"""Does watching slow training? A run's speed with two Chromium sessions watching it, against the same run unwatched.

A real server (`streamlit run app.py`, tests/streamlit_server.py) and Debian's Chromium (Playwright) on one machine.
Two cases, each one long run measured in alternating windows, so machine noise hits both sides alike:
- server: a run launched inside the server (the Train page's Launch button);
- cli: `python3 -m amp_core run ...` in its own process, writing the store the server follows.
Each round is an unwatched window (no browser session open) and a watched one (two sessions open: the Train page and the
Compare page, both following the run: Train's live board fetching its feed, Compare redrawing on its timer). A window's
speed is the lane steps whose records end inside it, per second, counted afterwards from the run's own records
(t_wall_s), so nothing reads the store while the run is measured. The ratio of a case is the median over rounds of
watched ÷ unwatched. Beside it, per window, the cores each process kept busy (CPU seconds per second: the run's process,
the server, Chromium), to tell whether a watched run lost its core to the server's page work or to the browser drawing
on the same machine.

    python3 -m bench.viewers [--rounds 3] [--window 10] [--screenshot artifacts/train_two_sessions.png]
Last line: watched_speed_ratio_min=<the smaller of the two cases' ratios>. Target: >= 0.8.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sqlite3
import statistics
import subprocess
import tempfile
import time
from contextlib import closing
from pathlib import Path

import psutil

from amp_core.precision import default_modes
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore, StoreError
from tests import streamlit_server
from tests.cli_process import start_cli_run
from tests.test_browser import PLOTS

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WORKLOAD = "digits_mlp"
"""The Train page's default workload; both cases run it in the page's default modes on this CPU."""
VIEWPORT = {"width": 1440, "height": 900}
RUN_STEPS = 10_000_000
"""Steps asked of each run: more than the windows need; the run is stopped after the last window."""
SETTLE_S = 1.5
"""Between opening or closing the sessions and the window: the first render of a page, or the sessions' end."""
SCROLL_TO_TOP = """label => {
    label.scrollIntoView({block: 'start'});
    let box = label.parentElement;  // the page's scrolling box: scrolled back by the header that covers its top
    while (box && box.scrollHeight <= box.clientHeight) box = box.parentElement;
    if (box) box.scrollTop -= 110;
}"""
# A chart drawn by Streamlit's plotly element, or in a live chart's frame (pages/live_chart.py, same origin).
CHART_DRAWN = f"""() => ({PLOTS})()
    .some(div => div._fullData && div._fullData.some(trace => (trace._length || 0) > 0))"""


def reader(store: Path) -> RunStore:
    """A fresh reader of the store (it sees what the writers committed since). A read-write connection opens first:
    RunStore checks a file read-only, and a read-only open of a WAL file whose index (-shm) the last connection to
    close removed fails with "disk I/O error" (reported: RunStore then calls the store damaged)."""
    with closing(sqlite3.connect(store)) as conn:
        conn.execute("SELECT COUNT(*) FROM runs").fetchone()  # opens the WAL and its index
    return open_store(store)


def new_run(store: Path, known: set[str], timeout_s: float = 120.0) -> str:
    """The run id of a run not in `known`, once it has records (a run just launched)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not store.exists() or store.stat().st_size == 0:  # the server has not created it yet
                raise StoreError("not there yet")
            found = reader(store)
            for run_id in set(found.runs()["run_id"]) - known:
                if any(track["records"] for track in found.tracks(run_id)):
                    return run_id
        except (StoreError, sqlite3.DatabaseError):  # opened while the server creates the file: asked again
            pass
        time.sleep(0.2)
    raise TimeoutError("no run wrote records")


def watch(browser, url: str) -> list:
    """Two sessions (own contexts): the Train page and the Compare page, each following the newest run."""
    sessions = []
    for path in ("", "compare"):
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        page.goto(f"{url}/{path}")
        page.wait_for_function(CHART_DRAWN, timeout=120_000)
        sessions.append(context)
    return sessions


def lane_steps_per_s(store: Path, run_id: str, windows: list[tuple[float, float]]) -> list[float]:
    """Per window (t0, t1): lane steps whose records end inside it, per second (every lane, from the records)."""
    frame = reader(store).steps(run_id, strict=False)
    ends = frame["t_wall_s"].to_numpy()
    return [float(((ends >= t0) & (ends < t1)).sum()) / (t1 - t0) for t0, t1 in windows]


def cpu_seconds(roles: dict[str, int]) -> dict[tuple[str, int], float]:
    """CPU seconds (user + system) so far of each process: every role's process and its children (role: pid), and
    Chromium's (this process's descendants named chrom*)."""
    found: dict[tuple[str, int], float] = {}
    tree = [("chromium", p) for p in psutil.Process().children(recursive=True) if "chrom" in p.name().lower()]
    for role, pid in roles.items():
        try:
            root = psutil.Process(pid)
            tree += [(role, p) for p in [root, *root.children(recursive=True)]]
        except psutil.NoSuchProcess:
            continue
    for role, process in tree:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:  # ended meanwhile
            continue
        found[role, process.pid] = times.user + times.system
    return found


def cores_busy(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Per role: CPU seconds spent between the two snapshots per second of wall time (1.0: one core busy). A process
    that started in between counts from 0; one that ended in between is left out."""
    busy: dict[str, float] = {}
    for (role, pid), spent in after.items():
        busy[role] = busy.get(role, 0.0) + (spent - before.get((role, pid), 0.0)) / seconds
    return busy


def measure(browser, url: str, store: Path, run_id: str, rounds: int, window_s: float, roles: dict[str, int],
            screenshot: Path | None = None) -> tuple[list, list, dict]:
    """Alternate unwatched and watched windows on the run going now; returns their (t0, t1) lists and, per kind of
    window, the cores each role kept busy in each (roles: name -> pid, see cpu_seconds). `screenshot`: after the last
    watched window, the Train page's session saves what it shows there (its live view scrolled into view)."""
    quiet, watched = [], []
    busy: dict[str, list] = {"unwatched": [], "watched": []}

    def window(kind: str, into: list) -> None:
        before, t0 = cpu_seconds(roles), time.time()
        time.sleep(window_s)
        into.append((t0, time.time()))
        busy[kind].append(cores_busy(before, cpu_seconds(roles), into[-1][1] - t0))

    for round_ in range(rounds):
        time.sleep(SETTLE_S)
        window("unwatched", quiet)
        sessions = watch(browser, url)
        time.sleep(SETTLE_S)
        window("watched", watched)
        if screenshot is not None and round_ == rounds - 1:
            save_screenshot(sessions[0].pages[0], screenshot)
        for context in sessions:
            context.close()
    return quiet, watched, busy


def save_screenshot(page, path: Path) -> None:
    """The Train page's live view as a user sees it (the viewport, the run's picker at its top)."""
    page.get_by_text("Run status:").first.wait_for()
    page.get_by_text("Run", exact=True).first.evaluate(SCROLL_TO_TOP)
    page.wait_for_function(CHART_DRAWN)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))


def ratio(name: str, store: Path, run_id: str, quiet: list, watched: list, busy: dict) -> float:
    q, w = lane_steps_per_s(store, run_id, quiet), lane_steps_per_s(store, run_id, watched)
    for kind, windows in busy.items():  # where the 2 cores went: the run's process, the server, the browser
        roles = sorted({role for found in windows for role in found})
        print(f"{name}_{kind}_cores_busy=" + ",".join(
            f"{role}:" + "/".join(f"{found.get(role, 0.0):.2f}" for found in windows) for role in roles))
    ratios = [b / a for a, b in zip(q, w, strict=True)]
    print(f"{name}_unwatched_lane_steps_per_s=" + ",".join(f"{v:.0f}" for v in q))
    print(f"{name}_watched_lane_steps_per_s=" + ",".join(f"{v:.0f}" for v in w))
    print(f"{name}_round_ratios=" + ",".join(f"{r:.3f}" for r in ratios))
    figure = statistics.median(ratios)
    print(f"{name}_watched_speed_ratio={figure:.3f}")
    return figure


def launch_in_server(browser, url: str) -> None:
    """Launch a long run of the Train page's default workload and modes (a real click), then close the session."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.goto(url)
    launch = page.get_by_role("button", name="Launch")
    launch.wait_for(timeout=120_000)
    page.get_by_label("Steps", exact=True).fill(str(RUN_STEPS))
    page.get_by_label("Steps", exact=True).press("Enter")
    page.wait_for_function("() => document.querySelectorAll('[data-stale=\"true\"]').length === 0")
    launch.click()
    # The page's own Stop (the run's control): Streamlit's header shows a "Stop" of its own while a script runs.
    page.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop").wait_for(timeout=120_000)
    context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    # 10 s: a watched window holds exactly one of Compare's redraws (every 10 s) and ten of Train's (every second);
    # an 8 s window held none or one of Compare's, so its figure depended on where the timer stood.
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--screenshot", type=Path, help="save the Train page watching the server's run here (PNG)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    figures = {}
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        store = Path(folder) / "runs.sqlite3"
        port = streamlit_server.free_port()
        url = f"http://127.0.0.1:{port}"
        server = streamlit_server.start(port, store, output=subprocess.DEVNULL)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            streamlit_server.wait_healthy(port, server)
            launch_in_server(browser, url)
            run_id = new_run(store, set())
            quiet, watched, busy = measure(browser, url, store, run_id, args.rounds, args.window,
                                           {"server_and_run": server.pid}, args.screenshot)
            streamlit_server.stop(server)  # stops its run (its last records flushed)
            figures["server"] = ratio("server", store, run_id, quiet, watched, busy)

            server = streamlit_server.start(port, store, output=subprocess.DEVNULL)
            streamlit_server.wait_healthy(port, server)
            # Its Ctrl-C below reaches it as from a terminal even when this bench runs as a background job (whose
            # shell ignores SIGINT, which a child would inherit: the run then went on and the bench waited in vain).
            cli = start_cli_run(store, "--workload", WORKLOAD, "--modes", ",".join(default_modes("cpu")),
                                "--steps", str(RUN_STEPS))
            try:
                run_id = new_run(store, {run_id})
                quiet, watched, busy = measure(browser, url, store, run_id, args.rounds, args.window,
                                               {"server": server.pid, "cli_run": cli.pid})
            finally:
                cli.send_signal(signal.SIGINT)
                cli.wait(60)
            figures["cli"] = ratio("cli", store, run_id, quiet, watched, busy)
        finally:
            browser.close()
            streamlit_server.stop(server)
    print(f"watched_speed_ratio_min={min(figures.values()):.3f}")


if __name__ == "__main__":
    main()
