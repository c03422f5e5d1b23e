"""`amp-lab advise`: the decision on recorded evidence from real runs (faults planted so the outcome is certain on any
device), end to end on the device as it is with a short budget, and the CLI's output and bad input."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest

from amp_core.config import ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.diagnostics.advise import (
    ADVISED_EVENT,
    USED_ENOUGH,
    AdviseConfig,
    BudgetClock,
    advise,
    check,
    decide,
    gather,
    plan_budget,
    record_advice,
    replay_failures,
)
from amp_core.diagnostics.seednoise import difference_verdict
from amp_core.precision import availability, resolve_device
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.views.advise import advice_report_html, advice_table, advice_text, unmeasured_lines
from tests.cli_process import ROOT

STEPS = 60


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A real race (digits_mlp, 3 seeds per mode) with faults planted in two candidates' lanes only:
    bf16-mixed's LR x 1e-4 from step 5 (it stops learning: a final loss far above fp32's on every device), 16-mixed's
    batch x 1e6 at step 30 (fp16 overflows in its first layer: the loss goes inf and the lane stops). bf16-true is
    left clean.
    The advisor's stability step then replays each failed candidate's first failed step (recorded as events)."""
    store = open_store(tmp_path_factory.mktemp("advise") / "runs.sqlite3")
    manager = RunManager(store)
    modes = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
    faults = (FaultSpec(kind="lr_scale", factor=1e-4, step=5, duration=STEPS - 5, modes=("bf16-mixed",)),
              FaultSpec(kind="batch_outlier", factor=1e6, step=30, modes=("16-mixed",)))
    run = manager.launch(RunConfig(workload="digits_mlp", modes=modes, seeds=3, steps=STEPS, device="cpu",
                                   faults=faults, name="advise evidence"))
    run.join(300)
    assert run.status == "finished"
    notes: list[str] = []
    replay_failures(manager, run, 12, BudgetClock(600), notes, lambda message, fraction: None)
    assert not notes
    device = resolve_device("cpu")
    found = [(recipe, *availability(recipe, device)) for recipe in (*modes, "tf32")]
    record_advice(manager, run.run_id, found=found, probe_runs=[], warmup=12, budget_s=60.0, spent_s=30.0, notes=[],
                  device=device)
    return store, manager, run.run_id


