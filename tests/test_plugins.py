"""Plugin workloads: a module named at start-up joins the registry and races like a built-in (in-process, through the
CLI in 3 modes, on the Train page, in the op inspector and layer numerics); a broken module says which and why, in
the CLI (exit 2) and in the sidebar, while the built-ins and the app go on; a stored run of a plugin that is not
loaded now still opens on every page."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import streamlit as st
from figure_json import points_by_trace, spec
from streamlit.testing.v1 import AppTest

from amp_core import workloads
from amp_core.config import RunConfig
from amp_core.probes.numerics import probe_workload
from amp_core.probes.optrace import trace_workload
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from amp_core.workloads import BUILT_IN, WORKLOADS, load_plugins, param_names
from tests import streamlit_server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODES = ("32-true", "16-mixed", "bf16-mixed")

BROKEN = {
    "plugin_missing_import": "import a_package_nobody_has_installed\n",
    "plugin_syntax": "def broken(:\n    pass\n",
    "plugin_raises": "raise RuntimeError('the plugin could not find its data')\n",
    "plugin_empty": "ANSWER = 42\n",
    "plugin_contract": """
        from torch import nn
        from amp_core.workloads import Data, Workload
        from amp_core.workloads.mlp_regression import MLPRegression

        class NoLoss(Workload):
            name = "no_loss"
            title = description = "no loss"
            sizes = {"small": {}}
            def load_data(self, config): ...
            def build_model(self, size, data): ...

        class OddSizes(MLPRegression):
            name = "odd_sizes"
            sizes = {"tiny": {}}

        class TakenName(MLPRegression):
            name = "digits_mlp"

        class NeedsArguments(MLPRegression):
            name = "needs_arguments"
            def __init__(self, width):
                self.width = width

        class WrongSignature(MLPRegression):
            name = "wrong_signature"
            def build_model(self, size):
                return nn.Linear(10, 1)

        class Fine(MLPRegression):
            name = "fine_plugin"
            title = "A plugin beside broken ones"
        """,
}
WHY = {
    "plugin_not_there": "no module named 'plugin_not_there' on the Python path (install the package that holds it, "
                        "or add its folder to PYTHONPATH)",
    "plugin_missing_import": "importing it failed: ModuleNotFoundError: No module named "
                             "'a_package_nobody_has_installed'",
    "plugin_syntax": "SyntaxError",
    "plugin_raises": "RuntimeError: the plugin could not find its data",
    "plugin_empty": "defines no Workload subclass",
}


@pytest.fixture
def plugin_path(tmp_path, monkeypatch) -> Path:
    """examples/ and a folder of broken plugins on the path; the registry holds only the built-ins meanwhile (a plugin
    another test loaded in this process, such as the keep-layer scenario's workload, is set aside) and is as it was
    afterwards."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    for name, source in BROKEN.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.syspath_prepend(str(folder))
    saved, origins = dict(WORKLOADS), dict(workloads.PLUGIN_ORIGINS)
    for name in origins:
        WORKLOADS.pop(name, None)
    workloads.PLUGIN_ORIGINS.clear()
    yield folder
    WORKLOADS.clear()
    WORKLOADS.update(saved)
    workloads.PLUGIN_ORIGINS.clear()
    workloads.PLUGIN_ORIGINS.update(origins)
    for name in [*BROKEN, "my_workload"]:
        sys.modules.pop(name, None)


def cli(store: Path, *args: str, extra_path: Path | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(str(p) for p in (ROOT, EXAMPLES, extra_path) if p)
    return subprocess.run([sys.executable, "-m", "amp_core", "--store", str(store), *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": path, **(env or {})}, capture_output=True, text=True,
                          timeout=600)


def test_a_plugin_joins_the_registry_and_every_tool_takes_it(plugin_path):
    assert load_plugins(["my_workload"]) == []
    assert list(WORKLOADS)[-1] == "sine_mlp" and workloads.PLUGIN_ORIGINS == {"sine_mlp": "my_workload"}
    assert load_plugins(["my_workload"]) == [] and list(WORKLOADS).count("sine_mlp") == 1  # loading again: no change
    assert param_names("sine_mlp") == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    trace = trace_workload("sine_mlp", "bf16-mixed")  # the op inspector
    assert any(record.module == "0" for record in trace.records)
    report = probe_workload("sine_mlp", "16-mixed")  # layer numerics
    assert {"0", "2", "4"} <= {module.module for module in report.modules} and report.params
    run = Run(RunConfig(workload="sine_mlp", modes=MODES, steps=15)).start()
    run.join(120)
    assert run.status == "finished" and [lane.status for lane in run.lanes] == ["finished"] * 3
    assert run.frame().groupby("mode").size().to_dict() == dict.fromkeys(MODES, 15)


@pytest.mark.parametrize("module", list(WHY))
def test_a_module_that_cannot_be_loaded_says_which_and_why(plugin_path, module):
    (problem,) = load_plugins([module])
    assert problem.module == module and WHY[module] in problem.why
    assert problem.message().startswith(f"workload plugin {module!r} not loaded: ")
    assert set(BUILT_IN) <= set(WORKLOADS)


def test_each_class_that_breaks_the_contract_says_why_and_the_good_one_loads(plugin_path):
    problems = {p.why.split(":")[0]: p.why for p in load_plugins(["plugin_contract"])}
    assert "does not define loss(output, target)" in problems["class NoLoss"]
    assert "'tiny'; a size is one of small, medium, large, xl" in problems["class OddSizes"]
    assert "'digits_mlp' is a built-in workload's" in problems["class TakenName"]
    assert "cannot be created without arguments" in problems["class NeedsArguments"]
    assert "build_model cannot be called as build_model(size, data)" in problems["class WrongSignature"]
    assert "class Fine" not in problems and "fine_plugin" in WORKLOADS
    assert type(WORKLOADS["digits_mlp"]).__module__ == "amp_core.workloads.digits_mlp"  # the built-in kept its name


def test_the_cli_races_a_plugin_in_three_modes(fresh_store):
    proc = cli(fresh_store, "run", "--workload-module", "my_workload", "--workload", "sine_mlp",
               "--modes", ",".join(MODES), "--steps", "20")
    assert proc.returncode == 0, proc.stderr
    for mode in MODES:
        assert f"\n{mode}" in proc.stdout
    store = open_store(fresh_store)
    (run_id,) = store.runs()["run_id"]
    run = store.run(run_id)
    assert run["workload"] == "sine_mlp" and run["status"] == "finished"
    assert store.steps(run_id).groupby("mode").size().to_dict() == dict.fromkeys(MODES, 20)


def test_the_cli_traces_and_probes_a_plugin_named_in_the_environment(fresh_store):
    env = {"AMP_LAB_WORKLOADS": "my_workload"}
    traced = cli(fresh_store, "trace", "--workload", "sine_mlp", "--mode", "bf16-mixed", env=env)
    assert traced.returncode == 0, traced.stderr
    probed = cli(fresh_store, "numerics", "--workload", "sine_mlp", "--mode", "16-mixed", env=env)
    assert probed.returncode == 0, probed.stderr


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_cli_refuses_a_broken_plugin_with_exit_2_naming_it(fresh_store, plugin_path, how):
    args = ("--workload-module", "plugin_raises") if how == "flag" else ()
    env = {"AMP_LAB_WORKLOADS": "my_workload,plugin_raises"} if how == "environment" else {}
    proc = cli(fresh_store, "run", *args, "--workload", "digits_mlp", "--steps", "5", extra_path=plugin_path, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: workload plugin 'plugin_raises' not loaded: importing it failed: "
                                   "RuntimeError: the plugin could not find its data")
    assert open_store(fresh_store).runs().empty
    listed = cli(fresh_store, "list", extra_path=plugin_path, env={"AMP_LAB_WORKLOADS": "plugin_raises"})
    assert listed.returncode == 0  # commands that use no workload are not held up by a broken plugin


def app_with_plugins(monkeypatch, modules: str) -> AppTest:
    monkeypatch.setenv("AMP_LAB_WORKLOADS", modules)
    st.cache_resource.clear()  # the app loads its plugins once per server: this test is a new server
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=180).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_the_app_serves_with_a_broken_plugin_and_races_the_good_one_on_the_train_page(plugin_path, monkeypatch):
    at = app_with_plugins(monkeypatch, "my_workload,plugin_missing_import")
    (error,) = at.sidebar.error
    assert ("`plugin_missing_import` was not loaded: importing it failed: ModuleNotFoundError: No module named "
            "'a_package_nobody_has_installed'") in error.value
    assert any("`sine_mlp` (my_workload)" in caption.value for caption in at.sidebar.caption)
    assert WORKLOADS["sine_mlp"].title in at.selectbox(key="train_workload").options
    at.selectbox(key="train_workload").set_value("sine_mlp")
    at.multiselect(key="train_modes").set_value(list(MODES))
    at.number_input(key="train_steps").set_value(12)
    at.button(key="train_launch").click().run()
    assert not at.exception and not at.main.error
    from pages.common import get_manager

    (run,) = get_manager().runs()
    run.join(120)
    at.run()
    assert not at.exception and run.status == "finished"
    figures = {chart.key: spec(chart.proto.spec) for chart in at.get("plotly_chart")}
    assert all(points_by_trace(figures["train_chart_loss"]).get(mode) == 12 for mode in MODES)


def test_a_stored_run_of_a_plugin_not_loaded_now_opens_on_every_page(plugin_path, fresh_store, monkeypatch):
    assert load_plugins(["my_workload"]) == []
    run = Run(RunConfig(workload="sine_mlp", modes=("32-true", "16-mixed"), steps=10, gradstats_every=5),
              open_store(fresh_store)).start()
    run.join(120)
    assert run.status == "finished"
    del WORKLOADS["sine_mlp"], workloads.PLUGIN_ORIGINS["sine_mlp"]  # a later server, without the plugin
    at = app_with_plugins(monkeypatch, "")
    for page in ("pages/train.py", "pages/compare.py", "pages/op_inspector.py", "pages/layer_numerics.py",
                 "pages/overflow_debugger.py"):
        at.switch_page(page).run()
        assert not at.exception, (page, [e.value for e in at.exception])
    at.switch_page("pages/train.py").run()
    assert at.selectbox(key="train_run_pick").value == run.run_id
    figures = {chart.key: spec(chart.proto.spec) for chart in at.get("plotly_chart")}
    assert points_by_trace(figures["train_chart_loss"]) == {"32-true": 10, "16-mixed": 10, **(
        {"16-mixed skipped": int(run.frame()["skipped"].sum())} if run.frame()["skipped"].any() else {})}


def test_ui_hands_its_plugins_to_the_dashboard(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_LAB_WORKLOADS", "plugin_a")
    port = streamlit_server.free_port()
    args = ["-m", "amp_core", "ui", "--port", str(port), "--workload-module", "my_workload",
            "--server.fileWatcherType", "none"]
    proc = streamlit_server.start_command(args, tmp_path / "runs.sqlite3")
    try:
        streamlit_server.wait_healthy(port, proc)
        assert psutil.Process(proc.pid).environ()["AMP_LAB_WORKLOADS"] == "plugin_a,my_workload"
    finally:
        streamlit_server.stop(proc)
