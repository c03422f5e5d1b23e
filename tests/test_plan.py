"""Precision plans (`+plan:FILE`, `amp-lab plan`) on tests.plan_workloads.PlantedFormats: blocks whose Linear reads
an outlier channel one NVFP4 block cannot hold. A plan lane races like any lane and builds the formats it names; the
search promotes exactly the planted layers (and proves each is needed); the printed code gives a plain loop's model
the same formats as the lane; bad plans, formats and targets are refused with one line."""

from __future__ import annotations

import math

import pytest
import torch

from amp_core import cli
from amp_core.config import ConfigError, RunConfig
from amp_core.diagnostics.plan_code import formats_of, plan_code
from amp_core.diagnostics.plan_search import PlanSearchConfig, search
from amp_core.formats.plan import PlanOption, gemm_format, write_plan
from amp_core.precision import get_precision
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.views.plan import plan_text
from amp_core.workloads import WORKLOADS, check_launch
from bench.plan import PLANTED_STEPS
from tests.plan_workloads import PlantedFormats, planted_linears

MIXED = {"blocks.0.linear": "fp16", "blocks.1.linear": "mxfp8", "blocks.2": "fp32", "blocks.3.linear": "fp8-rowwise",
         "blocks.4.linear": "bf16"}
"""A plan over every format kind: fp16 and bf16 autocast, a block format, torchao's float8, a module kept in fp32."""


@pytest.fixture()
def planted(monkeypatch):
    workload = PlantedFormats()
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    return workload


def built(workload: PlantedFormats, size: str = "medium") -> torch.nn.Module:
    return workload.build_model(size, workload.load_data(RunConfig(workload=workload.name)))


@pytest.mark.parametrize("lane, rest", [("bf16-mixed+nvfp4", "nvfp4"), ("bf16-mixed", "bf16"),
                                        ("bf16-mixed+mxfp8", "mxfp8")])
def test_a_plan_lane_races_and_builds_the_formats_it_names(planted, tmp_path, lane, rest):
    path = write_plan(tmp_path / "plan.toml", MIXED)
    recipe = f"{lane}+plan:{path}"
    model = get_precision(recipe).prepare_module(built(planted))
    formats = formats_of(model)
    assert formats["blocks.0.linear"] == "fp16" and formats["blocks.1.linear"] == "mxfp8"
    assert formats["blocks.2.linear"] == "fp32" and formats["blocks.3.linear"] == "fp8"
    assert formats["blocks.4.linear"] == "bf16"
    assert formats["blocks.5.linear"] == rest and formats["inp"] == rest  # unlisted: the lane's own recipe
    assert formats["head"] == "bf16"  # 32->8 is no whole NVFP4/MXFP8 block: the lane leaves it bf16

    manager = RunManager(open_store(str(tmp_path / "store.sqlite")))
    run = manager.launch(RunConfig(workload=planted.name, size="medium", modes=("bf16-mixed", recipe), steps=6,
                                   batch_size=32, snapshot_every=0))
    run.join(120)
    info = manager.run_info(run.run_id)
    assert [lane.status for lane in info.lanes] == ["finished", "finished"]
    started = manager.events(run.run_id)
    started = started[started["kind"] == "started"]["data"].iloc[-1]
    report = started["recipes"][recipe]  # the run's record of what the plan made of the model
    assert report["plan"]["blocks.1.linear"] == "mxfp8" and report["plan_fp32"] == ["blocks.2"]
    frame = manager.steps(run.run_id)
    assert frame[frame["mode"] == recipe]["loss"].map(math.isfinite).all()


