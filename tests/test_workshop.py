"""Workshop scenarios on real runs: every scenario through `amp_core workshop run` in real processes on the device as
it is (no check fails here; one that the run's noise cannot decide says "cannot tell here"), its checks re-read from
the stored records, checks that turn ✗ when a run does not show their point, the CPU override, bad input."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from child_env import device_env

from amp_core.cli import main
from amp_core.config import RunConfig, ScalerConfig
from amp_core.extras import EXTRAS, missing_extras
from amp_core.precision import CPU_NATIVE_ENV, cpu_math, parse_recipe
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.workshop import (
    EXIT_CANNOT_TELL,
    EXIT_FAILED,
    EXIT_HELD,
    SCENARIOS,
    Check,
    CheckResult,
    Evidence,
    ScenarioLaunch,
    Verdict,
    Waiting,
    evaluate,
    exit_code,
    gather,
    headline,
)
from amp_core.workshop.checks import no_skips

ROOT = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
"""The first test sets up every scenario in real processes (minutes on a slow or busy machine): pyproject's 300 s
hang guard is too tight for that set-up."""


def workshop_cli(*args: str, store: Path | None = None, native: str | None = None,
                 timed: bool = False) -> subprocess.CompletedProcess:
    """`python -m amp_core workshop ARGS` in a process of its own, on the device as it is (`native`: the
    AMP_LAB_CPU_NATIVE override to run it under; `timed`: its checks judge step times, so OpenMP's idle threads wait
    as the device has them wait, not asleep as in the rest of the suite: tests/child_env.py)."""
    command = [sys.executable, "-m", "amp_core", "workshop", *args]
    if store is not None:
        command += ["--store", str(store)]
    env = {name: value for name, value in os.environ.items() if name != CPU_NATIVE_ENV}
    if native is not None:
        env[CPU_NATIVE_ENV] = native
    if timed:
        env = device_env(env)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False,
                          env=env)


CHECK_LINE = re.compile(r"^([✓✗?]) (.+?): ", flags=re.MULTILINE)


def printed_verdicts(output: str) -> dict[str, Verdict]:
    """Each check's verdict as `workshop run` printed it (its mark, first on the check's line)."""
    return {title: Verdict(mark) for mark, title in CHECK_LINE.findall(output)}


TIMED_SCENARIOS = ("speed", "compile")
"""The scenarios whose checks judge step times: they run with OpenMP's wait policy as the device has it (the others,
whose checks read losses, skips, scales, memory and op traces, run with idle threads asleep, as the whole suite does:
tests/child_env.py)."""

SCENARIO_PARAMS = [pytest.param(name, marks=[pytest.mark.extra(*scenario.extras)] if scenario.extras else [])
                   for name, scenario in SCENARIOS.items()]
"""Every scenario, one that needs an extra marked (it skips, saying so, where the extra is not installed)."""


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every scenario run once by the CLI, each into a store of its own. The speed scenario runs alone (its step
    times are its point); the others two at a time (this machine has two cores)."""
    folder = tmp_path_factory.mktemp("workshop")

    def one(name: str) -> tuple[str, tuple[subprocess.CompletedProcess, Path]]:
        store = folder / f"{name}.sqlite3"
        return name, (workshop_cli("run", name, store=store, timed=name in TIMED_SCENARIOS), store)

    results = dict([one("speed")])
    with ThreadPoolExecutor(max_workers=2) as pool:
        results.update(pool.map(one, [name for name, scenario in SCENARIOS.items()
                                      if name != "speed" and not missing_extras(scenario.extras)]))
    return results


def run_ids(output: str) -> list[str]:
    return re.findall(r"^run (\S+): ", output, flags=re.MULTILINE)


