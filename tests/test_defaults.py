"""Defaults exist once: the CLI's flags and the Train form's widgets start from RunConfig's defaults and show its
fields' docstrings as their help (config.py is the one source)."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core import cli
from amp_core.config import RUN_DEFAULTS, RunConfig, ScalerConfig, field_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS, SCALER_DOCS = field_docs(RunConfig), field_docs(ScalerConfig)


def test_every_config_field_has_its_docstring():
    assert set(DOCS) == {f for f in RunConfig.__dataclass_fields__}
    assert set(SCALER_DOCS) == {f for f in ScalerConfig.__dataclass_fields__}
    assert DOCS["steps"] == "Optimizer steps per lane."


def test_amp_lab_run_without_flags_is_the_default_run_config():
    args = cli.build_parser().parse_args(["run"])
    assert cli.config_from_args(args) == RunConfig()


def run_flags() -> dict[str, object]:
    (run,) = [action.choices["run"] for action in cli.build_parser()._subparsers._group_actions]
    return {action.dest: action for action in run._actions}


@pytest.mark.parametrize("name", ["workload", "modes", "steps", "batch_size", "lr", "optimizer", "eps",
                                  "fused_optimizer", "scheduler", "seed", "seeds", "size", "device", "data_dir",
                                  "grad_clip", "amax_every"])
def test_a_run_flag_says_its_fields_docstring(name):
    action = run_flags()[name]
    assert action.help.replace("%%", "%").startswith(DOCS[name])


@pytest.mark.parametrize("name", ["init_scale", "growth_interval"])
def test_a_scaler_flag_says_its_fields_docstring(name):
    action = run_flags()[name]
    assert action.help.startswith(SCALER_DOCS[name]) and action.default == getattr(RUN_DEFAULTS.scaler, name)


def test_the_train_form_starts_from_the_run_config_defaults_and_says_their_docstrings():
    at = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run()
    assert not at.exception
    for key, name in {"train_steps": "steps", "train_batch": "batch_size", "train_lr": "lr", "train_seed": "seed",
                      "train_seeds": "seeds", "train_eps": "eps", "train_clip": "grad_clip"}.items():
        widget = at.number_input(key=key)
        assert widget.value == getattr(RUN_DEFAULTS, name) and widget.help == DOCS[name], key
    for key, name in {"train_init_scale": "init_scale", "train_growth": "growth_factor",
                      "train_backoff": "backoff_factor", "train_interval": "growth_interval"}.items():
        widget = at.number_input(key=key)
        assert widget.value == getattr(RUN_DEFAULTS.scaler, name) and widget.help == SCALER_DOCS[name], key
    assert at.selectbox(key="train_optimizer").value == RUN_DEFAULTS.optimizer
    assert at.selectbox(key="train_workload").value == RUN_DEFAULTS.workload
    assert at.toggle(key="train_fused").value == RUN_DEFAULTS.fused_optimizer
    assert at.toggle(key="train_onecycle").value == (RUN_DEFAULTS.scheduler == "onecycle")
