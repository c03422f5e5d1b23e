"""Layer-numerics figures (plain plotly dicts), the amax heatmap of a real run whose activation grows into fp16's
limit, and the `numerics` CLI (in process and as a real subprocess)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from amp_core.cli import main
from amp_core.config import RunConfig
from amp_core.probes import numerics
from amp_core.race.runner import Run
from amp_core.records.opening import open_store
from amp_core.views import numerics as views
from amp_core.workloads import WORKLOADS, Data, Workload
from tests.test_numerics import OVERFLOW

ROOT = Path(__file__).resolve().parents[1]


# --- a workload whose activation doubles every training step ---------------------------------------------------------

class Gain(nn.Module):
    """Multiplies by a gain that doubles on every training forward: an activation growing toward fp16's limit."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.gain.mul_(2.0)
        return x * self.gain


class Growing(Workload):
    name = "growing"
    title = "growing activation"
    sizes = {"small": {}}

    def load_data(self, config) -> Data:
        generator = torch.Generator().manual_seed(2)
        return Data(torch.randn(512, 8, generator=generator), torch.randint(4, (512,), generator=generator), "")

    def build_model(self, size: str, data: Data) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), Gain(), nn.Linear(16, 4))

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)


@pytest.fixture(scope="module")
def grown():
    """A real run: 32-true and 16-mixed lanes, amax sampled every step, the activation doubling each step."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(WORKLOADS, "growing", Growing())
        run = Run(RunConfig(workload="growing", modes=("32-true", "16-mixed"), steps=24, batch_size=32,
                            device="cpu", gradstats_every=0, amax_every=1, intra_op_threads=1)).start()
        run.join(120)
    events = pd.DataFrame([{"kind": e.kind, "lane": e.lane, "step": e.step, "data": e.data} for e in run.events()])
    return run, views.amax_samples(events)


def test_the_heatmap_shows_an_activation_growing_toward_fp16s_limit_before_it_overflows(grown):
    run, samples = grown
    assert run.lanes[1].status == "diverged"  # the fp16 lane's loss went non-finite when the activation overflowed
    gain = samples[(samples["lane"] == 1) & (samples["module"] == "1")].sort_values("step")
    finite = gain[~gain["output_nonfinite"]]
    broken = gain[gain["output_nonfinite"]]
    assert len(finite) >= 10 and not broken.empty
    assert finite["step"].max() < broken["step"].min()  # it grew first, then overflowed
    assert (finite["output_amax"].diff().dropna() > 0).all()  # step after step
    assert 2.0**13 < finite["output_amax"].iloc[-1] <= numerics.FP16_MAX  # within 3 binades of the limit, then over

    figure = views.amax_heatmap(samples, 1, "16-mixed").to_plotly_json()
    [heatmap] = figure["data"]
    row = list(heatmap["y"]).index("1")
    steps = list(heatmap["x"])
    z = [heatmap["z"][row][steps.index(s)] for s in gain["step"]]
    finite_z = z[:len(finite)]
    assert finite_z == sorted(finite_z) and finite_z[-1] < views.FP16_MAX_LOG2
    assert z[len(finite)] == heatmap["zmax"] > views.FP16_MAX_LOG2  # the overflow cell is at the red top
    assert heatmap["text"][row][steps.index(int(broken["step"].min()))] == "inf/NaN"
    story = views.amax_story(samples, 1)
    assert story.startswith(f"first inf/NaN: 1 at step {int(broken['step'].min())}; it was ")


def test_the_fp32_lane_goes_past_65504_and_the_heatmap_marks_it_red(grown):
    _, samples = grown
    gain = samples[(samples["lane"] == 0) & (samples["module"] == "1")]
    assert gain["output_amax"].max() > numerics.FP16_MAX and not gain["output_nonfinite"].any()
    figure = views.amax_heatmap(samples, 0, "32-true").to_plotly_json()
    [heatmap] = figure["data"]
    assert max(heatmap["z"][list(heatmap["y"]).index("1")]) == heatmap["zmax"]
    assert "above 65504" in views.amax_story(samples, 0)


def test_samples_survive_the_store_as_json(fresh_store):
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(WORKLOADS, "growing", Growing())
        run = Run(RunConfig(workload="growing", modes=("16-mixed",), steps=20, batch_size=32, device="cpu",
                            gradstats_every=0, amax_every=2, stop_on_divergence=False), open_store()).start()
        run.join(120)
    stored = views.amax_samples(open_store(fresh_store).events(run.run_id))
    memory = views.amax_samples(pd.DataFrame([{"kind": e.kind, "lane": e.lane, "step": e.step, "data": e.data}
                                              for e in run.events()]))
    pd.testing.assert_frame_equal(stored, memory)
    assert stored["output_nonfinite"].any() and set(stored["step"]) == set(range(0, 20, 2))


def test_grad_heatmap_and_refusals(grown):
    _, samples = grown
    figure = views.amax_heatmap(samples, 1, "16-mixed", which="grad").to_plotly_json()
    assert "gradient" in figure["layout"]["title"]["text"]
    with pytest.raises(ValueError, match="which must be"):
        views.amax_heatmap(samples, 1, "16-mixed", which="weights")
    empty = views.amax_heatmap(samples, 7, "16-mixed").to_plotly_json()
    assert empty["data"] == [] and "no layer amax samples" in empty["layout"]["annotations"][0]["text"]
    assert views.amax_samples(pd.DataFrame()).empty


# --- probe figures ---------------------------------------------------------------------------------------------------

def test_error_figure_ranks_modules_and_marks_the_first_non_finite_one():
    report = numerics.probe_workload(OVERFLOW, "16-mixed")
    figure = views.error_figure(report).to_plotly_json()
    [bar] = figure["data"]
    modules = list(bar["y"])
    assert set(modules) == {"fc1", "planted", "act", "fc2", "(root)", "(loss)"}
    planted = modules.index("planted")
    assert bar["text"][planted] in ("inf", "NaN")
    assert bar["marker"]["color"][planted] == views.NONFINITE_COLOUR
    assert bar["marker"]["line"]["color"][planted] == "#000000"  # outlined: the first non-finite module
    assert bar["marker"]["line"]["color"][modules.index("fc1")] != "#000000"
    assert figure["layout"]["xaxis"]["type"] == "log"


def test_error_figure_says_so_when_every_error_is_zero():
    report = numerics.probe_workload("digits_mlp", "32-true", batch_size=8)
    figure = views.error_figure(report).to_plotly_json()
    assert figure["data"] == [] and "exactly" in figure["layout"]["annotations"][0]["text"]


def test_range_figure_spans_each_modules_values_against_fp16_limits():
    report = numerics.probe_workload("digits_mlp", "bf16-mixed", batch_size=8)
    figure = views.range_figure(report, "output").to_plotly_json()
    bar = figure["data"][0]
    frame = report.module_frame().iloc[::-1]
    assert list(bar["y"]) == list(frame["module"])
    for base, width, low, high in zip(bar["base"], bar["x"], frame["out_min_nonzero"], frame["out_abs_max"],
                                      strict=True):
        assert base == pytest.approx(math.log2(low)) and base + width == pytest.approx(max(math.log2(high),
                                                                                           base + 0.15))
    assert [s["x0"] for s in figure["layout"]["shapes"]] == [-24, -14, pytest.approx(math.log2(65504))]
    with pytest.raises(ValueError, match="tensor must be one of"):
        views.range_figure(report, "weights")


def test_range_figure_marks_modules_holding_inf():
    report = numerics.probe_workload(OVERFLOW, "16-mixed")
    figure = views.range_figure(report, "output").to_plotly_json()
    marks = figure["data"][1]
    assert "planted" in marks["y"] and "fc1" not in marks["y"]


# --- CLI --------------------------------------------------------------------------------------------------------------

def test_cli_prints_the_table_and_the_line_and_writes_the_csv(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(WORKLOADS, OVERFLOW.name, OVERFLOW)  # a workload registered at run time
    path = tmp_path / "numerics.csv"
    assert main(["numerics", "--workload", OVERFLOW.name, "--mode", "16-mixed", "--csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert "first non-finite: planted (forward)\n" in out and "why: " in out
    table = pd.read_csv(path)
    assert list(table["module"]) == ["fc1", "planted", "act", "fc2", "(root)", "(loss)"]
    assert list(table.columns) == numerics.MODULE_COLUMNS
    assert table.loc[table["module"] == "planted", "out_inf"].item() > 0


def test_cli_as_a_real_subprocess(tmp_path):
    path = tmp_path / "out.csv"
    done = subprocess.run([sys.executable, "-m", "amp_core", "numerics", "--workload", "digits_mlp", "--mode",
                           "bf16-mixed", "--csv", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "first non-finite: none" in lines
    assert any(line.split()[:2] == ["fc1", "bf16"] for line in lines)
    assert len(pd.read_csv(path)) == 4


@pytest.mark.parametrize(("argv", "field"), [
    (["--workload", "nope"], "workload"), (["--mode", "fp8"], "mode"), (["--mode", "tf32"], "mode"),
    (["--size", "huge"], "size"), (["--batch-size", "0"], "batch_size"), (["--device", "tpu"], "device"),
])
def test_cli_refuses_bad_input_in_one_line_naming_the_field(argv, field, capsys):
    assert main(["numerics", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}: ") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_refuses_an_unwritable_csv_path(tmp_path, capsys):
    assert main(["numerics", "--csv", str(tmp_path / "missing" / "out.csv")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write")
