"""The shareable run report: one self-contained HTML file (every chart, the summary, config, events), user text
escaped, plotly.js inlined once; `export --format html` in a real process; it draws in Chromium with no network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from figure_json import values

from amp_core.config import FaultSpec, RunConfig
from amp_core.race.runner import Run, RunManager
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore
from amp_core.views import report

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NAME = '<script>alert("name")</script> & <b>bold</b>'


class Page(HTMLParser):
    """What a browser would find in the file: scripts (attributes, text), links, tables, text, every src/href."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.scripts: list[tuple[dict, str]] = []
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self._script: dict | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "script":
            self._script = attrs
            self.scripts.append((attrs, ""))

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)
        else:
            self.text.append(data)

    def figures(self) -> list[dict]:
        return [json.loads(text) for attrs, text in self.scripts if attrs.get("type") == "application/json"]

    def body_text(self) -> str:
        return " ".join(self.text)


def run_with_events(store: RunStore) -> Run:
    """A finished run with a skipped step (an inf gradient in the scaled lane), a lane that diverges (16-true with
    Adam's eps 1e-8), a run name and an error message full of HTML."""
    run = Run(RunConfig(workload="digits_mlp", modes=("32-true", "16-mixed", "16-true"), steps=12, batch_size=16,
                        name=NAME, faults=(FaultSpec(kind="grad_inf", step=4, modes=("16-mixed",)),)), store).start()
    run.join(120)
    assert run.status == "finished"
    assert [lane.status for lane in run.lanes] == ["finished", "finished", "diverged"]
    return run


@pytest.fixture
def stored(fresh_store) -> tuple[RunStore, str]:
    store = open_store(fresh_store)
    return store, run_with_events(store).run_id


def test_the_report_holds_every_chart_the_summary_config_and_events_and_escapes_user_text(stored):
    store, run_id = stored
    manager = RunManager(store)
    text = report.run_report_html(store, run_id)
    page = Page(text)

    # Self-contained: one inline plotly.js, no script/link/img loads anything, nothing names the network to load.
    assert not [attrs for tag, attrs in page.tags if "src" in attrs or (tag == "link")]
    code = [body for attrs, body in page.scripts if attrs.get("type") != "application/json"]
    assert len(code) == 2 and sum("Plotly" in body and len(body) > 1_000_000 for body in code) == 1  # plotly.js once
    assert "@import" not in text

    # Every chart, each with its traces and data.
    figures = page.figures()
    info = manager.run_info(run_id)
    expected = report.report_figures(manager, run_id, info)
    assert len(figures) == len(expected) == 7  # loss, step time, memory, scale, LR, loss vs time, loss difference
    assert [len(f["data"]) for f in figures] == [len(f.data) for f in expected]
    titles = [f["layout"]["title"]["text"] for f in figures]
    assert titles[0].startswith("Loss") and titles[1].startswith("Step time") and "GradScaler scale" in titles
    loss = {trace["name"]: values(trace["x"]) for trace in figures[0]["data"]}
    assert len(loss["32-true"]) == 12 and len(loss["16-true"]) >= 1 and "16-mixed skipped" in loss
    divs = {attrs.get("id") for tag, attrs in page.tags if tag == "div"}
    assert all(attrs["data-target"] in divs for attrs, _ in page.scripts if attrs.get("type") == "application/json")

    # The summary, the config, the events.
    body = page.body_text()
    tables = [attrs for tag, attrs in page.tags if tag == "table"]
    assert len(tables) == 2  # summary, events
    for heading in ("Summary", "Charts", "Events", "Configuration"):
        assert heading in body
    assert "final loss (mean of last 20)" in body and "speedup" in body and "★ 32-true" in body
    assert '"workload": "digits_mlp"' in body and '"steps": 12' in body
    assert "skipped_step" in body and "optimizer step skipped" in body
    assert "diverged" in body and "lane stopped: loss became" in body and "eps=1e-08 is 0 in float16" in body

    # What a user typed is text, never markup.
    assert NAME in body
    assert '<script>alert("name")' not in text and "&lt;script&gt;alert(&quot;name&quot;)" in text
    assert "<b>bold</b>" not in text


def test_a_seeded_run_reports_its_seeds_and_the_rule(fresh_store):
    store = open_store(fresh_store)
    run = Run(RunConfig(workload="mlp_regression", modes=("32-true", "bf16-mixed"), steps=8, batch_size=16,
                        seeds=2), store).start()
    run.join(120)
    page = Page(report.run_report_html(RunManager(store), run.run_id))
    body = page.body_text()
    assert "Across seeds" in body and "Welch-style" in body and "32-true · seed 1" in body
    loss = page.figures()[0]
    assert [t["name"] for t in loss["data"] if t.get("fill") == "tonexty"] == [
        "32-true · mean of 2 seeds (min-max band)", "bf16-mixed · mean of 2 seeds (min-max band)"]


def test_an_unknown_run_is_refused(fresh_store):
    with pytest.raises(ValueError, match="no run 'nope'"):
        report.run_report_html(open_store(fresh_store), "nope")


def cli(store: Path, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amp_core", "--store", str(store), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_cli_export_html_writes_the_report(tmp_path):
    store = tmp_path / "runs.sqlite3"
    done = cli(store, "run", "--workload", "mlp_regression", "--modes", "32-true,bf16-mixed", "--steps", "6",
               "--batch-size", "16", "--seeds", "2")
    assert done.returncode == 0, done.stderr
    assert "32-true seed 1" in done.stdout and "across 2 seeds per mode" in done.stdout and "rule:" in done.stdout
    (run_id,) = open_store(store).runs()["run_id"].tolist()
    out = tmp_path / "report.html"
    done = cli(store, "export", run_id, "--format", "html", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == out.resolve()
    page = Page(out.read_text(encoding="utf-8"))
    assert len(page.figures()) == 7 and "Across seeds" in page.body_text()
    # No -o: RUN_ID.html where it runs.
    done = cli(store, "export", run_id, "--format", "html", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / f"{run_id}.html").is_file()
    done = cli(store, "export", "no-such-run", "--format", "html", cwd=tmp_path)
    assert done.returncode == 2 and "no run 'no-such-run'" in done.stderr


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_the_report_draws_every_chart_offline_in_chromium(stored, tmp_path):
    from playwright.sync_api import sync_playwright

    from tests.test_browser import CHROMIUM_ARGS

    store, run_id = stored
    path = tmp_path / "report.html"
    path.write_text(report.run_report_html(store, run_id), encoding="utf-8")
    expected = len(Page(path.read_text(encoding="utf-8")).figures())
    asked: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 900})

            def only_the_file(route):  # the network is blocked: anything but the file itself is refused
                asked.append(route.request.url)
                if route.request.url.startswith("file://"):
                    route.continue_()
                else:
                    route.abort()

            context.route("**/*", only_the_file)
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(path.as_uri())
            page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot').length === {expected}",
                                   timeout=30_000)
            traces = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                                   ".map(div => div._fullData.filter(t => (t._length || 0) > 0).length)")
        finally:
            browser.close()
    assert not errors
    assert [url for url in asked if not url.startswith("file://")] == []
    assert len(traces) == expected and all(count > 0 for count in traces)
