"""Does the cost probe agree with the run? The Train page's probe figures against the run launched right after them.

Each of the starts is a fresh server (`streamlit run app.py`, tests/streamlit_server.py) on an empty store, and a
headless Chromium (Playwright) that does what a user does first: opens the Train page with its default workload and
modes, waits for the cost table (each mode's ms/step as the server's probe raced it), presses Launch (the default
steps) and watches the run to its end. The run's figures are its lanes' median ms/step, read from the store
afterwards (views.summary.summarize, the figure the headline cards and Compare show). Per mode other than 32-true:
ratio = the mode's ms/step ÷ 32-true's, error = |probe ratio ÷ run ratio − 1|.

    python3 -m bench.probe_agreement [--starts 5] [--steps N]
Prints `start=i mode=… probe=… run=… error=…` per start and mode; last line: probe_vs_run_max_error=<the largest
error>. Target: <= 0.20.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from amp_core.precision import BASELINE_MODE
from amp_core.views.summary import summarize
from bench.viewers import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, reader
from tests import streamlit_server

# The cost table is Markdown, drawn as an HTML table: each row's mode and ms/step once it is there, else null.
COST_TABLE = """() => {
    for (const table of document.querySelectorAll('table')) {
        const heads = [...table.querySelectorAll('th')].map(th => th.innerText.trim());
        const mode = heads.indexOf('mode'), ms = heads.indexOf('ms / step'), by = heads.indexOf('measured by');
        if (mode < 0 || ms < 0) continue;
        const rows = [...table.querySelectorAll('tbody tr')].map(tr => [...tr.querySelectorAll('td')]
            .map(td => td.innerText.trim()));
        return rows.map(cells => ({mode: cells[mode], ms: cells[ms], by: cells[by]}));
    }
    return null;
}"""
RUN_FINISHED = "() => document.body.innerText.includes('Run status: finished')"
SETTLED = "() => document.querySelectorAll('[data-stale=\"true\"]').length === 0"
TIMEOUT_MS = 300_000


def probe_and_run(browser, url: str, steps: int | None) -> dict[str, float]:
    """Open the Train page, read the probe's ms/step per mode, launch the default run (`steps`: that many steps) and
    wait for its end."""
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.goto(url)
        rows = page.wait_for_function(COST_TABLE, timeout=TIMEOUT_MS).json_value()
        sources = {row["by"] for row in rows}
        if sources != {"cost probe"}:  # a fresh server has no run to learn from: the figures must be the probe's
            raise RuntimeError(f"the cost table's figures were measured by {sources}, not the cost probe")
        if steps is not None:
            page.get_by_label("Steps", exact=True).fill(str(steps))
            page.get_by_label("Steps", exact=True).press("Enter")
            page.wait_for_function(SETTLED, timeout=TIMEOUT_MS)
        page.get_by_role("button", name="Launch").click()
        page.wait_for_function(RUN_FINISHED, timeout=TIMEOUT_MS)
        return {row["mode"]: float(row["ms"]) for row in rows}
    finally:
        context.close()


def run_medians(store: Path) -> dict[str, float]:
    """The one run's median ms/step per mode, as summarize gives it."""
    found = reader(store)
    (run_id,) = found.runs()["run_id"]
    summary = summarize(found.steps(run_id))
    return dict(zip(summary["mode"], summary["median_ms"].astype(float), strict=True))


def one_start(browser, steps: int | None) -> tuple[dict[str, float], dict[str, float]]:
    """(probe ms/step, run median ms/step) per mode, on a fresh server with an empty store."""
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder) / "runs.sqlite3"
        port = streamlit_server.free_port()
        server = streamlit_server.start(port, store, output=subprocess.DEVNULL)
        try:
            streamlit_server.wait_healthy(port, server)
            probe = probe_and_run(browser, f"http://127.0.0.1:{port}", steps)
        finally:
            streamlit_server.stop(server)  # its run's records are all flushed by now
        return probe, run_medians(store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--steps", type=int, help="steps of the run (default: the Train page's, what a user launches "
                        "first; its run is then over in a second or so, and a moment of noise moves its medians)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    errors = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            for start in range(args.starts):
                probe, run = one_start(browser, args.steps)
                print(f"start={start} probe_ms=" + ",".join(f"{mode}:{ms:.3g}" for mode, ms in probe.items())
                      + " run_ms=" + ",".join(f"{mode}:{ms:.3g}" for mode, ms in run.items()), flush=True)
                for mode in probe:
                    if mode == BASELINE_MODE:
                        continue
                    probe_ratio = probe[mode] / probe[BASELINE_MODE]
                    run_ratio = run[mode] / run[BASELINE_MODE]
                    error = abs(probe_ratio / run_ratio - 1)
                    errors.append(error)
                    print(f"start={start} mode={mode} probe={probe_ratio:.3f} run={run_ratio:.3f} error={error:.3f}",
                          flush=True)
        finally:
            browser.close()
    print(f"probe_vs_run_max_error={max(errors):.3f}")


if __name__ == "__main__":
    main()
