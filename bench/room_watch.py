"""A room watches a live run: thirty viewers on one server, and how fast the run still trains.

A real server (`streamlit run app.py`) launches a long run of the Train page's defaults (a real click in Chromium),
then alternates windows: unwatched (no session open) and watched (30 protocol viewers, bench/st_client.py: 25 on
Train and 5 on Compare, each following the run as a browser does: Train's live board by fetching its feed's files,
Compare on its page's timer), plus one Chromium session on Train, a person's view). A protocol viewer renders
nothing, so the watched windows measure the server's work for a room, not thirty browsers sharing two cores.

Figures:
- watched_speed_ratio: the run's lane steps per second in watched windows ÷ unwatched (median over rounds; counted
  afterwards from the run's own records, t_wall_s). Goal >= 0.8.
- chart_lag_p95_s: from a step's record (its t_wall_s) to that step drawn in the Chromium session's loss chart (its
  first trace's last point, polled every POLL_S). Goal <= 1.5.
- server_cpu_ms_per_viewer_s: the server's CPU time beside its run's training thread (the busiest thread of the
  first unwatched window), per second watched minus unwatched, per viewer (ms/s). The process as a whole is no
  measure: its threads share one interpreter lock, so it stays near one core busy watched or not.
Beside them, per window, the cores each process kept busy and what the viewers received.

    python3 -m bench.room_watch [--rounds 3] [--window 10] [--viewers 30] [--compare 5]
        [--screenshot artifacts/room_watch_train.png]
Last line: watched_speed_ratio=<median over rounds>.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from bench.st_client import Room, Viewer
from bench.viewers import (
    CHROMIUM,
    CHROMIUM_ARGS,
    SCROLL_TO_TOP,
    VIEWPORT,
    cores_busy,
    cpu_seconds,
    lane_steps_per_s,
    launch_in_server,
    new_run,
    reader,
)
from tests import streamlit_server
from tests.test_browser import PAINTED, PLOTS

SETTLE_S = 2.0
"""After every viewer's first page run, before a window starts: the room's openings are not the window's work."""
OPEN_TIMEOUT_S = 180.0
POLL_S = 0.1
LAST_DRAWN = """() => {
    for (const frame of document.querySelectorAll('iframe')) {
        const doc = frame.contentDocument;
        for (const chart of doc ? doc.querySelectorAll('.js-plotly-plot') : []) {
            const title = chart.layout && chart.layout.title && chart.layout.title.text;
            if (!title || !title.includes('Loss') || !chart.data || !chart.data.length) continue;
            const xs = chart.data[0].x || [];
            return xs.length ? [chart.data[0].name, xs[xs.length - 1]] : null;
        }
    }
    return null;
}"""
"""The Train page's live loss chart (on pages/live_chart.py's board, a same-origin frame): its first trace's name and
last step."""
EVERY_CHART_DRAWN = f"""() => ({PLOTS})().every(div => !(div.data || []).some(trace => (trace.x || []).length)
    || div.querySelectorAll('.trace').length > 0)"""
"""Every chart that holds points has drawn its traces (not caught between a redraw's clearing and its drawing)."""


def open_room(url: str, viewers: int, on_compare: int) -> Room:
    """`viewers` protocol sessions, the last `on_compare` of them on Compare, each past its first page run."""
    room = Room([Viewer(url, "compare" if i >= viewers - on_compare else "") for i in range(viewers)]).start()
    opened = room.wait(lambda: all(v.runs_finished >= 1 or v.error for v in room.viewers), OPEN_TIMEOUT_S)
    failed = [v.error for v in room.viewers if v.error]
    if not opened or failed:
        room.stop()
        raise RuntimeError(f"viewers did not open: {failed[:3] or 'timed out'}")
    return room


def follow_chart(page, seconds: float) -> list[tuple[float, str, int]]:
    """(wall time, trace name, step) each time the loss chart's last drawn step moved, for `seconds`."""
    seen: list[tuple[float, str, int]] = []
    deadline = time.monotonic() + seconds
    last = None
    while time.monotonic() < deadline:
        drawn = page.evaluate(LAST_DRAWN)
        now = time.time()
        if drawn is not None and drawn != last:
            seen.append((now, drawn[0], int(drawn[1])))
            last = drawn
        time.sleep(POLL_S)
    return seen


def save_screenshot(page, path: Path) -> None:
    """The presenter's Train page, its run picker scrolled to the top, once every chart in view has painted."""
    page.get_by_text("Run", exact=True).first.evaluate(SCROLL_TO_TOP)  # the run picker at the top, below the header
    page.wait_for_function(EVERY_CHART_DRAWN, timeout=OPEN_TIMEOUT_S * 1000)
    page.evaluate(PAINTED)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))


def thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of process `pid`, and of the whole process under key 0 (its
    ended threads too: a session's script runs on a thread that ends with the run)."""
    process = psutil.Process(pid)
    times = process.cpu_times()
    found = {thread.id: thread.user_time + thread.system_time for thread in process.threads()}
    found[0] = times.user + times.system
    return found


def beside_run(before: dict[int, float], after: dict[int, float], run_thread: int, seconds: float) -> float:
    """Cores the server process kept busy beside its run's training thread between two thread_seconds snapshots:
    what its sessions cost. (The process as a whole stays near one core watched or not: its threads share one
    interpreter lock, so what the sessions take the run loses, and only this split shows it.)"""
    whole = after[0] - before[0]
    run = after.get(run_thread, 0.0) - before.get(run_thread, 0.0)
    return (whole - run) / seconds


def lags(store: Path, run_id: str, seen: list[tuple[float, str, int]]) -> list[float]:
    """Seconds from each drawn step's record (its lane's, by the trace's mode) to when it was first seen drawn."""
    frame = reader(store).steps(run_id, strict=False)
    recorded = {(str(mode), int(step)): float(t) for mode, step, t in
                zip(frame["mode"], frame["step"], frame["t_wall_s"], strict=True)}
    return [now - recorded[(mode, step)] for now, mode, step in seen if (mode, step) in recorded]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--viewers", type=int, default=30, help="protocol viewers in a watched window")
    parser.add_argument("--compare", type=int, default=5, help="of them, on the Compare page")
    parser.add_argument("--screenshot", type=Path, default=Path("artifacts/room_watch_train.png"),
                        help="the presenter's Train page while the room watches (PNG)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    quiet, watched, seen = [], [], []
    busy: dict[str, list] = {"unwatched": [], "watched": []}
    sessions: dict[str, list] = {"unwatched": [], "watched": []}  # the server's cores beside its run's thread
    received = []  # per watched window, per viewer per second: bytes, fragment runs, feed files fetched
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        store = Path(folder) / "runs.sqlite3"
        port = streamlit_server.free_port()
        url = f"http://127.0.0.1:{port}"
        server = streamlit_server.start(port, store, output=subprocess.DEVNULL)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        roles = {"server_and_run": server.pid}
        try:
            streamlit_server.wait_healthy(port, server)
            launch_in_server(browser, url)
            run_id = new_run(store, set())
            run_thread = 0
            for round_ in range(args.rounds):
                time.sleep(SETTLE_S)
                before, threads, t0 = cpu_seconds(roles), thread_seconds(server.pid), time.time()
                time.sleep(args.window)
                quiet.append((t0, time.time()))
                busy["unwatched"].append(cores_busy(before, cpu_seconds(roles), quiet[-1][1] - t0))
                after = thread_seconds(server.pid)
                if not run_thread:  # the run's training thread: the busiest of an unwatched window
                    run_thread = max((tid for tid in after if tid), key=lambda tid: after[tid] - threads.get(tid, 0))
                sessions["unwatched"].append(beside_run(threads, after, run_thread, quiet[-1][1] - t0))

                room = open_room(url, args.viewers, args.compare)
                context = browser.new_context(viewport=VIEWPORT)
                page = context.new_page()
                page.goto(url)
                page.wait_for_function(f"() => ({LAST_DRAWN})() !== null", timeout=OPEN_TIMEOUT_S * 1000)
                time.sleep(SETTLE_S)
                counts = [(v.bytes, v.fragment_runs, v.feed_fetches) for v in room.viewers]
                before, threads, t0 = cpu_seconds(roles), thread_seconds(server.pid), time.time()
                seen += follow_chart(page, args.window)
                watched.append((t0, time.time()))
                seconds = watched[-1][1] - t0
                busy["watched"].append(cores_busy(before, cpu_seconds(roles), seconds))
                sessions["watched"].append(beside_run(threads, thread_seconds(server.pid), run_thread, seconds))
                received.append(tuple(
                    statistics.mean((now - then) / seconds for now, then in zip(
                        [(v.bytes, v.fragment_runs, v.feed_fetches)[field] for v in room.viewers],
                        [count[field] for count in counts], strict=True)) for field in range(3)))
                if round_ == args.rounds - 1 and args.screenshot:
                    save_screenshot(page, args.screenshot)
                context.close()
                room.stop()
        finally:
            browser.close()
            streamlit_server.stop(server)  # stops its run (its last records flushed)
        q, w = lane_steps_per_s(store, run_id, quiet), lane_steps_per_s(store, run_id, watched)
        lag = lags(store, run_id, seen)
    for kind, windows in busy.items():  # where the cores went: the server (its run's thread too), the browser
        roles = sorted({role for found in windows for role in found})
        print(f"{kind}_cores_busy=" + ",".join(
            f"{role}:" + "/".join(f"{found.get(role, 0.0):.2f}" for found in windows) for role in roles))
    print("unwatched_lane_steps_per_s=" + ",".join(f"{v:.0f}" for v in q))
    print("watched_lane_steps_per_s=" + ",".join(f"{v:.0f}" for v in w))
    print("viewer_bytes_per_s=" + ",".join(f"{b:.0f}" for b, _, _ in received))
    print("viewer_fragment_runs_per_s=" + ",".join(f"{f:.2f}" for _, f, _ in received))
    print("viewer_feed_fetches_per_s=" + ",".join(f"{f:.2f}" for _, _, f in received))
    print(f"chart_moves_seen={len(seen)}")
    for kind, cores in sessions.items():
        print(f"{kind}_server_cores_beside_run=" + "/".join(f"{value:.3f}" for value in cores))
    extra = statistics.median(sessions["watched"]) - statistics.median(sessions["unwatched"])
    print(f"server_cpu_ms_per_viewer_s={extra * 1000 / (args.viewers + 1):.2f}")
    print(f"chart_lag_p95_s={float(np.percentile(lag, 95)) if lag else float('nan'):.2f}")
    print(f"watched_speed_ratio={statistics.median(b / a for a, b in zip(q, w, strict=True)):.3f}")


if __name__ == "__main__":
    main()
