"""Compiled lanes (`+compile`) with real inductor on the CPU: eager and compiled lanes race from the same weights and
batches, compile time stays out of step time, dynamo's graph breaks are named, a failing compile fails its lane
alone, drift is recorded per step, and the compiled op view shows fewer standalone casts than eager. Each module
fixture compiles once (seconds cold; inductor's cache makes a rerun quicker)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from compile_workloads import FusedChain, PlantedBreak

from amp_core.config import ConfigError, RunConfig
from amp_core.precision import availability, cpp_compiler
from amp_core.race.compiled import (
    COMPILED_EVENT,
    COMPILED_OPS_EVENT,
    FIRST_COMPILE,
    GRAPH_BREAK_EVENT,
    MAX_CAPTURES_PER_LANE,
    RECOMPILE,
    RECOMPILE_EVENT,
    RECOMPILE_STORM_EVENT,
    eager_recipe,
    is_compiled_recipe,
    lane_compiles,
    one_line,
)
from amp_core.race.runner import Run
from amp_core.views import compiled as compiled_views
from amp_core.workloads import WORKLOADS, check_launch

STEPS = 24
"""Enough for the workshop's speed check (MIN_STEPS 20); a CPU step of this model is about a millisecond."""


def finished(config: RunConfig, store=None) -> Run:
    run = Run(config, store).start()
    run.join(600)
    assert not run.alive
    return run


@pytest.fixture(scope="module")
def race_store(tmp_path_factory):
    """The race's own SQLite store (what a finished run is read back from)."""
    from amp_core.records.opening import open_store

    return open_store(tmp_path_factory.mktemp("race") / "runs.sqlite3")


@pytest.fixture(scope="module")
def race(race_store):
    """Eager and compiled lanes of a model whose compiled bf16 loss differs from eager's (a fused pointwise chain),
    with snapshots every 5 steps (what replay starts from), recorded in `race_store`."""
    workload = FusedChain()
    WORKLOADS[workload.name] = workload
    try:
        yield finished(RunConfig(workload=workload.name, modes=("32-true", "bf16-mixed", "bf16-mixed+compile"),
                                 steps=STEPS, batch_size=16, snapshot_every=5, gradstats_every=0), race_store)
    finally:
        WORKLOADS.pop(workload.name)


@pytest.fixture(scope="module")
def planted():
    workload = PlantedBreak()
    WORKLOADS[workload.name] = workload
    try:
        yield finished(RunConfig(workload=workload.name, modes=("32-true", "32-true+compile", "bf16-mixed",
                                                                  "bf16-mixed+compile"), steps=STEPS, batch_size=8,
                                 gradstats_every=0))
    finally:
        WORKLOADS.pop(workload.name)


def test_a_compiled_lane_replays_compiled_and_eagerly_and_says_what_compiling_changed(race):
    from amp_core.diagnostics.replay import replay_run
    from amp_core.views.replay import replay_text

    manager = _Reader(race)  # the RunManager of this process, holding the run and its snapshots
    report = replay_run(manager, race.run_id, "bf16-mixed+compile", 8)
    rows = {row.mode: row for row in report.rows}
    compiled, eager = rows["bf16-mixed+compile"], rows["bf16-mixed+compile (eager)"]
    assert compiled.compiled and not eager.compiled and not rows["bf16-mixed"].compiled
    # re-trained compiled from the snapshot of step 5, the compiled replay gives the run's (compiled) loss bit for bit
    assert report.start_step == 5 and report.reproduced, report.reproduction_line()
    # eagerly the same recipe is the eager mode's step; compiled, inductor's fused chain rounds once: another loss
    assert eager.loss == rows["bf16-mixed"].loss != compiled.loss
    said = " ".join(report.notes)
    assert "compiled (inductor, the recipe's compile options) and eager replays of bf16-mixed+compile" in said
    assert "apart (relative)" in said
    assert "judged on the eager rows instead, the verdict would be unclear" in said and report.verdict.kind == "unclear"
    assert "bf16-mixed+compile (eager)" in replay_text(report)
    # from the eager lane, the compiled recipe is replayed compiled too (a copy, compiled with the lane's options)
    other = replay_run(manager, race.run_id, "bf16-mixed", 8)
    rows = {row.mode: row for row in other.rows}
    assert other.reproduced and rows["bf16-mixed+compile"].compiled
    assert rows["bf16-mixed+compile (eager)"].loss == rows["bf16-mixed"].loss != rows["bf16-mixed+compile"].loss


