"""`amp-lab maxbatch` on a CPU: a modelled largest batch per recipe, from bytes measured on real steps, said so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from amp_core.config import ConfigError
from amp_core.diagnostics.maxbatch import max_batches
from tests.cli_process import ROOT


def test_a_cpu_models_each_recipes_largest_batch_from_measured_bytes():
    budget_mib = 64
    found = max_batches("tiny_transformer", ("32-true", "bf16-mixed"), device="cpu", budget_mib=budget_mib)
    assert [entry.recipe for entry in found] == ["32-true", "bf16-mixed"]
    for entry in found:
        assert entry.modelled and entry.samples_per_s is None and entry.budget_bytes == budget_mib * 2**20
        assert entry.fixed_bytes > 0 and entry.per_sample_bytes > 0
        assert entry.batch == int((entry.budget_bytes - entry.fixed_bytes) // entry.per_sample_bytes)
        assert "modelled" in entry.line()
    fp32, bf16 = found
    # bf16 autocast saves bf16 copies for backward: fewer bytes per sample, a larger batch.
    assert bf16.per_sample_bytes < fp32.per_sample_bytes and bf16.batch > fp32.batch


def test_a_bad_budget_or_recipe_is_refused():
    with pytest.raises(ConfigError, match="budget_mib"):
        max_batches("digits_mlp", ("32-true",), device="cpu", budget_mib=0)
    with pytest.raises(ConfigError, match="unknown recipe option"):
        max_batches("digits_mlp", ("32-true+nope",), device="cpu")


def test_the_cli_prints_a_modelled_batch_per_mode_and_exits_2_on_bad_input():
    command = [sys.executable, "-m", "amp_core", "maxbatch", "--workload", "digits_mlp", "--device", "cpu"]
    done = subprocess.run([*command, "--modes", "32-true,bf16-mixed", "--budget-mib", "256"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("32-true: max batch ") and "modelled: fixed" in lines[0]
    assert lines[1].startswith("bf16-mixed: max batch ") and lines[2].startswith("modelled: no batch was tried")
    bad = subprocess.run([*command, "--modes", "32-true", "--budget-mib", "-1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: budget_mib: must be > 0, got -1.0"


def maxbatch_tables(at) -> list:
    return [frame.value for frame in at.dataframe if "max batch" in frame.value.columns]


@pytest.mark.extra("recipes")
def test_the_train_page_finds_each_lanes_largest_batch_off_its_thread():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "pages" / "train.py"), default_timeout=120).run()
    at.selectbox(key="train_workload").set_value("tiny_transformer")
    at.session_state["train_recipes_open"] = True  # the folded recipes section, where the search lives
    at.run()
    at.selectbox(key="train_recipe_mode").set_value("bf16-mixed")
    at.multiselect(key="train_recipe_options").set_value(["fp8-rowwise"])
    at.button(key="train_recipe_add").click().run()
    at.multiselect(key="train_modes").set_value(["32-true", "bf16-mixed", "bf16-mixed+fp8-rowwise"])
    at.number_input(key="train_maxbatch_budget").set_value(64.0)
    at.button(key="train_maxbatch_go").click().run()
    assert not at.exception and not at.error
    job = at.session_state["train_maxbatch"]
    assert job.wait(300), "the search did not finish"
    at.run()
    assert not at.exception and not at.error
    [table] = maxbatch_tables(at)
    assert list(table["recipe"]) == ["32-true", "bf16-mixed", "bf16-mixed+fp8-rowwise"]
    assert set(table["found by"]) == {"modelled"} and set(table["budget MiB"]) == {64.0}
    assert "samples / s" not in table.columns  # a CPU measures bytes, not a throughput at a batch never tried
    assert (table["bytes / sample"] > 0).all()
    # The batch is the one the CLI's code finds: the same measured bytes against the same budget.
    assert list(table["max batch"]) == [entry.batch for entry in max_batches(
        "tiny_transformer", tuple(table["recipe"]), device="cpu", budget_mib=64)]
    assert any("**Modelled**" in caption.value for caption in at.caption)
    # Bad input is a message: no lane to search.
    at.multiselect(key="train_modes").set_value([])
    at.button(key="train_maxbatch_go").click().run()
    assert not at.exception
    assert any("Nothing was searched" in error.value for error in at.error)
    assert not maxbatch_tables(at)