@pytest.mark.parametrize("name", SCENARIO_PARAMS)
def test_every_scenario_runs_with_no_check_failed_on_this_device(cli_runs, name):
    """Every check holds, or (the speed checks, on a machine too busy to tell two speeds apart) says it cannot be told
    here and why; the exit code follows: 0 when every check held, 3 when one cannot be told."""
    done, _ = cli_runs[name]
    scenario = SCENARIOS[name]
    assert "Traceback" not in done.stderr
    verdicts = printed_verdicts(done.stdout)
    assert list(verdicts) == [check.title for check in scenario.checks], done.stdout
    assert Verdict.FAILED not in verdicts.values(), done.stdout
    untold = list(verdicts.values()).count(Verdict.CANNOT_TELL)
    assert done.returncode == (EXIT_CANNOT_TELL if untold else EXIT_HELD), done.stdout + done.stderr
    assert done.stdout.count("    cannot tell here: ") == untold
    checks = len(scenario.checks)
    assert f"{checks - untold} of {checks} checks held" + (f", {untold} cannot be told here" if untold else "") in (
        done.stdout.splitlines())
    assert len(run_ids(done.stdout)) == len(scenario.configs("cpu"))
    if scenario.expects is not None:  # the one line saying what this device implies
        assert scenario.expected_here("cpu") in done.stdout.splitlines()


@pytest.mark.extra("recipes")
def test_the_fp8_scenario_holds_every_check_on_this_device(cli_runs):
    """No speed is checked in FP8's scenario (emulated on a CPU), so none of its checks may be left untold here."""
    done, _ = cli_runs["fp8"]
    assert done.returncode == EXIT_HELD, done.stdout[-2000:]
    assert "✓ FP8 matmuls ran" in done.stdout and "3 of 3 checks held" in done.stdout.splitlines()


@pytest.mark.parametrize("name", SCENARIO_PARAMS)
def test_the_checks_read_the_same_from_the_stored_records(cli_runs, name):
    """A scenario run by another process, read back from its store (steps, events, gradient statistics): the checks
    read the same there, final, with the verdicts and figures the CLI printed."""
    done, store = cli_runs[name]
    manager = RunManager(open_store(store))
    evidence = gather(manager, run_ids(done.stdout))
    assert evidence.ended and len(evidence.parts) == len(SCENARIOS[name].configs("cpu"))
    for part in evidence.parts:
        assert part.info.status == "finished"
        assert part.config.name.startswith("workshop: ")
    results = evaluate(SCENARIOS[name], evidence)
    for result in results:
        assert result.verdict is not Verdict.FAILED and result.final and not result.waiting, result
        assert f"{result.mark} {result.title}: {result.figure}" in done.stdout
        assert f"    expected: {result.expectation}" in done.stdout


def test_an_override_the_cpu_does_not_meet_fails_the_speed_checks_and_says_why(tmp_path):
    """The speed scenario under an AMP_LAB_CPU_NATIVE that says the opposite of what torch detects here: the
    expectations are the override's, a check whose figure contradicts it fails naming the override, and the exit
    code follows the verdicts."""
    opposite = ",".join(sorted({"bf16", "fp16"} - cpu_math().detected)) or "none"
    done = workshop_cli("run", "speed", store=tmp_path / "runs.sqlite3", native=opposite, timed=True)
    assert "Traceback" not in done.stderr
    assert f": {CPU_NATIVE_ENV}={opposite} says this CPU has" in done.stdout
    verdicts = printed_verdicts(done.stdout)
    assert len(verdicts) == 3
    for title in verdicts:
        assert f"{CPU_NATIVE_ENV}={opposite} says this CPU" in done.stdout.split(f" {title}: ", 1)[1].split("\n")[1]
    failed = list(verdicts.values()).count(Verdict.FAILED)
    assert done.stdout.count("    why not: ") == failed
    assert done.stdout.count("the CPU does not do what the override says") == failed
    untold = list(verdicts.values()).count(Verdict.CANNOT_TELL)
    assert done.returncode == (EXIT_FAILED if failed else EXIT_CANNOT_TELL if untold else EXIT_HELD)