def test_a_compiled_lanes_own_compile_is_captured_and_stored(race, race_store):
    from amp_core.runs import RunReader

    [capture] = race.compile_captures[2]  # one compile, captured as the lane compiled before step 0
    assert capture.trigger == FIRST_COMPILE and capture.recipe == "bf16-mixed+compile" and not capture.reused
    kernels = capture.summary.kernels
    generated = kernels[kernels["kernel"].str.startswith("cpp_fused_")]
    assert set(generated["phase"]) == {"forward", "backward"}
    # inductor fused the pointwise chain with its casts into one kernel; the matmuls are extern kernels
    assert generated["built from"].str.contains("sigmoid").any() and (generated["casts"] == "fused").any()
    assert kernels["kernel"].str.startswith("extern_kernels.").any()
    assert any("cpp_fused_" in code for code in capture.code)
    counts = capture.summary.op_counts
    assert {"bf16", "fp32"} <= set(counts["dtype"]) and set(counts["phase"]) == {"forward", "backward"}
    # fewer standalone casts than eager runs for the same step (the lane's eager copy, traced as it compiled)
    assert capture.summary.fusing_kernels >= 1 and capture.summary.kept_cast_kernels < capture.eager_casts
    assert not race.compile_captures.get(1)  # the eager lane compiles nothing
    events = [e for e in race.events() if e.kind == COMPILED_OPS_EVENT]
    assert [e.lane for e in events] == [2] and "generated kernel(s)" in events[0].message
    # the finished run, read from its store (no memory of it): the same summary, without inductor's code
    [stored] = lane_compiles(RunReader(race_store), race.run_id, 2)
    assert stored.summary.kernels.equals(kernels) and stored.summary.op_counts.equals(counts)
    assert stored.eager_casts == capture.eager_casts and stored.code == ()


def test_the_op_inspector_shows_a_stored_compiled_lanes_own_compile(race, race_store, monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from tests.answered_pages import answered

    monkeypatch.setenv("AMP_LAB_STORE", str(race_store.path))
    app = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "pages" / "op_inspector.py"),
                            default_timeout=120).run()
    answered(app.radio(key="opi_source").set_value("A compiled lane's own compile").run())  # the eager trace below
    assert app.selectbox(key="opi_compiled_run").value == race.run_id
    assert app.selectbox(key="opi_compiled_lane").value == 2 and not app.exception and not app.error
    metrics = {m.label: m.value for m in app.metric}
    capture = race.compile_captures[2][0]
    assert metrics["Casts eager runs as their own ops"] == str(capture.eager_casts)
    assert metrics["Kernels that only cast (kept)"] == str(capture.summary.kept_cast_kernels)
    kernels = next(df.value for df in app.dataframe if "built from" in df.value.columns)
    assert kernels["kernel"].str.startswith("cpp_fused_").any()
    assert any("Inside a fused kernel" in info.value for info in app.info)
    assert any("bf16-mixed" in m.value and "fresh build" in m.value for m in app.caption)
    assert any("inputs" in df.value.columns for df in app.dataframe)  # the eager trace of the same mode, below


