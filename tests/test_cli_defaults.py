"""The CLI states no default of its own where a config dataclass has one (config.py's RunConfig, ScalerConfig and
InspectConfig; the advisor's, the plan search's and the bisect's): every such flag's default is the field's, in the
flag's unit, and no `add_argument` in amp_core/cli.py writes it as a literal."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

from amp_core.cli import build_parser, config_default
from amp_core.config import InspectConfig, RunConfig, ScalerConfig
from amp_core.diagnostics import AdviseConfig, BisectConfig, PlanSearchConfig

CLI = Path(__file__).resolve().parents[1] / "amp_core" / "cli.py"
COMMAND_CONFIGS: dict[str, tuple[type, ...]] = {
    "run": (RunConfig, ScalerConfig), "maxbatch": (RunConfig,), "trace": (InspectConfig, RunConfig),
    "numerics": (InspectConfig, RunConfig), "advise": (AdviseConfig,), "plan": (PlanSearchConfig,),
    "bisect": (BisectConfig,), "workshop run": (RunConfig,),
}
"""Each command and the config dataclasses its flags set."""
RENAMED: dict[tuple[str, str], tuple[str, float]] = {
    ("advise", "budget_min"): ("budget_s", 60.0), ("plan", "budget_min"): ("budget_s", 60.0),
    ("plan", "out"): ("plan_path", 1.0), ("trace", "mode"): ("trace_mode", 1.0),
    ("numerics", "mode"): ("numerics_mode", 1.0),
}
"""(command, flag's dest) -> (the field it sets, how many of the field's units make one of the flag's)."""
ALL_FIELDS = {field.name for configs in COMMAND_CONFIGS.values() for cls in configs
              for field in dataclasses.fields(cls)} | {dest for _, dest in RENAMED}


def commands(parser: argparse.ArgumentParser, path: str = ""):
    """(command path, its parser) for every command and nested command (`workshop run`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{path} {name}".strip(), sub
                yield from commands(sub, f"{path} {name}".strip())


def expected_default(command: str, dest: str):
    """The default a flag must have, read from the dataclass field it sets; None for a flag that sets no field."""
    field, unit = RENAMED.get((command, dest), (dest, 1.0))
    for cls in COMMAND_CONFIGS.get(command, ()):
        if field in {f.name for f in dataclasses.fields(cls)}:
            default = config_default(cls, field)
            if isinstance(default, tuple):  # a list of names, comma-separated on the command line
                return ",".join(default)
            return default / unit if unit != 1.0 else default
    return None


def defaults_that_differ(parser: argparse.ArgumentParser) -> list[str]:
    wrong = []
    for command, sub in commands(parser):
        for action in sub._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS):
                continue
            expected = expected_default(command, action.dest)
            if expected is not None and action.default != expected:
                wrong.append(f"{command} {action.option_strings[0]}: {action.default!r}, the config's is {expected!r}")
    return wrong


def is_literal(node: ast.expr) -> bool:
    """A value written out (a number, a string, or arithmetic over them), not read from anywhere."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return is_literal(node.left) and is_literal(node.right)
    return False


def literal_defaults(source: str) -> list[str]:
    """`add_argument("--flag", default=<literal>)` where the flag sets a config field: the default written twice."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--")):
            continue
        dest = node.args[0].value.lstrip("-").replace("-", "_")
        for keyword in node.keywords:
            if keyword.arg == "default" and is_literal(keyword.value) and dest in ALL_FIELDS:
                found.append(f"line {node.lineno}: {node.args[0].value} default={ast.unparse(keyword.value)}")
    return found


def test_every_flag_that_sets_a_config_field_has_the_fields_default():
    parser = build_parser()
    assert defaults_that_differ(parser) == []
    seen = {(command, action.dest) for command, sub in commands(parser) for action in sub._actions
            if action.option_strings and expected_default(command, action.dest) is not None}
    assert {("plan", "budget_min"), ("advise", "candidates"), ("bisect", "budget"), ("run", "init_scale"),
            ("trace", "mode"), ("workshop run", "device")} <= seen, "the walk reaches every command's flags"


def test_no_flag_writes_a_config_default_as_a_literal():
    assert literal_defaults(CLI.read_text()) == []


def test_a_default_restated_or_changed_is_found():
    planted = ('p.add_argument("--size", default="small")\np.add_argument("--budget-min", default=10.0)\n'
               'p.add_argument("--steps", type=int, default=config_default(PlanSearchConfig, "steps"))\n'
               'p.add_argument("--format", default="csv")\n')
    assert literal_defaults(planted) == ["line 1: --size default='small'", "line 2: --budget-min default=10.0"]
    parser = build_parser()
    plan = dict(commands(parser))["plan"]
    next(action for action in plan._actions if action.dest == "seeds").default = 5
    assert defaults_that_differ(parser) == ["plan --seeds: 5, the config's is 3"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["advise", "--workload", "digits_mlp"], {"budget_min": AdviseConfig(workload="w").budget_s / 60,
                                              "candidates": "", "size": RunConfig().size}),
    (["plan", "--workload", "digits_mlp", "--target", "bf16-mixed+nvfp4"],
     {"budget_min": 10.0, "baseline": "bf16-mixed", "seeds": 3, "steps": 80, "out": ""}),
    (["bisect", "run-1", "--lane", "1"], {"budget": BisectConfig().budget}),
])
def test_the_parsed_defaults_build_the_configs_own_defaults(argv, expected):
    """What a command line without the flags parses to is what the config would have been (the plan's 10 minutes,
    3 seeds and 80 steps are what `amp-lab plan` did before its defaults were read from the dataclass)."""
    args = build_parser().parse_args(argv)
    assert {name: getattr(args, name) for name in expected} == expected
