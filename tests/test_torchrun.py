"""Real torchrun jobs (python -m torch.distributed.run, 2 processes, gloo): a DDP loop whose every rank runs a Monitor
writes both ranks' records through rank 0 (visible in an export with a `rank` column); ranks that skip different
steps are said; `amp-lab run --nproc 2` races the lanes in DDP and finishes with both ranks, a diverging lane stopped
on both; the Train and Compare pages show the ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from figure_json import spec, values
from streamlit.testing.v1 import AppTest

from amp_core.records.opening import open_store
from amp_core.records.store import RunStore

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def amp_lab(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amp_core", "--store", str(store), *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


def only_run(store: Path) -> tuple[RunStore, str]:
    opened = open_store(store)
    (run_id,) = opened.runs()["run_id"]
    return opened, run_id


def test_ddp_monitor_example_writes_both_ranks_through_rank_0(fresh_store, tmp_path):
    proc = torchrun("examples/ddp_monitor.py", "--steps", "30", "--store", str(fresh_store))
    assert proc.returncode == 0, proc.stderr[-3000:]
    store, run_id = only_run(fresh_store)
    run = store.run(run_id)
    assert run["status"] == "finished" and run["config"]["world_size"] == 2 and run["config"]["ddp"]
    assert [(t["rank"], t["records"]) for t in store.tracks(run_id)] == [(0, 30), (1, 30)]

    exported = amp_lab(fresh_store, "export", run_id, "--format", "csv", "--out", str(tmp_path / "run.csv"))
    assert exported.returncode == 0, exported.stderr
    frame = pd.read_csv(tmp_path / "run.csv")
    assert frame.groupby("rank").size().to_dict() == {0: 30, 1: 30}
    by_rank = {rank: part.set_index("step") for rank, part in frame.groupby("rank")}
    assert by_rank[0]["skipped"].equals(by_rank[1]["skipped"]) and by_rank[0]["skipped"].any()  # DDP: skip together
    assert not by_rank[0]["loss"].equals(by_rank[1]["loss"])  # each rank measured its own batches
    events = store.events(run_id)
    assert "rank_skip_mismatch" not in set(events["kind"])
    assert (events["kind"] == "skipped_step").sum() == by_rank[0]["skipped"].sum()  # said once, not per rank


def test_ranks_that_skip_different_steps_are_said(fresh_store):
    proc = torchrun("tests/ddp_skip_mismatch.py", "--store", str(fresh_store), "--poison-at", "7")
    assert proc.returncode == 0, proc.stderr[-3000:]
    store, run_id = only_run(fresh_store)
    frame = store.steps(run_id)
    assert frame[frame["skipped"]][["rank", "step"]].values.tolist() == [[1, 7]]
    events = store.events(run_id)
    (mismatch,) = events[events["kind"] == "rank_skip_mismatch"].itertuples()
    assert mismatch.step == 7 and mismatch.data["by_rank"] == {"0": [], "1": [7]}
    assert "rank 1 skipped 7" in mismatch.message
    (skip,) = events[events["kind"] == "skipped_step"].itertuples()
    assert skip.message.startswith("rank 1: optimizer step skipped: inf/NaN gradients in 0.weight")


RANKED_STEPS = 30


@pytest.fixture(scope="module")
def ranked_run(tmp_path_factory) -> tuple[Path, str]:
    """One `amp-lab run --nproc 2` race (its store, its run id), read by the race test and by the pages: three
    processes of torch and a rendezvous, made once for both."""
    store = tmp_path_factory.mktemp("ranked") / "runs.sqlite3"
    proc = amp_lab(store, "run", "--workload", "mlp_regression", "--modes", "32-true,16-mixed",
                   "--steps", str(RANKED_STEPS), "--nproc", "2", "--scheduler", "onecycle")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished (mlp_regression, cpu, 2 ranks)" in proc.stdout
    return store, only_run(store)[1]


def test_the_lane_race_runs_under_torchrun_with_nproc_2(ranked_run):
    path, run_id = ranked_run
    store = open_store(path)
    run = store.run(run_id)
    assert run["status"] == "finished" and [lane["status"] for lane in run["lanes"]] == ["finished"] * 2
    assert [(t["lane"], t["rank"], t["records"]) for t in store.tracks(run_id)] == \
        [(0, 0, RANKED_STEPS), (0, 1, RANKED_STEPS), (1, 0, RANKED_STEPS), (1, 1, RANKED_STEPS)]
    frame = store.steps(run_id)
    for _, lane in frame.groupby("lane"):
        ranks = {rank: part.set_index("step") for rank, part in lane.groupby("rank")}
        assert ranks[0]["skipped"].equals(ranks[1]["skipped"])
        assert not ranks[0]["loss"].equals(ranks[1]["loss"])  # each rank trains on its own batches
    assert "job" in set(store.events(run_id)["kind"])


def test_a_lane_that_diverges_under_nproc_stops_on_every_rank(fresh_store):
    proc = amp_lab(fresh_store, "run", "--workload", "mlp_regression", "--modes", "32-true,bf16-mixed",
                   "--steps", "400", "--nproc", "2", "--fault", "grad_nan@5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    store, run_id = only_run(fresh_store)
    run = store.run(run_id)
    assert run["status"] == "finished"
    assert [lane["status"] for lane in run["lanes"]] == ["diverged", "diverged"]
    tracks = {(t["lane"], t["rank"]): t["records"] for t in store.tracks(run_id)}
    for lane in (0, 1):
        assert tracks[(lane, 0)] == tracks[(lane, 1)] < 400  # both ranks stopped it at the same step
    diverged = store.events(run_id).query("kind == 'diverged'")
    assert sorted(diverged["lane"].astype(int)) == [0, 1] and diverged["message"].str.contains("on rank").all()


def test_train_and_compare_pages_show_each_rank(ranked_run, monkeypatch):
    store, run_id = ranked_run
    monkeypatch.setenv("AMP_LAB_STORE", str(store))  # the pages open the race's store
    at = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=180).run()
    assert not at.exception and at.selectbox(key="train_run_pick").value == run_id
    figures = {chart.key: spec(chart.proto.spec) for chart in at.get("plotly_chart")}
    bars = figures["train_chart_ranks"]["data"]
    assert [(bar["name"], bar["x"]) for bar in bars] == [("32-true", ["rank 0", "rank 1"]),
                                                         ("16-mixed", ["rank 0", "rank 1"])]
    names = [trace["name"] for trace in figures["train_chart_step_time"]["data"]]
    assert names == [f"{mode} · {part} of 2 ranks" for mode in ("32-true", "16-mixed")
                     for part in ("min", "max", "median")]
    (table,) = [frame.value for frame in at.dataframe if "vs_fastest" in frame.value]
    assert table[["mode", "rank"]].values.tolist() == [["32-true", 0], ["32-true", 1], ["16-mixed", 0],
                                                       ["16-mixed", 1]]
    assert (table["vs_fastest"] >= 1).all() and (table.groupby("mode")["vs_fastest"].min() == 1).all()
    (lanes,) = [frame.value for frame in at.dataframe if "progress" in frame.value]
    assert lanes["lane"].tolist() == ["32-true", "16-mixed"] and lanes["progress"].tolist() == [1.0, 1.0]

    at = AppTest.from_file(str(ROOT / "pages" / "compare.py"), default_timeout=180).run()
    assert not at.exception and not at.error
    (ranks,) = [frame.value for frame in at.dataframe if "vs_fastest" in frame.value]
    (summary,) = [frame.value for frame in at.dataframe if "speedup" in frame.value]
    assert ranks["rank"].tolist() == [0, 1, 0, 1] and ranks["lane"].str.startswith(("32-true", "16-mixed")).all()
    assert summary["steps"].tolist() == [RANKED_STEPS] * 2  # one row per lane, its ranks together
    figures = {chart.key: spec(chart.proto.spec) for chart in at.get("plotly_chart")}
    assert "cmp_chart_ranks" in figures
    lines = [values(trace["x"]) for trace in figures["cmp_chart_loss_vs_step"]["data"] if trace["mode"] == "lines"]
    # a lane's first rank, not ranks zig-zagging
    assert [line.tolist() for line in lines] == [list(range(RANKED_STEPS))] * 2