def test_a_faster_candidate_is_rejected_for_its_instability_or_loss_and_a_slower_one_can_be_recommended(planted):
    _, manager, run_id = planted
    evidence = gather(manager, run_id)
    assert {c.recipe for c in evidence.candidates} == {"32-true", "bf16-mixed", "16-mixed", "bf16-true", "tf32"}
    advice = decide(evidence)

    overflowed = advice.verdict("16-mixed")
    assert overflowed.verdict == "rejected" and overflowed.reason.startswith("unstable: its loss went non-finite")
    assert evidence.candidate("16-mixed").diverged == 3
    # The first inf/NaN module, from the recorded replay of its first failed step (Layer numerics' probe).
    first = evidence.candidate("16-mixed").first_nonfinite
    assert first.startswith("fc1 (forward) at step 30 (its fp16 output holds")
    assert f"first inf/NaN: {first}" in overflowed.figure
    frozen = advice.verdict("bf16-mixed")
    assert frozen.verdict == "rejected" and frozen.reason == "trains worse than fp32 beyond seed noise"
    assert frozen.loss_delta > 0 and "seed noise allows" in frozen.figure
    assert advice.verdict("tf32").verdict == ("not measured" if availability("tf32", "cpu")[0] else "refused")

    # The decision holds the clean candidate against the same rule the Compare page states, on the same records.
    base, clean = evidence.candidate("32-true"), evidence.candidate("bf16-true")
    loss = difference_verdict(base.loss_mean, base.loss_sd, base.loss_n, clean.loss_mean, clean.loss_sd, clean.loss_n)
    speed = difference_verdict(base.ms_mean, base.ms_sd, base.ms_n, clean.ms_mean, clean.ms_sd, clean.ms_n)
    trains_like_fp32 = not (loss[0] == "different" and clean.loss_mean > base.loss_mean)
    faster = speed[0] == "different" and clean.ms_mean < base.ms_mean
    expected = "bf16-true" if trains_like_fp32 and faster else "32-true"
    assert advice.recommended == expected and advice.decided and advice.exit_code == 0
    # Whichever the device, the rejected candidates are rejected whatever their speed: where one of them stepped
    # faster than the recommendation, the advice took the slower one.
    recommended = evidence.candidate(advice.recommended)
    for rejected in ("16-mixed", "bf16-mixed"):
        assert advice.recommended != rejected
        if evidence.candidate(rejected).ms_mean < recommended.ms_mean:
            assert advice.verdict(rejected).time_ratio < advice.verdict(advice.recommended).time_ratio

    # decide is a function of the evidence alone: the same records with bf16-true's step times cut to a third (as on
    # a device with native bf16) recommend it whenever it trains like fp32, 32-true the runner-up.
    quick = dataclasses.replace(clean, ms_mean=base.ms_mean / 3, ms_sd=base.ms_sd / 3)
    faster_here = decide(dataclasses.replace(evidence, candidates=tuple(
        quick if c.recipe == "bf16-true" else c for c in evidence.candidates)))
    if trains_like_fp32:
        assert (faster_here.recommended, faster_here.runner_up) == ("bf16-true", "32-true")
        assert faster_here.line().startswith("recommend: bf16-true — the fastest candidate that trains like fp32")
        assert faster_here.verdict("bf16-true").verdict == "recommended"

    text = advice_text(advice)
    assert text.splitlines()[-1] == advice.line() and advice.line().startswith(f"recommend: {expected} — ")
    table = advice_table(advice)  # the decision first; a candidate with no figure is counted, not given a row
    assert table["recipe"].iloc[0] == expected and set(table["recipe"]) == {
        c.recipe for c in evidence.candidates} - {"tf32"}
    assert text.splitlines()[1] == advice.line() and unmeasured_lines(advice)[0].startswith(
        "not measured: 1 runnable candidates (1 not probed within the budget)" if availability("tf32", "cpu")[0]
        else "refused here: 1 candidates (1: ")
    assert not any("awaits" in line for line in advice.cannot_tell)  # the bisect is wired in: see the tests below
    page = advice_report_html(manager, advice)
    assert f"<b>recommend: {expected} — " in page and run_id in page and "<h2>Every candidate</h2>" in page


def test_the_advice_reads_back_from_the_store_alone(planted):
    store, manager, run_id = planted
    from amp_core.runs import RunReader

    again = decide(gather(RunReader(store), run_id))
    first = decide(gather(manager, run_id))
    assert again.line() == first.line()
    assert [(v.recipe, v.verdict) for v in again.verdicts] == [(v.recipe, v.verdict) for v in first.verdicts]
    events = store.events(run_id)
    assert (events["kind"] == ADVISED_EVENT).sum() == 1


def test_bad_input_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="workload: unknown workload 'nope'"):
        check(AdviseConfig(workload="nope"))
    with pytest.raises(ConfigError, match=r"budget: .* too small to decide anything: in 6 s it could list the \d+ "
                                          r"candidates"):
        check(AdviseConfig(workload="digits_mlp", budget_s=6))
    with pytest.raises(ConfigError, match="budget: must be a number of minutes > 0"):
        AdviseConfig(workload="digits_mlp", budget_s=-60)
    with pytest.raises(ConfigError, match="candidates: '32-true\\+nope' is not a candidate"):
        check(AdviseConfig(workload="digits_mlp", candidates=("32-true+nope",)))


