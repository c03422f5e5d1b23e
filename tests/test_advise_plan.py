"""`amp-lab advise` considers a per-layer plan: on tests.plan_workloads.PlantedFormats (one block's Linear reads an
outlier channel an NVFP4 block cannot hold) a real seeded race finds bf16-mixed+nvfp4 training worse than 32-true;
the advisor's plan step searches a plan against 32-true, races it beside 32-true, and the decision weighs the plan
lane like any candidate, by its own rules, from the store alone."""

from __future__ import annotations

import dataclasses
import re

import pytest

from amp_core.config import RunConfig
from amp_core.diagnostics.advise import BudgetClock, decide, gather, record_advice
from amp_core.diagnostics.advise_plan import plan_fixes, plan_targets
from amp_core.diagnostics.seednoise import difference_verdict
from amp_core.formats.plan import read_plan
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.runs import RunReader
from amp_core.views.advise import advice_text
from amp_core.workloads import WORKLOADS
from bench.plan import PLANTED_BATCH, PLANTED_STEPS
from tests.plan_workloads import PlantedFormats, planted_linears

TARGET = "bf16-mixed+nvfp4"


@pytest.fixture(scope="module")
def advised(tmp_path_factory):
    """The advisor's race of 32-true and the NVFP4 target (3 seeds), then its plan step, recorded as the advice does."""
    workload = PlantedFormats()
    WORKLOADS[workload.name] = workload
    folder = tmp_path_factory.mktemp("advise_plan")
    store = open_store(str(folder / "runs.sqlite3"))
    manager = RunManager(store)
    modes = ("32-true", TARGET)
    run = manager.launch(RunConfig(workload=workload.name, size="small", modes=modes, seeds=3, steps=PLANTED_STEPS,
                                   batch_size=PLANTED_BATCH, device="cpu", snapshot_every=0, name="advise plan"))
    run.join(300)
    assert run.status == "finished"
    say = lambda message, fraction: None  # noqa: E731
    raced = gather(manager, run.run_id)  # the race alone, as the advisor reads it before its plan step
    targets = plan_targets(raced, decide(raced))
    assert targets == [TARGET]
    short: list[str] = []
    settings = {"seeds": 3, "race_steps": PLANTED_STEPS, "reserve_s": 0, "plan_dir": str(folder)}
    too_short = plan_fixes(manager, run, targets, BudgetClock(1), short, say, **settings)
    notes: list[str] = []
    plans = plan_fixes(manager, run, targets, BudgetClock(600), notes, say, **settings)
    found = [(recipe, True, "") for recipe in modes]
    record_advice(manager, run.run_id, found=found, probe_runs=[], warmup=8, budget_s=600.0, spent_s=60.0, notes=[],
                  device="cpu", plans=plans)
    yield store, run.run_id, plans, notes, too_short, short
    WORKLOADS.pop(workload.name, None)


def test_a_budget_with_no_room_for_a_search_skips_it_saying_why(advised):
    *_, too_short, short = advised
    assert [p["recipe"] for p in too_short] == [TARGET] and not too_short[0]["plan"]
    assert re.fullmatch(rf"no plan searched: the budget left [01] s, a plan search of {re.escape(TARGET)} here needs "
                        r"about \d+ s \(a larger --budget-min runs it\)", too_short[0]["why"]), too_short[0]["why"]
    assert short and "was not looked for" in short[0]


def test_the_advisor_offers_a_plan_where_the_plain_target_fails_and_weighs_it_by_its_own_rules(advised):
    store, run_id, plans, notes, *_ = advised
    assert not notes, notes
    record = plans[0]
    assert record["plan"] == {name: "mxfp8" for name in planted_linears("small")}  # the planted layer, one rung up
    plan_recipe = record["fixed_recipe"]
    assert plan_recipe.startswith(f"{TARGET}+plan:") and dict(read_plan(record["plan_file"])) == record["plan"]
    assert store.run(record["race_run"])["config"]["modes"] == ["32-true", plan_recipe]

    evidence = gather(RunReader(store), run_id)  # the store alone
    advice = decide(evidence)
    target = advice.verdict(TARGET)
    assert target.verdict == "rejected" and target.reason == "trains worse than fp32 beyond seed noise"
    assert target.keep.startswith(f"a plan: 1 of 7 layers promoted to mxfp8 ({planted_linears('small')[0]}), "
                                  f"found in {record['trials']} trials; raced as {plan_recipe}")
    planned = evidence.candidate(plan_recipe)
    assert planned.fixes == TARGET and planned.raced and planned.seeds == 3 and planned.diverged == 0
    assert planned.yardstick is not None and planned.yardstick.seeds == 3
    # The plan lane is decided like any candidate, against the 32-true raced beside it, by the same rule.
    b = planned.yardstick
    loss = difference_verdict(b.loss_mean, b.loss_sd, b.loss_n, planned.loss_mean, planned.loss_sd, planned.loss_n)
    assert not (loss[0] == "different" and planned.loss_mean > b.loss_mean), loss  # it trains like fp32
    verdict = advice.verdict(plan_recipe)
    speed = difference_verdict(b.ms_mean, b.ms_sd, b.ms_n, planned.ms_mean, planned.ms_sd, planned.ms_n)
    slower = speed[0] == "different" and planned.ms_mean > b.ms_mean  # emulated on a CPU: slower than 32-true
    assert (verdict.verdict == "rejected") == slower, verdict
    # The same records with the plan lane's step times cut to a third of its 32-true's (a GPU with NVFP4's kernels):
    # recommended, as the fastest candidate that trains like fp32.
    quick = dataclasses.replace(planned, ms_mean=b.ms_mean / 3, ms_sd=b.ms_sd / 3)
    here = decide(dataclasses.replace(evidence, candidates=tuple(quick if c.recipe == plan_recipe else c
                                                                 for c in evidence.candidates)))
    assert here.recommended == plan_recipe
    assert here.line().startswith(f"recommend: {plan_recipe} — the fastest candidate that trains like fp32 within "
                                  f"seed noise ({TARGET} with 1 of 7 layers promoted to mxfp8, found by the plan "
                                  "search): x0.33 of 32-true's ms/step over 3 seeds")
    assert f"{plan_recipe}: fixes {TARGET} (1 of 7 layers promoted to mxfp8); raced beside 32-true in run " \
        f"{record['race_run']}" in advice_text(advice)


def test_the_advise_page_offers_find_a_plan_and_refuses_a_target_in_one_line(monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    workload = PlantedFormats()
    monkeypatch.setitem(WORKLOADS, workload.name, workload)
    page = str(Path(__file__).resolve().parents[1] / "pages" / "advise.py")
    app = AppTest.from_file(page, default_timeout=120).run()
    app.selectbox(key="advise_workload").set_value(workload.name).run()
    app.selectbox(key="advise_size").set_value("medium").run()
    app.selectbox(key="advise_plan_target").set_value("bf16-mixed+fp8-blockwise").run()
    app.button(key="advise_plan_go").click().run()
    assert not app.exception
    errors = [e.value for e in app.error]
    assert len(errors) == 1 and errors[0].startswith("Cannot search: **target**") and "converts none" in errors[0]
    assert "advise_job" not in app.session_state  # the plan panel started no advice
