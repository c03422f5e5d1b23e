"""Defaults exist once: the CLI's flags and the Train form's widgets start from RunConfig's defaults and show its
fields' docstrings as their help (config.py is the one source)."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core import cli
from amp_core.config import (
    FAULT_GRAMMAR,
    INSPECT_DEFAULTS,
    RUN_DEFAULTS,
    FaultSpec,
    InspectConfig,
    RunConfig,
    ScalerConfig,
    field_docs,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS, SCALER_DOCS = field_docs(RunConfig), field_docs(ScalerConfig)


def test_every_config_field_has_its_docstring():
    assert set(DOCS) == {f for f in RunConfig.__dataclass_fields__}
    assert set(SCALER_DOCS) == {f for f in ScalerConfig.__dataclass_fields__}
    assert DOCS["steps"] == "Optimizer steps per lane."
    assert set(field_docs(InspectConfig)) == set(InspectConfig.__dataclass_fields__)


def test_amp_lab_run_without_flags_is_the_default_run_config():
    args = cli.build_parser().parse_args(["run"])
    assert cli.config_from_args(args) == RunConfig()


def run_flags(command: str = "run") -> dict[str, object]:
    (run,) = [action.choices[command] for action in cli.build_parser()._subparsers._group_actions]
    return {action.dest: action for action in run._actions}


@pytest.mark.parametrize("name", ["workload", "modes", "steps", "batch_size", "lr", "optimizer", "eps",
                                  "fused_optimizer", "scheduler", "seed", "seeds", "size", "device", "data_dir",
                                  "grad_clip", "amax_every", "snapshot_every", "snapshot_keep"])
def test_a_run_flag_says_its_fields_docstring(name):
    action = run_flags()[name]
    assert action.help.replace("%%", "%").startswith(DOCS[name])


@pytest.mark.parametrize("name", ["init_scale", "growth_interval"])
def test_a_scaler_flag_says_its_fields_docstring(name):
    action = run_flags()[name]
    assert action.help.startswith(SCALER_DOCS[name]) and action.default == getattr(RUN_DEFAULTS.scaler, name)


@pytest.mark.parametrize(("command", "names"), [
    ("trace", {"workload", "size", "device"}),
    ("numerics", {"workload", "size", "device", "batch_size"}),
    ("maxbatch", {"workload", "modes", "size", "device", "optimizer"}),
])
def test_the_tool_commands_take_their_defaults_and_help_from_the_config(command, names):
    """trace, numerics and maxbatch start from RunConfig's workload, size, device (auto, as a run), ... and their
    one mode from InspectConfig; each flag's help is its field's docstring."""
    flags = run_flags(command)
    for name in names:
        default = getattr(RUN_DEFAULTS, name)
        assert flags[name].default == (",".join(default) if isinstance(default, tuple) else default), name
        assert flags[name].help.replace("%%", "%").startswith(DOCS[name]), name
    assert flags["device"].default == "auto"
    if command != "maxbatch":
        field = f"{command}_mode"
        assert flags["mode"].default == getattr(INSPECT_DEFAULTS, field)
        assert flags["mode"].help.startswith(field_docs(InspectConfig)[field])


def test_the_workshop_device_flag_is_the_run_configs():
    (workshop,) = [action.choices["workshop"] for action in cli.build_parser()._subparsers._group_actions]
    (run,) = [action.choices["run"] for action in workshop._subparsers._group_actions]
    device = next(action for action in run._actions if action.dest == "device")
    assert device.default == RUN_DEFAULTS.device and device.help.startswith(DOCS["device"])


def test_the_fault_grammar_is_written_once_and_quoted():
    """config.FAULT_GRAMMAR is the one explanation: the CLI's --fault help, the FaultSpec docs and docs/cli.md quote it,
    and its examples parse."""
    assert FAULT_GRAMMAR in run_flags()["fault"].help
    assert "FAULT_GRAMMAR" in FaultSpec.__doc__
    assert FAULT_GRAMMAR in " ".join((ROOT / "docs" / "cli.md").read_text().split())
    for example in ("loss_scale:1e6@50+10", "grad_inf:fc1.weight@30", "grad_nan@30", "lr_scale:10@100+20",
                    "init_scale:1024", "batch_outlier:1000@40"):
        assert f"{example} (" in FAULT_GRAMMAR or f"{example}," in FAULT_GRAMMAR
        assert FaultSpec.parse(example).kind == example.split(":")[0].split("@")[0]


FOLDED = ("train_scaler_open", "train_more_open")
"""The Train form's folded sections (drawn only while open: `on_change="rerun"` expanders)."""


def open_folded(at: AppTest, is_open: bool = True) -> AppTest:
    for key in FOLDED:
        at.session_state[key] = is_open
    return at.run()


def test_the_train_form_starts_from_the_run_config_defaults_and_says_their_docstrings():
    at = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run()
    assert not at.exception
    assert not any(w.key == "train_eps" for w in at.number_input)  # folded: not drawn on the first paint
    open_folded(at)
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
    assert FAULT_GRAMMAR in at.text_input(key="train_faults").help


def test_the_folded_settings_keep_their_values_while_closed_and_the_form_uses_them():
    at = open_folded(AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run())
    at.number_input(key="train_init_scale").set_value(1024.0)
    at.text_input(key="train_name").set_value("my fine-tune")
    at.text_input(key="train_faults").set_value("loss_scale:1e6@50+oops").run()
    assert any("faults" in error.value for error in at.error), [error.value for error in at.error]
    open_folded(at, False)
    assert not any(w.key == "train_init_scale" for w in at.number_input)
    # Still the form's: the bad fault is still refused with the section closed, and reopening shows every value.
    assert any("faults" in error.value for error in at.error), [error.value for error in at.error]
    open_folded(at)
    assert not at.exception
    assert at.number_input(key="train_init_scale").value == 1024.0
    assert at.text_input(key="train_name").value == "my fine-tune"
    assert at.text_input(key="train_faults").value == "loss_scale:1e6@50+oops"


def test_the_fault_demo_starts_from_the_run_config_steps():
    """The Overflow debugger's demo form (and faults.demo_config) take the steps default from RunConfig alone."""
    from amp_core.probes import faults

    at = AppTest.from_file(str(ROOT / "pages" / "overflow_debugger.py"), default_timeout=120).run()
    assert not at.exception
    steps = at.number_input(key="dbg_steps")
    assert steps.value == RUN_DEFAULTS.steps and steps.help == DOCS["steps"]
    config = faults.demo_config(workload="digits_mlp", modes=("16-mixed",), kind="loss_scale", step=5)
    assert config.steps == RUN_DEFAULTS.steps
