"""A run's saved config is read back typed, in one place (amp_core.runs.StoredConfig): its defaults are RunConfig's,
a Monitor's extra settings are read as such, and no reader elsewhere picks a setting out of the dict by key."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from amp_core.config import RUN_DEFAULTS, FaultSpec, RunConfig
from amp_core.runs import RunInfo, SourceKind, StoredConfig, source_kind, writer_words

ROOT = Path(__file__).resolve().parents[1]
WRITERS = {"amp_core/records/store.py"}
"""Where a config dict is written (the store fills its columns from the dict it stores), not read back."""


def test_a_race_s_saved_config_reads_back_as_it_was_configured():
    config = RunConfig(workload="mlp_regression", modes=("32-true", "16-mixed"), steps=40, seeds=2, amax_every=5,
                       gradstats_every=10, faults=(FaultSpec.parse("loss_scale:1e6@5+2"),), name="x")
    read = StoredConfig.read(config.to_dict())
    for name in ("name", "workload", "size", "modes", "steps", "seeds", "device", "scheduler", "gradstats_every",
                 "amax_every"):
        assert getattr(read, name) == getattr(config, name), name
    assert [FaultSpec(**dict(f, modes=tuple(f["modes"]))) for f in read.faults] == list(config.faults)
    assert (read.source, read.layers_every, read.world_size, read.replay) == ("", 0, 1, {})


def test_a_setting_the_run_did_not_save_reads_as_run_config_s_default():
    """One source of defaults: the typed reader's are RunConfig's (a reader once wrote `.get("gradstats_every", 0)`
    where the default is 50)."""
    read = StoredConfig.read({"workload": "mlp_regression", "steps": None})
    for field in dataclasses.fields(StoredConfig):
        if hasattr(RUN_DEFAULTS, field.name):
            assert getattr(read, field.name) == getattr(RUN_DEFAULTS, field.name) or field.name == "workload"
    assert read.gradstats_every == RUN_DEFAULTS.gradstats_every == 50


def test_a_monitor_s_config_keeps_its_own_settings():
    saved = {"source": "monitor", "name": "mine", "workload": "Net", "modes": ["bf16-mixed"], "steps": 0,
             "optimizer": "adamw", "scheduler": "StepLR", "gradstats_every": 100, "memory_every": 25,
             "probe_budget": 0.01, "world_size": 2, "ddp": True, "integration": "Trainer", "layers_every": 200,
             "replay": {"on": True}, "script": "train.py", "host": "h", "pid": 7, "faults": []}
    read = StoredConfig.read(saved)
    assert (read.workload, read.modes, read.steps, read.scheduler) == ("Net", ("bf16-mixed",), 0, "StepLR")
    assert (read.layers_every, read.probe_budget, read.world_size, read.integration) == (200, 0.01, 2, "Trainer")
    assert read.replay == {"on": True} and read.amax_every == 0
    assert source_kind("r", saved) is SourceKind.INTEGRATION
    assert writer_words(SourceKind.INTEGRATION, saved, in_process=False) == \
        "the AMP Lab callback of a Trainer in `train.py`"
    info = RunInfo(run_id="r", config=saved, status="running", kind=SourceKind.INTEGRATION)
    assert info.settings == read


def settings_read_by_key(source: str, where: str) -> list[str]:
    """`<x>config.get(...)` and `<x>config[...]` in `source`: a saved config's settings picked by key."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            target = node.func.value
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target = node.value
        name = target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) \
            else ""
        if name == "config":
            found.append(f"{where}:{node.lineno}")
    return found


def test_no_reader_picks_a_run_setting_out_of_the_saved_dict():
    files = [path for folder in ("amp_core", "pages") for path in sorted((ROOT / folder).rglob("*.py"))] + \
        [ROOT / "app.py"]
    readers = [path for path in files
               if path.relative_to(ROOT).as_posix() not in WRITERS | {"amp_core/runs.py", "amp_core/config.py"}]
    found = [where for path in readers
             for where in settings_read_by_key(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not found, "read a run's settings through RunInfo.settings (StoredConfig):\n" + "\n".join(found)


@pytest.mark.parametrize("key", ["steps", 3])
def test_the_check_sees_a_read_by_key(key):
    """The check above can fail: it finds both forms, and not a typed read."""
    source = f"def f(info, config):\n    return info.config.get({key!r}), config[{key!r}], info.settings.steps\n"
    assert settings_read_by_key(source, "x.py") == ["x.py:2", "x.py:2"]


def test_the_final_loss_window_and_the_advice_budget_are_written_once():
    """Every default of the final-loss window and of the advice's budget is read from amp_core.config (two units, one
    value: the CLI and the page ask for minutes)."""
    import inspect

    from amp_core import cli
    from amp_core.config import ADVISE_BUDGET_S, FINAL_LOSS_WINDOW
    from amp_core.diagnostics.advise import LAST_K, AdviseConfig
    from amp_core.views import compare, report, summary
    from amp_core.workshop.evidence import FINAL_WINDOW

    windows = [inspect.signature(function).parameters["last_k"].default for function in (
        summary.rank_table, summary.summarize, summary.replicate_table, compare.format_replicates,
        compare.format_summary)]
    assert set(windows) | {LAST_K, report.LAST_K, FINAL_WINDOW} == {FINAL_LOSS_WINDOW}
    assert AdviseConfig(workload="mlp_regression").budget_s == ADVISE_BUDGET_S
    parsed = cli.build_parser().parse_args(["advise", "--workload", "mlp_regression"])
    assert parsed.budget_min * 60 == ADVISE_BUDGET_S
    page = (ROOT / "pages" / "advise.py").read_text()
    assert 'number_input("Budget (minutes)", value=ADVISE_BUDGET_S / 60' in page
