"""Runs found by name: `amp-lab list` shows each run's name and filters by name (substring or glob) and status; the
run pickers show the name, or the id of a run that has none. Real Monitor runs in a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from amp_core.attach.monitor import Monitor
from amp_core.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _monitor_run(name: str, steps: int = 3) -> str:
    """A short real run of a user's loop under a Monitor named `name`; its run_id."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, optimizer, name=name) as monitor:
        for _ in range(steps):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            monitor.step(loss)
    return monitor.run_id


@pytest.fixture
def three_runs() -> dict[str, str]:
    return {name: _monitor_run(name) for name in ("my fine-tune", "nightly bf16", "")}


def _listed(capsys, *flags: str) -> list[str]:
    assert main(["list", *flags]) == 0
    return capsys.readouterr().out.splitlines()


def test_list_shows_names_and_filters(three_runs, capsys):
    lines = _listed(capsys)
    assert len(lines) == 3
    for name, run_id in three_runs.items():
        line = next(line for line in lines if line.startswith(run_id))
        assert (name or "(no name)") in line and "finished" in line

    assert [line.split()[0] for line in _listed(capsys, "--name", "FINE")] == [three_runs["my fine-tune"]]
    assert [line.split()[0] for line in _listed(capsys, "--name", "nightly*")] == [three_runs["nightly bf16"]]
    assert [line.split()[0] for line in _listed(capsys, "--name", "*b??6")] == [three_runs["nightly bf16"]]
    assert len(_listed(capsys, "--status", "finished")) == 3
    assert "match the filters" in _listed(capsys, "--status", "live")[0]
    assert "match the filters" in _listed(capsys, "--status", "running,failed")[0]
    assert "match the filters" in _listed(capsys, "--name", "fine", "--status", "stopped")[0]


def test_list_refuses_an_unknown_status(three_runs, capsys):
    assert main(["list", "--status", "finished,done"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: status:") and "'done'" in err[0]


def test_pickers_show_the_name_or_the_id(three_runs):
    at = AppTest.from_file(str(ROOT / "pages" / "overflow_debugger.py"), default_timeout=60).run()
    assert not at.exception, at.exception
    picker = at.selectbox(key="dbg_run")
    for name, run_id in three_runs.items():
        assert any(label.startswith(f"{name or run_id} · ") for label in picker.options), (name, picker.options)