def test_recipe_names_and_refusals(monkeypatch):
    assert is_compiled_recipe("bf16-mixed+compile") and not is_compiled_recipe("bf16-mixed")
    assert eager_recipe("bf16-mixed+compile-max-autotune") == "bf16-mixed"
    ok, why = availability("bf16-mixed+compile-reduce-overhead", "cpu")
    assert not ok and "CUDA graphs" in why
    assert cpp_compiler()  # this machine has one: the real lookup answers
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-compiler-amp-lab",))
    ok, why = availability("bf16-mixed+compile", "cpu")
    assert not ok and "needs a C++ compiler" in why
    with pytest.raises(ConfigError, match=r"modes: .*C\+\+ compiler"):
        check_launch(RunConfig(workload="digits_mlp", modes=("bf16-mixed+compile",)))


def test_eager_and_compiled_lanes_race_with_compile_time_kept_out(race):
    assert [lane.status for lane in race.lanes] == ["finished"] * 3
    frame = race.frame()
    assert frame.groupby("lane").size().tolist() == [STEPS] * 3
    compiled = [e for e in race.events() if e.kind == COMPILED_EVENT]
    assert [e.lane for e in compiled] == [2] and compiled[0].data["graphs"] >= 1
    kinds = [e.kind for e in race.events() if e.lane == 2]
    assert kinds.index("compiling") < kinds.index(COMPILED_EVENT)
    # the first compile happened before step 0, outside the timed steps: every step is far shorter than it
    assert frame[frame.lane == 2]["step_ms"].max() < compiled[0].data["compile_ms"]
    # the same weights and batches: the first losses agree closely (bf16 rounding may differ)
    first = frame[frame.step == 0].set_index("lane")["loss"]
    assert abs(first[2] - first[1]) / abs(first[1]) < 1e-2


def test_drift_recorded_per_step_and_summarised(race):
    compiles, drift, summary = compiled_views.compiled_view(race.run_id and _Reader(race), [race.run_id])
    assert compiles["recipe"].tolist() == ["bf16-mixed+compile"] and compiles["compile s"].iloc[0] > 0
    assert drift["step"].tolist() == list(range(STEPS)) and drift["vs_fp32"].notna().all()
    assert summary["verdict"].iloc[0].startswith("one seed")
    # Compare shows them inside the page's width: the run's short id, no column that says nothing, short headers.
    shown, shown_drift, verdicts = compiled_views.compare_tables(compiles, summary)
    run = race.run_id.rsplit("-", 1)[-1][-6:]
    assert shown["run"].tolist() == [run] and "run_id" not in shown and "run_id" not in shown_drift
    assert not {"error", "slow-compile warnings", "recompile s", "recompile reasons"} & set(shown.columns)
    assert shown_drift.columns.tolist() == ["run", "lane", "recipe", "seed", "steps", "median |drift|", "max |drift|",
                                            "vs 32-true, compiled", "vs 32-true, eager", "seed noise"]
    assert verdicts == [f"**bf16-mixed+compile · {run}** (seed 0) against its eager twin: "
                        "one seed: no noise to judge by"]
    assert shown_drift["median |drift|"].iloc[0] == summary["median |drift vs eager|"].iloc[0]
    assert shown_drift["seed noise"].tolist() == ["–"]  # one seed: no noise (a table draws NaN as a grey None)


class _Reader:
    """The RunReader view of one finished in-memory run, as the pages read it."""

    def __init__(self, run: Run):
        from amp_core.race.runner import RunManager

        self.manager = RunManager()
        self.manager._runs[run.run_id] = run

    def __getattr__(self, name):
        return getattr(self.manager, name)


def test_planted_graph_break_is_named_and_a_failed_compile_fails_alone(planted):
    status = {lane.mode: lane.status for lane in planted.lanes}
    assert status == {"32-true": "finished", "32-true+compile": "finished", "bf16-mixed": "finished",
                      "bf16-mixed+compile": "failed"}
    failed = planted.lanes[3]
    assert failed.error.startswith("CompileFailed: compile failed:") and "\n" not in failed.error
    breaks = [e for e in planted.events() if e.kind == GRAPH_BREAK_EVENT and e.lane == 1]
    assert breaks and "graph_break()" in breaks[0].data["what"]
    compiled = next(e for e in planted.events() if e.kind == COMPILED_EVENT and e.lane == 1)
    assert compiled.data["graph_breaks"] >= 1 and compiled.data["graphs"] >= 2
    assert planted.frame().groupby("lane").size().to_dict() == {0: STEPS, 1: STEPS, 2: STEPS}


