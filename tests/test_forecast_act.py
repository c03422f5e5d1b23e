"""Acting on a forecast, on real runs: the race of the fix a forecast names (from the lane's weights at the step it
was told) shows the lane break where the run broke and the kept layer train through; the CLI flag's exit codes; Layer
numerics draws each layer's headroom with the forecast's line and the break, and races the fix on a click; the
Overflow debugger marks each failed step with whether it was forecast and how early."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from amp_core.cli import main
from amp_core.config import ConfigError, FaultSpec, RunConfig
from amp_core.diagnostics.forecast_fix import (
    FIX_RACED_EVENT,
    acted_forecast,
    forecast_fixes,
    race_fix,
    recorded_fix_races,
)
from amp_core.probes.headroom import FORECAST_EVENT
from amp_core.race.runner import RunManager
from amp_core.race.snapshots import ReplayError
from amp_core.records.opening import open_store
from amp_core.views.headroom import headroom_history, was_it_forecast
from amp_core.workshop import planted
from pages.common import get_manager

ROOT = Path(__file__).resolve().parents[1]
EVERY = 10


def growing_config(**more) -> RunConfig:
    """16-mixed and 32-true on the growing layer (fp16 overflows after some 240 steps), layers sampled every 10."""
    planted.register()
    return RunConfig(workload=planted.GrowingPlantedDigits.name, size="small", modes=("16-mixed", "32-true"),
                     steps=300, amax_every=EVERY, device="cpu", intra_op_threads=1, gradstats_every=0, **more)


def first_failure(run) -> int:
    frame = run.frame()
    mine = frame[frame["lane"] == 0]
    return int(mine[~mine["loss"].map(math.isfinite)]["step"].min())


@pytest.fixture
def growing(fresh_store):
    """A finished growing race through the pages' manager (the test's store)."""
    run = get_manager().launch(growing_config())
    run.join(120)
    return run


def test_the_fixes_a_forecast_names():
    data = {"module": "blocks.2.gain", "tensor": "output", "format": "fp16", "limit": "max"}
    assert [r for r, _ in forecast_fixes("16-mixed", data)] == ["16-mixed+keep:blocks.2.gain", "bf16-mixed"]
    assert [r for r, _ in forecast_fixes("16-true+sr", data)] == ["16-true+sr+keep:blocks.2.gain", "bf16-true+sr"]
    bf16 = {**data, "format": "bf16", "limit": "smallest normal"}
    assert [r for r, _ in forecast_fixes("bf16-mixed", bf16)] == ["bf16-mixed+keep:blocks.2.gain"]


@pytest.mark.parametrize("held", [True, False], ids=["snapshot-or-seed-in-process", "stored-run-from-seed"])
def test_the_fix_race_breaks_where_the_run_broke_and_the_kept_layer_trains_through(growing, held):
    failure = first_failure(growing)
    manager = get_manager() if held else RunManager(open_store(get_manager().store.location))
    race = race_fix(manager, growing.run_id, "16-mixed", record=True)
    told = [e for e in growing.events() if e.kind == FORECAST_EVENT and e.lane == 0]
    assert race.told_step == told[0].step and race.start_step == told[0].step + 1  # the first warning's weights
    assert failure - race.told_step >= 100
    assert race.original.broke_at == failure  # the same weights and batches: the run's own break, to the step
    kept = race.lane_of(f"16-mixed+keep:{planted.GROWING_MODULE}")
    assert kept.broke_at is None and kept.steps == race.last_step - race.start_step + 1 and kept.skipped == 0
    assert race.lane_of("bf16-mixed").broke_at is None and race.lane_of("32-true").broke_at is None
    assert race.last_step >= race.forecast["hi_step"]
    assert race.verdict == "avoided" and "the break is avoided" in race.line()
    assert ("snapshot" in race.source or "seed" in race.source) if held else "from its seed" in race.source
    assert abs(kept.last_loss - race.lane_of("32-true").last_loss) < 0.1 * race.lane_of("32-true").last_loss
    recorded = recorded_fix_races(manager.events(growing.run_id), 0)
    assert [r.line() for r in recorded] == [race.line()]


def test_a_fix_race_refuses_what_it_cannot_act_on(growing):
    manager = get_manager()
    with pytest.raises(ReplayError, match=r"lane 1 \(32-true\) of run .* has no forecast"):
        race_fix(manager, growing.run_id, 1)
    with pytest.raises(ConfigError, match="told no forecast at step 3"):
        race_fix(manager, growing.run_id, 0, told_at=3)
    with pytest.raises(ConfigError, match="steps"):
        race_fix(manager, growing.run_id, 0, steps=0)
    with pytest.raises(ReplayError, match="no run 'nope'"):
        race_fix(manager, "nope", 0)


def cli(store, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--store", str(store), *args])
    return code, out.getvalue(), err.getvalue()


def test_cli_race_fix_exit_codes(growing, fresh_store):
    code, out, err = cli(fresh_store, "forecast", growing.run_id, "--lane", "0", "--race-fix")
    assert code == 0, err
    assert out.strip().splitlines()[-1].endswith("the break is avoided")
    assert f"16-mixed+keep:{planted.GROWING_MODULE}" in out and f"broke at step {first_failure(growing)}" in out
    code, out, err = cli(fresh_store, "forecast", growing.run_id, "--lane", "1", "--race-fix")
    assert code == 2 and "has no forecast" in err and err.strip().count("\n") == 0
    code, _, err = cli(fresh_store, "forecast", growing.run_id, "--race-fix")
    assert code == 2 and "--lane" in err
    told = [e.step for e in growing.events() if e.kind == FORECAST_EVENT and e.lane == 0]
    code, out, err = cli(fresh_store, "forecast", growing.run_id, "--lane", "0", "--race-fix", "--told-at",
                         str(told[-1]))  # the latest told forecast, from its own (later) weights
    assert code == 0, err
    code, _, err = cli(fresh_store, "forecast", growing.run_id, "--lane", "0", "--race-fix", "--told-at", "7")
    assert code == 2 and "told no forecast at step 7" in err
    events = open_store(fresh_store).events(growing.run_id)
    assert (events["kind"] == FIX_RACED_EVENT).sum() == 2
    assert recorded_fix_races(events, 0)[-1].told_step == told[-1]


def figure_titled(app: AppTest, text: str) -> dict:
    (found,) = [f for f in (json.loads(c.proto.spec) for c in app.get("plotly_chart"))
                if text in f["layout"].get("title", {}).get("text", "")]
    return found


def test_layer_numerics_draws_headroom_with_the_forecast_and_races_the_fix(growing):
    failure = first_failure(growing)
    events = get_manager().events(growing.run_id)
    told_at, forecast = acted_forecast(events, 0)
    app = AppTest.from_file(str(ROOT / "pages" / "layer_numerics.py"), default_timeout=120).run()
    assert not app.exception and not app.error
    assert app.selectbox(key=f"lnum_amax_lane_{growing.run_id}").value == 0
    chart = figure_titled(app, "Headroom of each layer's outputs to fp16's largest value")
    traces = {trace.get("name"): trace for trace in chart["data"]}
    layer = traces[planted.GROWING_MODULE]
    history = headroom_history(events, 0, "output", "fp16", "max")
    assert layer["y"][:5] == pytest.approx(history[history["module"] == planted.GROWING_MODULE]["headroom_bits"]
                                           .tolist()[:5])
    assert layer["y"][0] > layer["y"][15] > 0  # the planted layer's headroom shrinks step after step
    line = traces[f"forecast told at step {told_at}"]
    assert line["x"] == [told_at, forecast["predicted_step"]] and line["y"][1] == 0
    texts = [a["text"] for a in chart["layout"]["annotations"]]
    assert f"forecast: step {forecast['predicted_step']}" in texts and f"broke: step {failure}" in texts
    assert forecast["lo_step"] - 20 <= failure <= forecast["hi_step"] + 20
    app.radio(key="lnum_headroom_format").set_value("bf16").run()
    assert figure_titled(app, "to bf16's largest value")  # another format: the same samples against its limit
    app.button(key="lnum_fix_race").click().run()
    job = app.session_state["fix_race_jobs"][(growing.run_id, 0)]
    deadline = time.monotonic() + 120
    while not job.done and time.monotonic() < deadline:
        time.sleep(0.2)
    app.run()
    assert not app.exception and not job.error, job.error
    assert any("the break is avoided" in s.value for s in app.success)
    (table,) = [df.value for df in app.dataframe if "what it changes" in df.value.columns]
    assert list(table["recipe"]) == ["16-mixed", f"16-mixed+keep:{planted.GROWING_MODULE}", "bf16-mixed", "32-true"]
    assert table["broke at"].tolist() == [f"step {failure}", "—", "—", "—"]
    assert any("keep_in_fp32(model, KEEP)" in c.value and planted.GROWING_MODULE in c.value for c in app.code)


def test_the_overflow_debugger_marks_whether_each_failure_was_forecast(growing):
    """The growing layer's break was forecast (told 100+ steps ahead, within its interval); a loss spike's skipped
    steps in a sampled lane were not (nothing trended toward them)."""
    spike = get_manager().launch(RunConfig(workload="digits_mlp", modes=("16-mixed",), steps=60, amax_every=EVERY,
                                           gradstats_every=0, device="cpu",
                                           faults=(FaultSpec(kind="loss_scale", step=30, duration=2, factor=1e6),)))
    spike.join(60)
    failure = first_failure(growing)
    app = AppTest.from_file(str(ROOT / "pages" / "overflow_debugger.py"), default_timeout=120)
    app.session_state["dbg_run"] = growing.run_id
    app.run()
    assert not app.exception and not app.error
    (table,) = [df.value for df in app.dataframe if "steps ahead" in df.value.columns]
    row = table[table["step"] == failure].iloc[0]
    assert row["forecast"] == "yes, within its interval" and row["steps ahead"] >= 100
    assert planted.GROWING_MODULE in row["layer"]
    assert any("Was it forecast?" in m.value for m in app.markdown)
    assert any("Race the fix" in b.label for b in app.button)
    manager = get_manager()
    marked = was_it_forecast(manager.steps(spike.run_id), manager.events(spike.run_id), 0)
    assert marked["step"].tolist() == [30, 31] and set(marked["forecast"]) == {"no"}
    assert set(marked["what failed"]) == {"skipped (gradients inf/NaN)"}


def test_was_it_forecast_says_how_the_failure_fell_against_the_interval_and_held_gradients_are_scaled():
    """The view's arithmetic on records written by hand: a failure before, inside and after the first warning's
    interval; a scaled gradient's headroom is the held value's (amax as the backward held it, at that scale)."""
    import pandas as pd

    forecast = {"module": "m", "tensor": "output", "format": "fp16", "limit": "max", "predicted_step": 200,
                "lo_step": 180, "hi_step": 220, "sample_step": 50, "headroom_bits": 3.0}
    events = pd.DataFrame([
        {"kind": "layer_amax", "lane": 0, "step": 40, "data": {"modules": ["m", "(loss)"], "output_amax": [8.0, 1.0],
                                                               "grad_amax": [2.0**10, 2.0**16], "scale": 2.0**16}},
        {"kind": FORECAST_EVENT, "lane": 0, "step": 50, "data": forecast},
        {"kind": FORECAST_EVENT, "lane": 0, "step": 90, "data": {**forecast, "predicted_step": 210}}])
    steps = pd.DataFrame({"lane": [0, 0, 0, 0], "step": [30, 150, 200, 250],
                          "loss": [1.0, float("inf"), float("nan"), 1.0], "skipped": [True, False, False, True]})
    table = was_it_forecast(steps, events, 0)
    assert table["forecast"].tolist() == ["no", "yes, 30 steps before its interval", "yes, within its interval",
                                          "yes, 30 steps after its interval"]
    assert table["told at"].tolist()[1:] == [50, 50, 50] and table["steps ahead"].tolist()[1:] == [100, 150, 200]
    assert table["what failed"].tolist() == ["skipped (gradients inf/NaN)", "loss inf", "loss nan",
                                             "skipped (gradients inf/NaN)"]
    grads = headroom_history(events, 0, "grad", "fp16", "max")
    assert grads["module"].tolist() == ["m"] and grads["headroom_bits"].iloc[0] == pytest.approx(math.log2(65504) - 10)
