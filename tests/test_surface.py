"""The engine's public surface (amp_core.surface): a package's `__all__` names load on first use, each the very
object its module defines, so the pages' short list of imports costs no more than their thirty modules did."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from amp_core.surface import lazy_surface

ROOT = Path(__file__).resolve().parents[1]
LAZY_PACKAGES = ("amp_core", "amp_core.diagnostics", "amp_core.probes", "amp_core.race", "amp_core.records")


def run_fresh(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_a_surface_package_loads_none_of_its_names_until_one_is_asked_for():
    result = run_fresh(
        "import json, sys\n"
        f"for name in {LAZY_PACKAGES!r}: __import__(name)\n"
        "def loaded(*packages): return sorted(m for m in sys.modules if m.startswith(packages))\n"
        "before = loaded('amp_core.diagnostics.', 'amp_core.race.', 'amp_core.probes.', 'amp_core.access')\n"
        "torch_before = 'torch' in sys.modules\n"
        "from amp_core.diagnostics import start_bisect\n"
        "print(json.dumps({'before': before, 'torch': torch_before, 'after': loaded('amp_core.diagnostics.')}))")
    assert result["before"] == [] and result["torch"] is False
    assert "amp_core.diagnostics.bisect" in result["after"]
    assert not {"amp_core.diagnostics.plan_search", "amp_core.diagnostics.advise"} & set(result["after"]), (
        "asking for the bisect built the plan search or the advisor too")


def test_every_public_name_resolves_to_its_modules_own_object():
    result = run_fresh(
        "import importlib, json\n"
        "missing, listed = [], []\n"
        f"for name in {LAZY_PACKAGES!r}:\n"
        "    package = importlib.import_module(name)\n"
        "    for public in package.__all__:\n"
        "        try:\n"
        "            getattr(package, public)\n"
        "        except AttributeError as error:\n"
        "            missing.append(f'{name}.{public}: {error}')\n"
        "    listed += [f'{name}.{public}' for public in package.__all__ if public not in dir(package)]\n"
        "import amp_core.diagnostics, amp_core.diagnostics.plan_report, amp_core.probes, amp_core.probes.formats\n"
        "same = [amp_core.diagnostics.PLAN_LADDER is amp_core.diagnostics.plan_report.LADDER,\n"
        "        amp_core.probes.formats is importlib.import_module('amp_core.probes.formats'),\n"
        "        amp_core.diagnostics.start_bisect.__module__ == 'amp_core.diagnostics.bisect']\n"
        "print(json.dumps({'missing': missing, 'listed': listed, 'same': same}))")
    assert result == {"missing": [], "listed": [], "same": [True, True, True]}


def test_a_name_is_read_from_its_module_at_each_access(monkeypatch):
    """Nothing is copied onto the package: a module's attribute replaced (as a test does) is what the package shows."""
    import amp_core.diagnostics
    from amp_core.diagnostics import bisect

    def planted(*args, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(bisect, "start_bisect", planted)
    assert amp_core.diagnostics.start_bisect is planted
    monkeypatch.undo()
    assert amp_core.diagnostics.start_bisect is bisect.start_bisect


def test_a_name_off_the_surface_is_refused_by_name():
    import amp_core.race

    with pytest.raises(AttributeError, match=r"module 'amp_core\.race' has no attribute 'no_such_name'"):
        amp_core.race.no_such_name  # noqa: B018
    with pytest.raises(ImportError, match=r"cannot import name 'no_such_name' from 'amp_core\.race'"):
        from amp_core.race import no_such_name  # noqa: F401


@pytest.mark.parametrize("where", ["", ".runner", "runner.RunManager.start", "runner."])
def test_a_surface_entry_that_is_not_a_module_or_its_attribute_is_refused(where):
    refused = f"amp_core.race.name: {where!r} is not 'module' or 'module.attribute'"
    with pytest.raises(ValueError, match=re.escape(refused)):
        lazy_surface("amp_core.race", {"name": where})