def test_end_to_end_on_this_device_a_short_budget_recommends_a_runnable_candidate_that_trains_like_fp32(tmp_path):
    store = open_store(tmp_path / "runs.sqlite3")
    said = []
    advice = advise(AdviseConfig(workload="digits_mlp", budget_s=25, candidates=("bf16-mixed", "16-mixed")), store,
                    progress=lambda message, fraction: said.append((message, fraction)))
    device = resolve_device("auto")
    assert availability(advice.recommended, device)[0]
    assert advice.exit_code in (0, 3) and said and said[-1] == (advice.line(), 1.0)
    verdict = advice.verdict(advice.recommended)
    assert verdict.verdict in ("recommended", "baseline")
    if advice.recommended != "32-true":  # trains like fp32 within seed noise, and faster beyond it
        base, chosen = advice.evidence.candidate("32-true"), advice.evidence.candidate(advice.recommended)
        assert difference_verdict(base.ms_mean, base.ms_sd, base.ms_n, chosen.ms_mean, chosen.ms_sd,
                                  chosen.ms_n)[0] == "different"
        assert not (chosen.loss_mean > base.loss_mean and difference_verdict(
            base.loss_mean, base.loss_sd, base.loss_n, chosen.loss_mean, chosen.loss_sd, chosen.loss_n)[0]
            == "different")
    runs = store.runs()
    evidence = advice.evidence
    assert evidence.plan.startswith("planned: ") and _used_enough_or_says_why(evidence)
    assert {evidence.race_run, *evidence.probe_runs} <= set(runs["run_id"])
    race = store.run(evidence.race_run)
    assert race["config"]["seeds"] >= 2 and race["config"]["modes"][0] == "32-true"
    assert (store.events(evidence.race_run)["kind"] == ADVISED_EVENT).any()
    assert all(not math.isnan(c.ms_mean) for c in evidence.candidates if c.raced)


def _used_enough_or_says_why(evidence) -> bool:
    """The advice used USED_ENOUGH of its budget, or it says that the answer was decided sooner (and what was done)."""
    used = re.match(r"used (\d+) s of its (\d+) s budget \((\d+)%\): (.*)", evidence.stopped)
    assert used, evidence.stopped
    share = int(used[1]) / int(used[2])
    assert abs(share - evidence.spent_s / evidence.budget_s) < 0.02
    return share >= USED_ENOUGH or used[4].startswith("decided sooner — ")


def test_the_plan_probes_every_candidate_when_the_budget_allows_and_says_what_it_leaves_out():
    roomy = plan_budget(1800, modes=6, options=32)  # a half-hour budget probes every option (15 s each, planned)
    assert roomy.options_planned == 32 and roomy.options_probe_s == 32 * 15.0
    assert roomy.modes_probe_s + roomy.options_probe_s + roomy.reserve_s < 1800 and roomy.race_share > 0.5
    tight = plan_budget(300, modes=6, options=32)
    assert 0 < tight.options_planned < 32 and tight.options_probe_s <= 0.35 * 300
    assert tight.words().startswith("planned: 45 s probing the modes, 105 s for 7 recipe options, ")
    none = plan_budget(120, modes=3, options=6)  # under one chunk's 60 s: no option, the time goes to the race
    assert none.options_probe_s == 0 and none.options_planned == 0 and "no recipe option" in none.words()
    assert plan_budget(60, modes=1, options=0).modes_probe_s == 0  # 32-true alone: nothing to probe against


