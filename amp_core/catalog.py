"""What the dashboard lists before torch is imported: the precision modes and the built-in workloads, read from the
modules that define them (their constants and class attributes, by `ast`) without running them.

Importing torch takes seconds; the Train page's form needs only names, titles and sizes. precision/modes.py,
precision/options.py and the workload modules stay the one place those are written (tests/test_catalog.py checks
both readings agree). Plugin workloads and what the device can run are known once torch is imported.
"""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp_core.imports import parse_python

PACKAGE = Path(__file__).resolve().parent
PLUGINS_ENV = "AMP_LAB_WORKLOADS"
"""The environment variable naming workload plugin modules (comma-separated), loaded at start-up."""


def plugins_named() -> bool:
    """Whether $AMP_LAB_WORKLOADS names any plugin module (then the workload list waits for them to load)."""
    return any(name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(","))


@dataclass(frozen=True, slots=True)
class WorkloadEntry:
    """A built-in workload as the form lists it."""

    name: str
    title: str
    description: str
    sizes: tuple[str, ...]
    requires: tuple[str, ...] = ()
    """The optional extras it needs (`pip install -e '.[hf]'`); the form marks it when one is missing."""


def _constants(tree: ast.AST, names: set[str]) -> dict[str, Any]:
    """Literal values assigned to `names` directly in a module's or class's body."""
    found = {}
    for node in getattr(tree, "body", []):
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
            node, "target", None) if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in names and node.value is not None:
            found[target.id] = ast.literal_eval(node.value)
    return found


@functools.cache
def modes() -> tuple[tuple[str, ...], str, dict[str, str]]:
    """(MODES, BASELINE_MODE, MODE_HELP) as amp_core/precision/modes.py defines them."""
    tree = parse_python((PACKAGE / "precision" / "modes.py").read_text(encoding="utf-8"))
    found = _constants(tree, {"MODES", "BASELINE_MODE", "MODE_HELP"})
    return tuple(found["MODES"]), found["BASELINE_MODE"], dict(found["MODE_HELP"])


@functools.cache
def recipes() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """(RECIPE_OPTION_HELP then the block-scaled options' BLOCK_SCALED_HELP, RECIPE_PRESETS) as
    amp_core/precision/options.py and amp_core/formats/recipes.py define them."""
    tree = parse_python((PACKAGE / "precision" / "options.py").read_text(encoding="utf-8"))
    found = _constants(tree, {"RECIPE_OPTION_HELP", "RECIPE_PRESETS"})
    block = _constants(parse_python((PACKAGE / "formats" / "recipes.py").read_text(encoding="utf-8")),
                       {"BLOCK_SCALED_HELP"})
    return ({**found["RECIPE_OPTION_HELP"], **block["BLOCK_SCALED_HELP"]},
            {name: tuple(lanes) for name, lanes in found["RECIPE_PRESETS"].items()})


@functools.cache
def builtin_workloads() -> tuple[WorkloadEntry, ...]:
    """Every Workload subclass (directly, or through a base class of its own module) with a literal name in
    amp_core/workloads/*.py, sorted by title."""
    entries = []
    for path in sorted((PACKAGE / "workloads").glob("*.py")):
        workload_classes = {"Workload"}
        for node in parse_python(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and any(getattr(base, "id", "") in workload_classes
                                                      for base in node.bases):
                workload_classes.add(node.name)
                found = _constants(node, {"name", "title", "description", "sizes", "requires"})
                if found.get("name"):
                    entries.append(WorkloadEntry(found["name"], found.get("title", found["name"]),
                                                 found.get("description", ""), tuple(found.get("sizes", {})),
                                                 tuple(found.get("requires", ()))))
    return tuple(sorted(entries, key=lambda entry: entry.title.lower()))