def test_a_bad_override_is_one_line_naming_it_and_exit_2(tmp_path):
    done = workshop_cli("run", "speed", store=tmp_path / "runs.sqlite3", native="avx512")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"error: modes: bf16-mixed cannot run on this device: {CPU_NATIVE_ENV}: unknown "
                                   "value 'avx512'; choose from none, bf16, fp16, bf16,fp16 (or leave it unset: torch "
                                   "detects)")


def test_list_names_every_scenario_first_on_its_line(capsys):
    assert main(["workshop", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(SCENARIOS)
    for line, scenario in zip(lines, SCENARIOS.values(), strict=True):
        assert scenario.title in line


def test_a_scenario_declares_the_extras_its_lanes_need_and_list_names_them_with_the_install_line(capsys):
    """What a scenario's lanes need (a recipe option built on torchao: the recipes extra), read from the runs it builds
    on either device, is what it declares; `workshop list` names each such extra with its install line."""
    assert main(["workshop", "list"]) == 0
    lines = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines())
    for name, scenario in SCENARIOS.items():
        recipes = {mode for device in ("cpu", "cuda") for config in scenario.configs(device) for mode in config.modes}
        needs_torchao = any(option.needs_torchao for recipe in recipes if "+" in recipe
                            for option in parse_recipe(recipe)[1])
        assert ("recipes" in scenario.extras) == needs_torchao, name
        for extra in scenario.extras:
            assert f"needs the {extra} extra" in lines[name] and EXTRAS[extra].install in lines[name], lines[name]
        if not scenario.extras:
            assert "extra (" not in lines[name]
    assert any(scenario.extras for scenario in SCENARIOS.values())  # the fp8 scenario, at least


def main_exit_code(argv: list[str]) -> int:
    """main()'s exit code: returned, or raised by argparse as SystemExit."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize(("args", "message"), [
    (["workshop", "run"], "the following arguments are required: name"),
    (["workshop", "frobnicate"], "invalid choice: 'frobnicate'"),
    (["workshop"], "the following arguments are required: {list,run}"),
    (["workshop", "run", "speed", "--device", "tpu"], "device: unknown value 'tpu'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main_exit_code(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_an_unknown_scenario_in_a_real_process_is_one_line_and_exit_2(tmp_path):
    done = workshop_cli("run", "no-such-scenario", store=tmp_path / "runs.sqlite3")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == ("error: no scenario 'no-such-scenario'; choose from " + ", ".join(SCENARIOS))


# --- checks that fail when the run does not show their point ---------------------------------------------------
def launched(scenario, tmp_path: Path) -> Evidence:
    manager = RunManager(open_store(tmp_path / "runs.sqlite3"))
    launch = ScenarioLaunch(manager, scenario, "cpu")
    assert launch.wait(120)
    return launch.evidence()


def with_config(name: str, **changes):
    """A scenario whose runs are built with `changes` (a setting that should make one of its checks fail)."""
    scenario = SCENARIOS[name]
    return dataclasses.replace(scenario, build=lambda device: tuple(dataclasses.replace(config, **changes)
                                                                    for config in scenario.build(device)))


def result_of(results, title: str):
    return next(result for result in results if result.title == title)


def test_a_scale_that_cannot_grow_back_in_time_fails_the_regrowth_check(tmp_path):
    scenario = with_config("spike-recovery", scaler=ScalerConfig(growth_interval=2000))
    results = evaluate(scenario, launched(scenario, tmp_path))
    regrowth = result_of(results, "Grow back")
    assert not regrowth.held and regrowth.final
    assert regrowth.figure == "the scale stayed below 2^16 to the end"
    assert "4 × 2000 clean steps" in regrowth.explanation
    assert result_of(results, "Skip").held  # the spike itself was skipped as before


def test_no_skips_fails_for_a_lane_that_skipped(tmp_path):
    evidence = launched(SCENARIOS["bf16-no-skip"], tmp_path)
    held, figure, explanation = no_skips("16-mixed")(evidence)
    assert not held and figure.startswith("16-mixed: 3 of 150 steps skipped") and explanation


def test_a_pure_fp16_lane_that_trains_fine_fails_the_stall_check(tmp_path):
    # SGD at this LR moves fp16 weights enough: 16-true keeps up, and the check must say so, not pass.
    scenario = with_config("fp16-scaler", optimizer="sgd", lr=0.05)
    results = evaluate(scenario, launched(scenario, tmp_path))
    stall = result_of(results, "16-true stalls or diverges")
    assert not stall.held
    assert "trained about as well as 32-true" in stall.explanation
    assert result_of(results, "16-mixed keeps up with 32-true").held


def test_fp32_loses_updates_at_a_vanishing_lr(tmp_path):
    scenario = with_config("lost-updates", lr=1e-12)
    results = evaluate(scenario, launched(scenario, tmp_path))
    fp32 = result_of(results, "fp32 weights keep their updates")
    assert not fp32.held and "tiny next to the weights" in fp32.explanation


def test_an_initial_scale_that_fits_fails_the_too_high_check(tmp_path):
    scenario = SCENARIOS["scale-collapse"]
    low = dataclasses.replace(scenario, build=lambda device: tuple(
        dataclasses.replace(config, faults=tuple(dataclasses.replace(fault, factor=2.0**10)
                                                 if fault.kind == "init_scale" else fault for fault in config.faults))
        for config in scenario.build(device)))
    results = evaluate(low, launched(low, tmp_path))
    settles = result_of(results, "A too-high initial scale costs a few steps")
    assert not settles.held and "No step was skipped" in settles.explanation
    assert result_of(results, "NaN from the model collapses the scale").held


def test_precision_or_data_fails_when_the_planted_faults_do_not_show_their_point(tmp_path):
    """An initial scale that fits (nothing overflows) and an 'outlier' of x1 (an ordinary batch): both checks fail
    and say why, read from the replays the scenario recorded after its run."""
    scenario = SCENARIOS["precision-or-data"]
    tame = dataclasses.replace(scenario, build=lambda device: tuple(
        dataclasses.replace(config, faults=tuple(dataclasses.replace(fault, factor=2.0**4 if fault.kind ==
                                                                     "init_scale" else 1.0)
                                                 for fault in config.faults))
        for config in scenario.build(device)))
    evidence = launched(tame, tmp_path)
    results = evaluate(tame, evidence)
    overflow = result_of(results, "The overflow is precision")
    assert not overflow.held and overflow.final and overflow.figure == "16-mixed skipped no step before the outlier"
    assert "nothing overflowed fp16" in overflow.explanation
    outlier = result_of(results, "The outlier is data")
    assert not outlier.held and outlier.figure.startswith("step 40: verdict unclear")
    assert "no mode breaks on replay" in outlier.explanation
    events = evidence.reader.events(evidence.parts[0].run_id)
    assert events[events["kind"] == "replayed"]["step"].tolist() == [40]  # recorded in the run, by the launch


def test_checks_wait_for_records_and_fail_when_the_run_ended_without_them(tmp_path):
    manager = RunManager(open_store(tmp_path / "runs.sqlite3"))
    scenario = SCENARIOS["spike-recovery"]
    before = evaluate(scenario, Evidence(manager, [], 1, ended=False))
    assert all(r.waiting and not r.held and not r.final and r.figure.startswith("waiting for run 1 of 1")
               for r in before)
    # A run stopped before its spike: the checks that need the spike say the run ended first.
    short = dataclasses.replace(scenario, build=lambda device: (
        dataclasses.replace(scenario.build(device)[0], steps=30),))
    launch = ScenarioLaunch(manager, short, "cpu")
    assert launch.wait(60)
    for result in evaluate(short, launch.evidence()):
        assert not result.held and result.final
        assert result.figure.startswith("the run ended before")


def test_a_check_that_raises_waiting_is_reported_as_waiting():
    check = Check("t", "e", lambda evidence: (_ for _ in ()).throw(Waiting("step 5")))
    result = check.evaluate(Evidence(None, [], 1, ended=False))
    assert (result.held, result.verdict, result.waiting, result.figure) == (False, Verdict.FAILED, True,
                                                                            "waiting for step 5")


def results_of(*verdicts: Verdict, final: bool = True) -> list[CheckResult]:
    return [CheckResult(f"c{index}", verdict, "figure", "expected", final=final)
            for index, verdict in enumerate(verdicts)]


@pytest.mark.parametrize(("verdicts", "code", "line"), [
    ((Verdict.HELD, Verdict.HELD), EXIT_HELD, "2 of 2 checks held"),
    ((Verdict.HELD, Verdict.CANNOT_TELL), EXIT_CANNOT_TELL, "1 of 2 checks held, 1 cannot be told here"),
    ((Verdict.FAILED, Verdict.CANNOT_TELL), EXIT_FAILED, "0 of 2 checks held, 1 cannot be told here"),
    ((Verdict.HELD, Verdict.FAILED), EXIT_FAILED, "1 of 2 checks held"),
])
def test_what_the_verdicts_add_up_to(verdicts, code, line):
    results = results_of(*verdicts)
    assert (exit_code(results), headline(results)) == (code, line)
    assert headline(results_of(*verdicts, final=False)) == "so far " + line.replace("checks held", "checks hold")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_scenario_builds_valid_runs_for_both_devices(name):
    scenario = SCENARIOS[name]
    for device in ("cpu", "cuda"):
        configs = scenario.configs(device)
        assert configs and all(isinstance(config, RunConfig) and config.device == device for config in configs)
        assert all(config.name.startswith("workshop: ") for config in configs)
        line = scenario.expected_here(device)  # what this device implies, in one line, where the outcome depends on it
        assert "\n" not in line and bool(line) == (scenario.expects is not None)
    assert len(scenario.checks) >= 3
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", scenario.watch) if s]
    assert len(sentences) == 2, scenario.watch


def test_a_stopped_launch_ends_and_its_checks_say_what_never_came(tmp_path, stepped_launches):
    manager = RunManager(open_store(tmp_path / "runs.sqlite3"))
    launch = ScenarioLaunch(manager, SCENARIOS["speed"], "cpu")
    first = manager.get(launch.run_ids[0])
    first.wait_until(lambda run: run.lane_steps >= 6)
    launch.stop()
    assert launch.wait(60) and not launch.going
    assert len(launch.run_ids) == 1  # the large run never started
    results = launch.results()
    assert all(result.final and not result.held for result in results)
    assert {result.figure for result in results[1:]} == {"the run ended before run 2 of 2 to start"}
    assert manager.run_info(launch.run_ids[0]).status == "stopped"


# --- "Find the layer, keep it, pay for it": its checks both ways, from the records the CLI's run stored ------------
class EditedEvents:
    """A RunReader whose events pass through `edit(report_data)` (the `bisected` event's report, as stored) first;
    everything else is the store's."""

    def __init__(self, reader, edit):
        self.reader, self.edit = reader, edit

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def events(self, run_id):
        events = self.reader.events(run_id).copy()
        datas, kept = [], []
        for kind, data in zip(events["kind"], events["data"], strict=True):
            if kind == "bisected" and isinstance(data, dict):
                data = copy.deepcopy(data)
                kept.append(self.edit(data["report"]) is not False)  # an edit returning False drops the event
            else:
                kept.append(True)
            datas.append(data)
        events["data"] = datas
        return events[kept]


@pytest.fixture(scope="module")
def keep_evidence(cli_runs):
    """The keep-layer scenario's evidence as its CLI run stored it (no run of its own)."""
    done, store = cli_runs["keep-layer"]
    manager = RunManager(open_store(store))
    return manager, run_ids(done.stdout)


def keep_results(keep_evidence, edit=None, edit_steps=None) -> dict[str, CheckResult]:
    manager, ids = keep_evidence
    evidence = gather(manager, ids)
    if edit is not None:
        evidence.reader = EditedEvents(manager, edit)
    if edit_steps is not None:
        part = evidence.parts[0]
        edit_steps(part.steps, {lane.mode: lane.lane for lane in part.info.lanes})
    return {result.title: result for result in evaluate(SCENARIOS["keep-layer"], evidence)}


def test_keep_layer_reads_the_bisect_and_its_price_race_from_the_store(keep_evidence):
    from amp_core.diagnostics.bisect import recorded_bisects
    from amp_core.workshop.planted import PLANTED_MODULE

    manager, ids = keep_evidence
    report = recorded_bisects(manager.events(ids[0]))[-1]
    results = keep_results(keep_evidence)
    # What the checks say is what the recorded report holds: the planted module, the fixed lane, the price line.
    assert report.kept == [PLANTED_MODULE] and report.fixed_recipe == f"16-mixed+keep:{PLANTED_MODULE}"
    assert results["The bisect finds the planted layer"].figure.startswith(f"keep {PLANTED_MODULE} (1 of ")
    assert results["Keeping it costs time, not weight memory"].figure == report.price_line()
    table = SCENARIOS["keep-layer"].table(gather(manager, ids))
    assert table["lane"].tolist() == ["16-mixed", report.fixed_recipe, "32-true"]
    assert (table["ms/step"].astype(float) > 0).all() and table["skipped"].tolist()[1:] == [0, 0]


def _set_kept(kept):
    def edit(report):
        report["kept"] = kept
    return edit


def _fixed_row(**changes):
    def edit(report):
        for row in report["price"]:
            if "+keep:" in row["recipe"]:
                row.update(changes)
    return edit


def test_keep_layer_checks_fail_when_the_records_do_not_show_their_point(keep_evidence):
    from amp_core.workshop.planted import PLANTED_MODULE

    other = "blocks.1.gain"
    wrong = keep_results(keep_evidence, _set_kept([other]))["The bisect finds the planted layer"]
    assert wrong.verdict is Verdict.FAILED and "the planted module is not in it" in wrong.explanation
    more = keep_results(keep_evidence, _set_kept([other, PLANTED_MODULE]))["The bisect finds the planted layer"]
    assert more.verdict is Verdict.FAILED and "more than the planted module" in more.explanation
    skipping = keep_results(keep_evidence, _fixed_row(skipped=3))["The fixed lane trains"]
    assert skipping.verdict is Verdict.FAILED and "skipped 3 steps" in skipping.explanation
    drifted = keep_results(keep_evidence, _fixed_row(loss=9.0))["The fixed lane trains"]
    assert drifted.verdict is Verdict.FAILED and "away from 32-true's" in drifted.explanation
    heavier = keep_results(keep_evidence, _fixed_row(memory_bytes=10 * 2**20))
    assert heavier["Keeping it costs time, not weight memory"].verdict is Verdict.FAILED
    data = keep_results(keep_evidence, lambda report: report.update(verdict="data", kept=[], why="fp32 too"))
    assert all(data[title].verdict is Verdict.FAILED and data[title].explanation == "fp32 too"
               for title in list(data)[1:])
    none = keep_results(keep_evidence, lambda report: False)  # the bisect never recorded: the run ended without it
    assert all(none[title].figure == "the run ended before the bisect, made when the run has ended"
               for title in list(none)[1:])

    def fp32_too(steps, lanes):  # 32-true fails as well: the failure is not the format's
        steps.loc[(steps["lane"] == lanes["32-true"]) & (steps["step"] == 5), "loss"] = float("nan")

    both = keep_results(keep_evidence, edit_steps=fp32_too)["16-mixed breaks, 32-true trains"]
    assert both.verdict is Verdict.FAILED and "32-true failed too" in both.explanation