@pytest.mark.slow
def test_the_search_promotes_exactly_the_two_planted_layers(planted, tmp_path):
    """Two planted among 7 Linear layers: the plan is exactly them (in MXFP8), each proven needed, within
    3·k·log2(n) + 6 trials, and the plan lane trains within seed noise of bf16-mixed in the final race."""
    config = PlanSearchConfig(workload=planted.name, size="medium", target="bf16-mixed+nvfp4", budget_s=600,
                              device="cpu", steps=PLANTED_STEPS, plan_path=str(tmp_path / "plan.toml"))
    report = search(config, open_store(str(tmp_path / "store.sqlite")))
    assert report.found, report.why
    assert report.plan == {name: "mxfp8" for name in planted_linears("medium")}
    assert len(report.minimal) == 2
    k, n = 2, len(report.candidates)
    assert len(report.trials) <= 3 * k * math.log2(n) + 6
    assert not report.trials[0].passed  # the target as it is fails
    text = plan_text(report)
    assert "within the spread" in text.split("final race")[1].splitlines()[3]  # the plan lane vs the baseline
    assert "*modelled*" in text and "kept in the target format (nvfp4)" in text
    assert report.plan_file and PlanOption(path=report.plan_file).entries == tuple(report.plan.items())


def test_the_printed_code_reproduces_the_plan_in_a_plain_loop(planted, tmp_path):
    formats = {"inp": "nvfp4", "blocks.0.linear": "fp16", "blocks.1.linear": "mxfp8", "blocks.2.linear": "fp32",
               "blocks.3.linear": "fp8-rowwise", "blocks.4.linear": "nvfp4", "blocks.5.linear": "bf16",
               "head": "bf16"}
    code = plan_code(formats, title="test plan")
    model = built(planted)
    exec(compile(code, "plan", "exec"), {"model": model})
    expected = {name: gemm_format(fmt) for name, fmt in formats.items()}
    assert formats_of(model) == expected
    lane = get_precision(f"bf16-mixed+plan:{write_plan(tmp_path / 'p.toml', formats)}").prepare_module(built(planted))
    assert formats_of(lane) == expected  # the lane and the user's job hold the same formats

    data = planted.load_data(RunConfig(workload=planted.name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(6):
        inputs, target = data.inputs[step * 32:(step + 1) * 32], data.targets[step * 32:(step + 1) * 32]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = planted.loss(model(inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert all(map(math.isfinite, losses))


def test_bad_plans_are_refused_with_one_line(planted, tmp_path):
    typo = write_plan(tmp_path / "typo.toml", {"blocks.1.lineer": "mxfp8"})
    with pytest.raises(ConfigError, match=r"'blocks.1.lineer' matches no module .*closest: blocks.1.linear"):
        check_launch(RunConfig(workload=planted.name, size="medium", modes=(f"bf16-mixed+plan:{typo}",)))
    bad = tmp_path / "bad.toml"
    bad.write_text('[modules]\n"inp" = "fp4"\n')
    with pytest.raises(ValueError, match=r"'inp' = 'fp4' is not a format; choose from fp32, bf16"):
        get_precision(f"bf16-mixed+plan:{bad}")
    with pytest.raises(ValueError, match=r"plan file .*missing\.toml: no such file"):
        get_precision(f"bf16-mixed+plan:{tmp_path / 'missing.toml'}")
    block = write_plan(tmp_path / "block.toml", {"inp": "nvfp4"})
    assert "not even emulated" in PlanOption(path=str(block)).refusal("bf16-mixed", "meta")
    with pytest.raises(ValueError, match=r"\+nvfp4 runs on top of bf16-mixed"):
        get_precision(f"16-mixed+plan:{block}")
    with pytest.raises(ValueError, match="use it on bf16-mixed or 16-mixed, not bf16-true"):
        get_precision(f"bf16-true+plan:{block}")


@pytest.mark.parametrize("target, says", [
    ("bf16-mixed+fp8-blockwise", "converts none of Stack's Linear layers"),
    ("32-true", "leaves nothing to promote"),
    ("bf16-mixed+nvfp4+keep:head", "without \\+plan: or \\+keep:"),
])
def test_a_target_the_workload_cannot_use_is_one_line_and_exit_2(planted, tmp_path, capsys, target, says):
    code = cli.main(["--store", str(tmp_path / "s.sqlite"), "plan", "--workload", planted.name, "--size", "medium",
                     "--target", target, "--device", "cpu", "--out", str(tmp_path / "p.toml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error:")
    assert __import__("re").search(says, err[0]), err


def test_the_advisor_offers_a_plan_where_a_matmul_format_trains_worse():
    from amp_core.diagnostics.advise import CandidateEvidence, Evidence, decide

    def raced(recipe: str, loss: float) -> CandidateEvidence:
        return CandidateEvidence(recipe=recipe, runnable=True, note="", raced=True, seeds=3, steps=40,
                                 loss_mean=loss, loss_sd=0.01, loss_n=3, ms_mean=10.0, ms_sd=0.1, ms_n=3,
                                 steps_after_warmup=100)

    evidence = Evidence(workload="llama", size="small", device="cpu", device_name="cpu", race_run="r", probe_runs=(),
                        candidates=(raced("32-true", 1.0), raced("bf16-mixed+nvfp4", 1.3), raced("bf16-true", 1.3)),
                        race_steps=40, warmup_steps=4)
    advice = decide(evidence)
    assert advice.verdict("bf16-mixed+nvfp4").verdict == "rejected"
    assert "amp-lab plan --workload llama --size small --target bf16-mixed+nvfp4" in advice.verdict(
        "bf16-mixed+nvfp4").keep
    assert advice.verdict("bf16-true").keep == ""  # no matmul format: nothing for a plan to promote


def test_the_layer_numerics_page_finds_a_plan_off_its_thread_and_stops(planted):
    """The *Find a plan* button: a target the workload cannot use is one line; a search shows its progress while the
    page stays usable, and Stop ends it with a line saying so."""
    import time
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from tests.answered_pages import answered

    page = str(Path(__file__).resolve().parents[1] / "pages" / "layer_numerics.py")
    app = AppTest.from_file(page, default_timeout=180).run()
    app.selectbox(key="lnum_workload").set_value(planted.name).run()
    answered(app.selectbox(key="lnum_size").set_value("medium").run())  # the panel sits below the probe's report
    app.selectbox(key="lnum_plan_target").set_value("bf16-mixed+fp8-blockwise").run()
    app.button(key="lnum_plan_go").click().run()
    assert any("Cannot search: **target**" in e.value and "converts none" in e.value for e in app.error)

    app.selectbox(key="lnum_plan_target").set_value("bf16-mixed+nvfp4").run()
    app.button(key="lnum_plan_go").click().run()
    assert not app.exception
    job = app.session_state["plan_jobs"]["lnum"]
    assert not job.done and app.get("progress")  # the search runs on its own thread; the page drew its progress
    app.button(key="lnum_plan_stop").click().run()
    deadline = time.monotonic() + 120
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job.done and job.error.startswith("stopped")
    app.run()
    assert any("No plan: stopped" in e.value for e in app.error)


def test_the_train_page_adds_a_plan_lane_or_says_why_not(tmp_path):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    plan = write_plan(tmp_path / "plan.toml", {"blocks.0.mlp.0": "mxfp8", "head": "fp32"})
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "pages" / "train.py"), default_timeout=120).run()
    at.session_state["train_recipes_open"] = True  # the folded recipes section holds the builder
    at.run()
    at.selectbox(key="train_recipe_mode").set_value("bf16-mixed")
    at.multiselect(key="train_recipe_options").set_value(["nvfp4"])
    at.text_input(key="train_recipe_plan").set_value(str(tmp_path / "missing.toml"))
    at.button(key="train_recipe_add").click().run()
    assert any("missing.toml: no such file" in e.value for e in at.error)
    at.text_input(key="train_recipe_plan").set_value(str(plan)).run()
    at.button(key="train_recipe_add").click().run()
    assert f"bf16-mixed+nvfp4+plan:{plan}" in at.multiselect(key="train_modes").options
    assert not at.exception


def test_the_op_inspector_shows_each_modules_format_as_it_ran_on_a_plan_lane(planted, tmp_path, stepped_launches,
                                                                             no_leaked_threads):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from pages.common import get_manager

    plan = write_plan(tmp_path / "plan.toml", {name: MIXED[name] for name in ("blocks.0.linear", "blocks.1.linear",
                                                                                "blocks.2")})
    recipe = f"bf16-mixed+nvfp4+plan:{plan}"
    run = get_manager().launch(RunConfig(workload=planted.name, size="medium", modes=("bf16-mixed", recipe),
                                         steps=100_000, batch_size=32, device="cpu", gradstats_every=0))
    try:
        run.wait_until(lambda r: all(lane.steps_done >= 1 for lane in r.lanes))
        page = str(Path(__file__).resolve().parents[1] / "pages" / "op_inspector.py")
        app = AppTest.from_file(page, default_timeout=120).run()
        app.radio(key="opi_source").set_value("A live lane").run()
        label = next(label for label in app.selectbox(key="opi_lane").options if "+plan:" in label)
        app.selectbox(key="opi_lane").set_value(label).run()
        app.button(key="opi_trace_lane").click().run()
        assert not app.exception and not app.error
        [table] = [df.value for df in app.dataframe if list(df.value.columns) == ["module", "format", "forward",
                                                                                  "backward", "FLOPs"]]
        formats = dict(zip(table["module"], table["format"], strict=True))
        assert formats["blocks.0.linear"] == "fp16" and formats["blocks.1.linear"] == "mxfp8"
        assert formats["blocks.2"] == "fp32 (kept)" and formats["blocks.2.linear"] == "fp32"
        assert formats["blocks.3.linear"] == "nvfp4" and formats["inp"] == "nvfp4"  # unlisted: the lane's own
        assert formats["head"] == "bf16"  # 32->8 is no whole NVFP4 block: left at the lane's autocast dtype
        rows = table.set_index("module")
        assert rows.loc["blocks.0.linear", "forward"] == "fp16" and rows.loc["blocks.2.linear", "forward"] == "fp32"
        per_module = [df.value for df in app.dataframe if "low_precision_share" in df.value.columns]
        assert per_module and "format" in per_module[0].columns
    finally:
        run.stop()


def test_a_plan_lane_compiles_with_compilable_formats_and_one_naming_an_emulated_format_is_refused(planted, tmp_path):
    """+compile beside a plan: bf16 / fp32 / FP8-tensorwise layers compile in one graph (an fp32 Linear is a with-block
    torch.compile traces, and so is a kept module that is not a Linear); an emulated block format is refused at launch
    in one line."""
    from amp_core.precision.compiler import cpp_compiler
    from amp_core.race.compiled import COMPILED_EVENT

    emulated = write_plan(tmp_path / "emulated.toml", {"fc1": "nvfp4"})
    with pytest.raises(ConfigError, match=r"\+compile with \+plan:.*'fc1' = 'nvfp4' is emulated here \(cpu\)"):
        check_launch(RunConfig(workload="digits_mlp", modes=(f"bf16-mixed+compile+plan:{emulated}",), device="cpu"))
    kept = write_plan(tmp_path / "kept.toml", {"blocks.2": "fp32"})  # not a Linear: keep_in_fp32 keeps it
    for recipe in (f"bf16-mixed+compile+plan:{kept}", f"bf16-mixed+plan:{kept}"):
        check_launch(RunConfig(workload=planted.name, modes=(recipe,), device="cpu"))
    if not cpp_compiler():
        pytest.skip("inductor needs a C++ compiler on a CPU")

    plan = write_plan(tmp_path / "compiles.toml", {"fc1": "fp8-tensorwise", "fc2": "fp32"})
    recipe = f"bf16-mixed+compile+plan:{plan}"
    manager = RunManager(open_store(str(tmp_path / "store.sqlite")))
    run = manager.launch(RunConfig(workload="digits_mlp", modes=(recipe,), steps=4, batch_size=16, device="cpu",
                                   snapshot_every=0, gradstats_every=0))
    run.join(300)
    assert [lane.status for lane in manager.run_info(run.run_id).lanes] == ["finished"]
    events = manager.events(run.run_id)
    [compiled] = events[events["kind"] == COMPILED_EVENT]["data"]
    assert compiled["graphs"] == 1 and compiled["graph_breaks"] == 0
    started = events[events["kind"] == "started"]["data"].iloc[-1]["recipes"][recipe]
    assert started["plan"] == {"fc1": "fp8-tensorwise", "fc2": "fp32"}
    assert manager.steps(run.run_id)["loss"].map(math.isfinite).all()
