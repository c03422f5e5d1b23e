"""The workshop's "See it coming" on a real run through `amp-lab workshop run` (in this process: the generic test of
every scenario in tests/test_workshop.py runs it in a process of its own): every check holds here, reads what the
stored records hold, and turns ✗ when the records do not show its point (no forecast, a late one, another layer, a
break outside the interval, a fix that broke too, no fix race)."""

from __future__ import annotations

import contextlib
import copy
import io
import re

import pytest

from amp_core.cli import main
from amp_core.diagnostics.forecast_fix import FIX_RACED_EVENT, recorded_fix_races
from amp_core.probes.headroom import FORECAST_EVENT
from amp_core.race.runner import RunManager
from amp_core.records.opening import open_store
from amp_core.workshop import EXIT_HELD, SCENARIOS, Verdict, evaluate, gather
from amp_core.workshop.planted import GROWING_MODULE
from amp_core.workshop.see_it_coming import LANE, LEAD_MIN

SCENARIO = SCENARIOS["see-it-coming"]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The scenario run once by the CLI into a store: (exit code, output, manager, run ids)."""
    store = tmp_path_factory.mktemp("see") / "runs.sqlite3"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["workshop", "run", "see-it-coming", "--store", str(store), "--device", "cpu"])
    text = out.getvalue()
    return code, text, RunManager(open_store(store)), re.findall(r"^run (\S+): ", text, flags=re.MULTILINE)


class EditedEvents:
    """A RunReader whose events go through `edit(events)` (a copy of the stored frame) first."""

    def __init__(self, reader, edit):
        self.reader, self.edit = reader, edit

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def events(self, run_id):
        events = self.reader.events(run_id).copy()
        events["data"] = [copy.deepcopy(data) for data in events["data"]]
        return self.edit(events)


def results(stored, edit=None) -> dict:
    _, _, manager, ids = stored
    evidence = gather(manager, ids)
    if edit is not None:
        evidence.reader = EditedEvents(manager, edit)
    return {result.title: result for result in evaluate(SCENARIO, evidence)}


def test_every_check_holds_and_reads_the_stored_forecast_and_fix_race(stored):
    code, text, manager, ids = stored
    assert code == EXIT_HELD, text
    assert "3 of 3 checks held" in text.splitlines()
    events = manager.events(ids[0])
    first = events[events["kind"] == FORECAST_EVENT].iloc[0]
    came_first = results(stored)["The forecast came first"]
    assert came_first.figure.startswith(f"told at step {int(first['step'])}: {GROWING_MODULE} reaches fp16's max")
    (race,) = recorded_fix_races(events)
    assert results(stored)["Keeping the layer avoids it"].figure == race.line()
    table = SCENARIO.table(gather(manager, ids))
    assert table["what"].iloc[0].startswith(f"forecast: {GROWING_MODULE}") and table["what"].iloc[-1].startswith(
        "broke: loss")


def _forecasts(change):
    def edit(events):
        for data, kind in zip(events["data"], events["kind"], strict=True):
            if kind == FORECAST_EVENT:
                change(data)
        return events
    return edit


def test_the_checks_fail_when_the_records_do_not_show_their_point(stored):
    none = results(stored, lambda events: events[events["kind"] != FORECAST_EVENT])["The forecast came first"]
    assert none.verdict is Verdict.FAILED and "with no forecast before it" in none.figure
    other = results(stored, _forecasts(lambda data: data.update(module="blocks.1.gain")))["The forecast came first"]
    assert other.verdict is Verdict.FAILED and "not the growing layer" in other.explanation

    def late(events):
        told = events["kind"] == FORECAST_EVENT
        failure = int(results(stored)["It came true"].figure.split("broke at step ")[1].split(":")[0])
        events.loc[told, "step"] = failure - LEAD_MIN + 10
        return events
    assert results(stored, late)["The forecast came first"].verdict is Verdict.FAILED
    off = results(stored, _forecasts(lambda data: data.update(predicted_step=data["predicted_step"] + 400,
                                                              lo_step=data["lo_step"] + 400,
                                                              hi_step=data["hi_step"] + 400)))["It came true"]
    assert off.verdict is Verdict.FAILED and "outside the interval" in off.explanation

    def kept_broke(events):
        for data, kind in zip(events["data"], events["kind"], strict=True):
            if kind == FIX_RACED_EVENT:
                for lane in data["race"]["lanes"]:
                    if "+keep:" in lane["recipe"]:
                        lane["broke_at"] = 250
        return events
    broke = results(stored, kept_broke)["Keeping the layer avoids it"]
    assert broke.verdict is Verdict.FAILED and "broke too, at step 250" in broke.explanation
    missing = results(stored, lambda events: events[events["kind"] != FIX_RACED_EVENT])["Keeping the layer avoids it"]
    assert missing.verdict is Verdict.FAILED and missing.figure == ("the run ended before the fix race, made when the "
                                                                    "run has ended")


def test_the_scenario_is_one_fast_race_of_the_lane_and_fp32_sampling_layers():
    (config,) = SCENARIO.configs("cpu")
    assert config.modes == (LANE, "32-true") and config.amax_every > 0 and config.steps <= 400