def test_recompile_named_with_its_guard_and_the_storm_is_an_event(planted):
    recompiles = [e for e in planted.events() if e.kind == RECOMPILE_EVENT and e.lane == 1]
    # dynamo's guard failures, as it words them (a compiled lane of another mode of the same model adds its own)
    assert any("self.calls ==" in e.data["reason"] for e in recompiles)
    assert all(e.data["compile_ms"] > 0 and "\n" not in e.message for e in recompiles)
    storms = [e for e in planted.events() if e.kind == RECOMPILE_STORM_EVENT and e.lane == 1]
    assert len(storms) == 1 and storms[0].data["recompile_limit"] == torch._dynamo.config.recompile_limit
    assert len(recompiles) <= torch._dynamo.config.recompile_limit
    table = compiled_views.compile_summary(_Reader(planted).events(planted.run_id),
                                           _Reader(planted).run_info(planted.run_id).lanes)
    row = table.set_index("recipe").loc["32-true+compile"]
    assert row["recompiles"] >= 1 and row["storm"] == "yes" and "graph_break()" in row["break reasons"]
    table.insert(0, "run_id", planted.run_id)
    shown, _, _ = compiled_views.compare_tables(table, pd.DataFrame())  # recompiles and a failed lane: said on Compare
    assert {"recompile s", "recompile reasons", "error"} <= set(shown.columns)
    # each recompile's own graphs and kernels were captured with dynamo's reason (the first compile kept, bounded)
    captures = planted.compile_captures[1]
    assert captures[0].trigger == FIRST_COMPILE and len(captures) <= MAX_CAPTURES_PER_LANE
    recaptured = [c for c in captures if c.trigger == RECOMPILE]
    assert recaptured and any("self.calls ==" in c.reason for c in recaptured)
    assert all(len(c.summary.kernels) for c in recaptured)


def test_the_train_pages_compile_table_says_dash_until_a_lanes_compile_has_ended(planted):
    events, lanes = _Reader(planted).events(planted.run_id), _Reader(planted).run_info(planted.run_id).lanes
    done = compiled_views.train_table(compiled_views.compile_summary(events, lanes)).set_index("recipe")
    assert float(done.loc["32-true+compile", "compile s"]) > 0 and int(done.loc["32-true+compile", "graphs"]) >= 1
    # the same run's events as a page read them before the compiled event was written: no number yet, a dash
    under_way = compiled_views.compile_summary(events[events["kind"] != COMPILED_EVENT], lanes)
    shown = compiled_views.train_table(under_way).set_index("recipe").loc["32-true+compile"]
    assert under_way.set_index("recipe")["compile s"].isna().all()
    assert shown["compile s"] == shown["graphs"] == shown["graph breaks"] == "–"


def test_one_line_keeps_the_first_line():
    assert one_line(RuntimeError("first\n\nsecond")) == "RuntimeError: first"


def test_compiled_op_view_shows_fewer_standalone_casts_than_eager():
    from amp_core.probes.compiled_ops import trace_workload_compiled

    trace, eager_casts = trace_workload_compiled("digits_mlp", "bf16-mixed+compile", batch_size=8)
    assert trace.graph_casts > 0 and set(trace.ops["phase"]) == {"forward", "backward"}
    assert trace.fusing_kernels >= 1  # inductor fused casts into computing kernels
    assert trace.kept_cast_kernels < eager_casts
    assert "bf16" in set(trace.ops["dtype"])