@pytest.mark.slow
def test_the_cli_with_a_two_minute_budget_uses_it_or_says_why_and_leads_with_the_decision(tmp_path):
    """`advise --budget-min 2`: inherently two minutes (the budget is the test); a small workload and three modes."""
    store = tmp_path / "runs.sqlite3"
    command = [sys.executable, "-m", "amp_core", "--store", str(store), "advise", "--workload", "digits_mlp",
               "--device", "cpu", "--budget-min", "2", "--candidates", "bf16-mixed,16-mixed,bf16-true"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode in (0, 3), done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[1] == lines[-1] and lines[1].startswith("recommend: ")
    assert any(line.startswith("budget: used ") for line in lines[2:5]), lines[:6]
    assert "not measured" not in done.stdout or "not measured: " in done.stdout  # counted in one line, no rows
    from amp_core.runs import RunReader

    race = next(run_id for run_id in open_store(store).runs()["run_id"] if not run_id.startswith("probe-")
                and (open_store(store).events(run_id)["kind"] == ADVISED_EVENT).any())
    assert _used_enough_or_says_why(gather(RunReader(open_store(store)), race))


def test_the_cli_on_a_device_that_runs_only_32_true_says_so_and_recommends_it(tmp_path):
    """A CPU told by AMP_LAB_CPU_NATIVE that it has a format it does not know refuses the 16-bit modes (with the
    reason): left with 32-true alone, the advice says so and exits 0."""
    env = dict(os.environ, AMP_LAB_CPU_NATIVE="fp4")
    command = [sys.executable, "-m", "amp_core", "--store", str(tmp_path / "runs.sqlite3"), "advise", "--workload",
               "digits_mlp", "--device", "cpu", "--budget-min", "0.5", "--candidates", "bf16-mixed,16-mixed"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "recommend: 32-true — this device (CPU: " + lines[-1].split("(CPU: ", 1)[1]
    assert "can run only 32-true among the candidates" in lines[-1]
    assert "AMP_LAB_CPU_NATIVE" in done.stdout  # the refused modes' reason, in the table
    bad = subprocess.run([*command[:7], "nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: workload: unknown workload 'nope'")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_the_page_says_what_a_too_small_budget_could_do_and_starts_nothing():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "pages" / "advise.py"), default_timeout=120).run()
    assert not at.exception and at.info  # nothing asked yet: it says what to do
    at.selectbox(key="advise_workload").set_value("digits_mlp")
    at.number_input(key="advise_budget").set_value(0.1)
    at.button(key="advise_go").click().run()
    assert not at.exception
    assert [e.value for e in at.error] == [
        f"**budget** — {check_error(AdviseConfig(workload='digits_mlp', budget_s=6))}. Nothing was started."]
    assert "advise_job" not in at.session_state


def check_error(config: AdviseConfig) -> str:
    with pytest.raises(ConfigError) as refused:
        check(config)
    return refused.value.why


# --- step (4)'s layers to keep: the bisect of a candidate that fails in a few layers, its price, the fix raced ------
@pytest.fixture(scope="module")
def fixable(tmp_path_factory):
    """A real race of the workshop's planted workload (one block's gain overflows fp16, three large-but-safe ones
    beside it): 16-mixed diverges at step 0 in every seed. The advisor's stability step replays it, bisects it and
    races the fixed recipe beside 32-true, all recorded in the store."""
    from amp_core.diagnostics.advise_fix import keep_fixes
    from amp_core.workshop.planted import register

    register()
    store = open_store(tmp_path_factory.mktemp("advise_keep") / "runs.sqlite3")
    manager = RunManager(store)
    modes = ("32-true", "16-mixed")
    run = manager.launch(RunConfig(workload="workshop_planted_digits", modes=modes, seeds=2, steps=30, device="cpu",
                                   snapshot_every=10, scaler=ScalerConfig(init_scale=256.0), name="advise keep"))
    run.join(300)
    assert run.status == "finished"
    notes: list[str] = []
    say = lambda message, fraction: None  # noqa: E731
    broken = replay_failures(manager, run, 8, BudgetClock(600), notes, say)
    assert broken == {"16-mixed": (1, 0)}
    short = keep_fixes(manager, run, broken, BudgetClock(1), [], say, seeds=2, race_steps=30, reserve_s=0)
    fixes = keep_fixes(manager, run, broken, BudgetClock(600), notes, say, seeds=2, race_steps=30, reserve_s=0)
    assert not notes, notes
    found = [(recipe, True, "") for recipe in modes]
    record_advice(manager, run.run_id, found=found, probe_runs=[], warmup=8, budget_s=600.0, spent_s=30.0, notes=[],
                  device="cpu", fixes=fixes)
    return store, manager, run.run_id, short, fixes


def test_a_budget_too_short_for_the_bisect_skips_it_saying_why(fixable):
    *_, short, _ = fixable
    assert [fix["recipe"] for fix in short] == ["16-mixed"] and not short[0]["kept"]
    assert re.fullmatch(r"not bisected: the budget left [01] s, a bisect of 16-mixed here needs about \d+ s \(a larger "
                        r"--budget-min runs it\)", short[0]["why"]), short[0]["why"]


def test_a_candidate_failing_in_one_layer_gets_the_layers_to_keep_their_price_and_the_fix_raced(fixable):
    from amp_core.diagnostics.bisect import recorded_bisects
    from amp_core.runs import RunReader
    from amp_core.views.advise import keep_lines
    from amp_core.workshop.planted import PLANTED_MODULE

    store, _, run_id, _, fixes = fixable
    fixed_recipe = f"16-mixed+keep:{PLANTED_MODULE}"
    assert fixes[0]["kept"] == [PLANTED_MODULE] and fixes[0]["fixed_recipe"] == fixed_recipe
    assert recorded_bisects(store.events(run_id), 1)[0].kept == [PLANTED_MODULE]  # the bisect is in the store
    evidence = gather(RunReader(store), run_id)  # the store alone
    advice = decide(evidence)
    failing = advice.verdict("16-mixed")
    assert failing.verdict == "rejected" and failing.reason.startswith("unstable")
    assert failing.keep.startswith(f"keep 1 module in fp32: {PLANTED_MODULE} — price ")
    assert re.search(r"price [+-]\d+% ms/step against 16-mixed, [+-]\d+\.\d\d MiB held \(against (16-mixed|32-true)"
                     r"; measured\)", failing.keep), failing.keep
    fix = evidence.candidate(fixed_recipe)
    assert fix.fixes == "16-mixed" and fix.raced and fix.seeds == 2 and fix.diverged == 0
    assert fix.yardstick is not None and fix.yardstick.seeds == 2 and fix.yardstick.diverged == 0
    assert store.run(fixes[0]["race_run"])["config"]["modes"] == ["32-true", fixed_recipe]
    # The fixed recipe is decided like any candidate, against the 32-true raced beside it, by the same rule.
    b = fix.yardstick
    loss = difference_verdict(b.loss_mean, b.loss_sd, b.loss_n, fix.loss_mean, fix.loss_sd, fix.loss_n)
    speed = difference_verdict(b.ms_mean, b.ms_sd, b.ms_n, fix.ms_mean, fix.ms_sd, fix.ms_n)
    worse, slower = loss[0] == "different" and fix.loss_mean > b.loss_mean, speed[0] == "different" and \
        fix.ms_mean > b.ms_mean
    verdict = advice.verdict(fixed_recipe)
    assert (verdict.verdict == "rejected") == (worse or slower), verdict
    assert (advice.recommended == fixed_recipe) == (not worse and speed[0] == "different" and not slower)
    # The same records with the fix's step times cut to a third of its 32-true's: recommended when it trains like fp32.
    quick = dataclasses.replace(fix, ms_mean=b.ms_mean / 3, ms_sd=b.ms_sd / 3)
    here = decide(dataclasses.replace(evidence, candidates=tuple(quick if c.recipe == fixed_recipe else c
                                                                 for c in evidence.candidates)))
    if not worse:
        assert here.recommended == fixed_recipe and here.verdict(fixed_recipe).verdict == "recommended"
        assert here.line().startswith(f"recommend: {fixed_recipe} — the fastest candidate that trains like fp32 "
                                      f"within seed noise (16-mixed with {PLANTED_MODULE} kept in fp32, found by the "
                                      "layer bisect): x0.33 of 32-true's ms/step over 2 seeds")
    text = advice_text(advice)
    assert f"keep · 16-mixed: keep 1 module in fp32: {PLANTED_MODULE}" in text
    assert advice_table(advice).set_index("recipe").loc["16-mixed", "layers to keep"] == \
        f"keep 1 module in fp32: {PLANTED_MODULE}"
    assert f"{fixed_recipe}: fixes 16-mixed (1 of 18 modules kept in fp32); raced beside 32-true in run " \
        f"{fixes[0]['race_run']}" in keep_lines(advice)
    assert not any("bisect" in line and "await" in line for line in advice.cannot_tell)
