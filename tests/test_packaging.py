"""The package people install: one dependency list, the console script, shipped data, safe server defaults, and CI
running exactly the README's test command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from amp_core import cli

ROOT = Path(__file__).resolve().parents[1]


def requirement_lines(name: str) -> list[str]:
    lines = (ROOT / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_runtime_requirements_are_pinned_and_need_no_scikit_learn():
    runtime = requirement_lines("requirements.txt")
    names = {re.split(r"==", line)[0].lower() for line in runtime}
    assert "torch==2.13.0" in runtime
    assert {"streamlit", "plotly", "pandas", "numpy", "pyarrow", "psutil", "tqdm"} <= names
    assert not names & {"scikit-learn", "sklearn", "scipy", "pytest", "playwright", "ruff"}
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*", line) for line in runtime), runtime


def test_dev_requirements_add_the_test_tools_to_the_runtime_ones():
    dev = requirement_lines("requirements-dev.txt")
    assert dev[0] == "-r requirements.txt"
    assert {line.split("==")[0] for line in dev[1:]} == {"pytest", "pytest-timeout", "pytest-xdist", "execnet",
                                                         "playwright", "ruff"}


def test_pyproject_reads_its_dependencies_from_requirements_txt():
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml", reason="setuptools is not installed")
    project = pyprojecttoml.read_configuration(ROOT / "pyproject.toml", expand=True)["project"]
    assert project["name"] == "amp-lab" and project["requires-python"] == ">=3.11"
    assert project["dependencies"] == requirement_lines("requirements.txt")
    assert project["scripts"] == {"amp-lab": "amp_core.cli:main"}
    assert callable(cli.main)


def test_package_data_ships_the_workloads_data():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    (pattern,) = setuptools["package-data"]["amp_core.workloads"]
    shipped = {path.name for path in (ROOT / "amp_core" / "workloads").glob(pattern)}
    assert {"digits_8x8.npz", "DIGITS.md", "sonnets.txt"} <= shipped


def test_the_server_stays_on_this_machine_and_hides_deploy():
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"
    assert config["client"]["toolbarMode"] == "viewer"  # Streamlit 1.67: no Deploy / Rerun / Clear cache


def test_ci_runs_exactly_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.DOTALL).group(1).strip()
    assert command == "python3 -m pip install -r requirements-dev.txt -e '.[all]' && python3 -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == command
    assert ci.index("python3 -m ruff check .") < len(ci) - 1


def test_every_extra_is_pinned_and_the_suite_installs_them_all():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    everything = extras.pop("all")
    assert everything == [f"amp-lab[{','.join(extras)}]"], "the 'all' extra names every other extra"
    for name, requirements in extras.items():
        for requirement in requirements:
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?==[0-9][0-9A-Za-z.]*", requirement), (name, requirement)