def _evidence(run: Run, edit=None):
    """The workshop's evidence of `run` as recorded, its step records edited by `edit(steps, lanes)` when given."""
    from amp_core.workshop.evidence import gather

    evidence = gather(_Reader(run), [run.run_id])
    if edit is not None:
        part = evidence.parts[0]
        edit(part.steps, {lane.mode: lane.lane for lane in part.info.lanes})
    return evidence


def test_workshop_compile_scenario_checks_both_ways_from_recorded_evidence(race):
    from amp_core.workshop import SCENARIOS, Verdict, evaluate

    scenario = SCENARIOS["compile"]
    assert scenario.configs("cpu")[0].modes == tuple(lane.mode for lane in race.lanes)
    results = {r.title: r for r in evaluate(scenario, _evidence(race))}
    assert results["Compile time kept apart"].verdict is Verdict.HELD
    assert results["Drift against eager"].verdict is Verdict.HELD
    assert results["Compiled vs eager speed"].verdict in (Verdict.HELD, Verdict.CANNOT_TELL)  # this CPU's answer

    def slow_step(steps, lanes):  # one compiled step that took longer than the whole compile
        steps.loc[(steps["lane"] == lanes["bf16-mixed+compile"]) & (steps["step"] == 5), "step_ms"] = 1e9

    def drifted(steps, lanes):
        steps.loc[steps["lane"] == lanes["bf16-mixed+compile"], "loss"] *= 1.2

    def twice_as_fast(steps, lanes):
        eager = steps[steps["lane"] == lanes["bf16-mixed"]].set_index("step")["step_ms"]
        mine = steps["lane"] == lanes["bf16-mixed+compile"]
        steps.loc[mine, "step_ms"] = steps.loc[mine, "step"].map(eager).to_numpy() / 2

    def same_speed(steps, lanes):
        eager = steps[steps["lane"] == lanes["bf16-mixed"]].set_index("step")["step_ms"]
        mine = steps["lane"] == lanes["bf16-mixed+compile"]
        steps.loc[mine, "step_ms"] = steps.loc[mine, "step"].map(eager).to_numpy()

    def verdict(edit, title):
        return next(r for r in evaluate(scenario, _evidence(race, edit)) if r.title == title).verdict

    assert verdict(slow_step, "Compile time kept apart") is Verdict.FAILED
    assert verdict(drifted, "Drift against eager") is Verdict.FAILED
    assert verdict(twice_as_fast, "Compiled vs eager speed") is Verdict.HELD
    assert verdict(same_speed, "Compiled vs eager speed") is Verdict.CANNOT_TELL


def test_a_copy_of_a_compiled_lane_model_is_eager_with_the_same_weights():
    """What layer numerics, the op trace and replay run on: torch drops the compiled call when it copies a module."""
    import copy

    from amp_core.race.compiled import compile_lane_model

    model = torch.nn.Linear(4, 2)
    compile_lane_model(model, "default", lambda: None)  # lazy: nothing compiles until the model is called
    assert model._compiled_call_impl is not None
    twin = copy.deepcopy(model)
    assert twin._compiled_call_impl is None and torch.equal(twin.weight, model.weight)


def test_a_kept_module_compiles_with_its_lane_in_one_graph():
    # `+keep:` with `+compile`: the keep is a with-block dynamo traces (its hooks, switching autocast off in one and on
    # in another, failed the compile); the kept lane compiles in one graph and trains as its eager twin does.
    recipe = "bf16-mixed+keep:fc2"
    run = finished(RunConfig(workload="digits_mlp", modes=(recipe, f"{recipe}+compile"), steps=6, batch_size=16,
                             snapshot_every=0, gradstats_every=0))
    assert [lane.status for lane in run.lanes] == ["finished"] * 2, [e.message for e in run.events()]
    [compiled] = [e for e in run.events() if e.kind == COMPILED_EVENT]
    assert compiled.lane == 1 and compiled.data["graphs"] == 1 and compiled.data["graph_breaks"] == 0
    first = run.frame().query("step == 0").set_index("lane")["loss"]
    assert abs(first[1] - first[0]) / abs(first[0]) < 1e-2
