"""The README's promise, checked: with none of the optional extras (`pip install -e .` and the dev requirements only)
every test module imports and every test that needs an extra skips, naming the line that installs it; the workshop
says which scenario needs one. The extras stay installed on this machine: a real pytest runs in a subprocess where
their modules cannot be imported (sys.modules[name] = None, set by a sitecustomize that its own subprocesses inherit),
as if they had never been installed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from amp_core.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = sorted({*(module for extra in EXTRAS.values() for module in extra.modules),
                  "pytorch_lightning", "lightning_fabric", "psycopg_binary", "psycopg_c"})
"""Every module an extra brings that AMP Lab or its tests import, with the trainers' and the driver's other names."""


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory) -> dict[str, str]:
    """An environment in which no extra can be imported, by this process's children and theirs."""
    folder = tmp_path_factory.mktemp("no_extras")
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {BLOCKED!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError; importlib.util.find_spec says None\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH", "")]))
    check = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            f"print(sum(u.find_spec(n) is not None for n in {BLOCKED!r}))"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert check.stdout.strip() == "0", check.stdout + check.stderr  # the blocker works, or the test proves nothing
    return env


def test_every_module_imports_and_each_test_needing_an_extra_skips_saying_how_to_install_it(without_extras):
    """Collects the whole suite (every module imported without the extras) and runs the tests marked as needing an
    extra: each one skips, none fails or errors."""
    # One process (-n 0): the marked tests only skip, and two workers would each collect the whole suite again.
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0", "-m",
                           "extra", "tests"], cwd=ROOT, env=without_extras, capture_output=True, text=True, timeout=300)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not re.search(r"\d+ (failed|errors?)\b", summary) and "passed" not in summary, summary
    skipped = int(re.search(r"(\d+) skipped", summary).group(1))
    assert skipped >= 20, summary  # the recipe, workshop and browser tests that need torchao, at least
    reasons = re.findall(r"^SKIPPED \[\d+\] \S+: (.+)$", done.stdout, flags=re.MULTILINE)
    assert reasons and all("extra is not installed (pip install -e '.[" in reason for reason in reasons), reasons


def test_the_workshop_names_the_missing_extra_and_refuses_its_scenario_in_one_line(without_extras, tmp_path):
    listed = subprocess.run([sys.executable, "-m", "amp_core", "workshop", "list"], cwd=ROOT, env=without_extras,
                            capture_output=True, text=True, timeout=120)
    fp8 = next(line for line in listed.stdout.splitlines() if line.startswith("fp8 "))
    assert "needs the recipes extra (torchao, not installed here): pip install -e '.[recipes]'" in fp8
    done = subprocess.run([sys.executable, "-m", "amp_core", "--store", str(tmp_path / "runs.sqlite3"), "workshop",
                           "run", "fp8"], cwd=ROOT, env=without_extras, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert done.stderr.startswith("error: scenario: ") and "pip install -e '.[recipes]'" in done.stderr
