"""The Overflow debugger page under AppTest: empty store, a finished run from the store, launching the demo,
refused input, a live run, an attached run (a Monitor script in its own process, with a planted inf), and the page
inside app.py's navigation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_monitor import said, start_script
from test_requests import go_on

from amp_core.config import FaultSpec, RunConfig, ScalerConfig
from amp_core.probes import faults
from amp_core.race.runner import Run
from amp_core.records.opening import open_store

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "overflow_debugger.py")
LAUNCH = "FormSubmitter:dbg_fault_form-Launch demo run"


def _page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    return at


def _manager():
    return sys.modules["pages.common"].get_manager()


TABLES = {"dbg_overview": "skipped steps", "dbg_skipped": "outcome", "dbg_fractions": "format",
          "dbg_first_nonfinite": "phase", "dbg_review": "band ≤"}


def _frames(at: AppTest) -> dict[str, object]:
    """The page's tables by key (AppTest does not expose a dataframe's key: each has a column only it has)."""
    found = {}
    for key, column in TABLES.items():
        matches = [df.value for df in at.dataframe if column in df.value.columns]
        assert len(matches) <= 1, key
        if matches:
            found[key] = matches[0]
    return found


def _chart(at: AppTest, key: str) -> dict:
    charts = [c for c in at.get("plotly_chart") if json.loads(c.proto.spec) and key in c.proto.id]
    assert len(charts) == 1, [c.proto.id for c in at.get("plotly_chart")]
    return json.loads(charts[0].proto.spec)


@pytest.fixture
def stored_run(fresh_store) -> str:
    """A finished 16-mixed + bf16-mixed run with a loss spike, written to the test's store."""
    config = RunConfig(workload="digits_mlp", modes=("16-mixed", "bf16-mixed"), steps=60, gradstats_every=10,
                       scaler=ScalerConfig(growth_interval=10),
                       faults=(FaultSpec(kind="loss_scale", step=20, duration=2, factor=1e6),))
    run = Run(config, open_store(fresh_store)).start()
    run.join(120)
    assert run.status == "finished"
    return run.run_id


def test_renders_with_no_run():
    at = _page()
    assert not at.error
    assert at.title[0].value == "Overflow debugger"
    assert any("No runs yet" in info.value for info in at.info)
    assert at.expander[0].proto.expanded  # nothing to debug yet: the fault panel is open
    assert at.selectbox(key="dbg_workload").value == "digits_mlp"
    assert at.multiselect(key="dbg_modes").value == ["16-mixed", "bf16-mixed"]
    assert at.number_input(key="dbg_growth").value == faults.DEMO_GROWTH_INTERVAL
    assert any("default is 2000" in (n.help or "") for n in at.number_input)
    assert not at.get("plotly_chart")


def test_finished_run_from_the_store(stored_run):
    at = _page()
    assert not at.error
    assert at.selectbox(key="dbg_run").value == stored_run
    assert at.selectbox(key=f"dbg_lane_{stored_run}").value == 0  # the 16-mixed lane opens first
    assert at.expander[0].proto.expanded  # the fault panel stays open once runs exist: a newcomer finds it
    frames = _frames(at)
    overview = frames["dbg_overview"].set_index("mode")
    assert overview.loc["16-mixed", "skipped steps"] == 2 and overview.loc["bf16-mixed", "skipped steps"] == 0
    assert overview.loc["bf16-mixed", "scale now"] == "no scaler"  # not "None"
    assert float(overview.loc["16-mixed", "scale now"]) > 0
    assert "None" not in overview.astype(str).to_numpy()
    skipped = frames["dbg_skipped"]
    assert skipped["step"].tolist() == [20, 21]
    assert all(text.startswith("fc1.weight") for text in skipped["parameters"])
    assert (skipped["NaN"] > skipped["inf"]).all()
    assert list(skipped.columns)[-1] == "parameters"  # the long column ends the row: nothing pushed off the page
    assert any(c.value.startswith("Why NaN rather than inf?") for c in at.caption)  # the table's NaN explained
    assert any("What the fault did" in md.value for md in at.markdown)
    assert any("2 steps skipped" in md.value and "16-mixed" in md.value for md in at.markdown)
    # No scheduler in this run: the scheduler note waits, folded, below the chart instead of squeezing it.
    (note,) = [e for e in at.expander if e.label.startswith("LR schedulers and skipped steps")]
    assert not note.proto.expanded
    assert any("Detected call of `lr_scheduler.step()` before `optimizer.step()`" in md.value for md in note.markdown)
    timeline = _chart(at, "dbg_timeline")
    names = {t.get("name") for t in timeline["data"]}
    assert {"scale (16-mixed)", "skipped step", "scale backoff"} <= names
    # The gradient section opens on the first skipped step, where the spike's overflow left NaN, not bars.
    assert at.selectbox(key=f"dbg_stat_step_{stored_run}_0").value == 20
    histogram = _chart(at, "dbg_histogram")
    assert {t["name"] for t in histogram["data"] if t.get("orientation") == "h"} >= {"overflow", "subnormal"}
    assert any(a["text"].startswith("no finite non-zero gradient here") for a in histogram["layout"]["annotations"])
    assert any("inf or NaN at this step" in c.value for c in at.caption)
    # Nothing finite at that step: the lost shares are "—", not a made-up 0 %.
    assert _frames(at)["dbg_fractions"].drop(columns=["format", "gradient"]).isna().all().all()
    at.selectbox(key=f"dbg_stat_step_{stored_run}_0").set_value(50).run()
    assert not at.exception
    histogram = _chart(at, "dbg_histogram")
    assert any(t["name"].endswith("(scaled)") for t in histogram["data"])  # 16-mixed: the scaled view too
    fractions = _frames(at)["dbg_fractions"].set_index(["format", "gradient"])
    assert [fmt for fmt, _ in fractions.index] == ["fp16", "fp16", "bf16", "bf16"]  # unscaled, then x the scale
    assert fractions.loc[("fp16", "unscaled"), "subnormal"] > 0  # digits_mlp's small gradients: fp16 subnormals


def test_a_run_with_a_scheduler_shows_the_scheduler_note_open(fresh_store):
    config = RunConfig(workload="mlp_regression", modes=("16-mixed",), steps=12, scheduler="onecycle")
    run = Run(config, open_store(fresh_store)).start()
    run.join(60)
    at = _page()
    assert not at.exception and not at.error
    assert not [e for e in at.expander if e.label.startswith("LR schedulers")]
    assert any(md.value.startswith("**Why the LR scheduler waits too.**") for md in at.markdown)


def test_skipped_step_and_bf16_lane(stored_run):
    at = _page()
    step_box = at.selectbox(key=f"dbg_stat_step_{stored_run}_0")
    assert "step 20 · skipped" in step_box.options and "step 10" in step_box.options
    step_box.set_value(20).run()
    assert not at.exception and not at.error
    assert any(m.label == "NaN" and m.value != "0" for m in at.metric)  # the spike's overflow, unscaled
    at.selectbox(key=f"dbg_lane_{stored_run}").set_value(1).run()
    assert not at.exception and not at.error
    timeline = _chart(at, "dbg_timeline")
    assert any("has no GradScaler" in a["text"] for a in timeline["layout"]["annotations"])
    assert "dbg_skipped" not in _frames(at)
    assert any("bf16-mixed has no GradScaler" in c.value for c in at.caption)
    histogram = _chart(at, "dbg_histogram")
    assert not any(t["name"].endswith("(scaled)") for t in histogram["data"])
    at.selectbox(key=f"dbg_stat_param_{stored_run}_1").set_value("fc2.bias").run()
    assert not at.exception
    assert any(m.label == "elements" and m.value == "10" for m in at.metric)


def test_launching_the_demo_creates_a_two_lane_run(no_leaked_threads):
    at = _page()
    at.number_input(key="dbg_steps").set_value(120)
    at.button(key=LAUNCH).click().run()
    assert not at.exception and not at.error
    runs = _manager().list_runs()
    assert len(runs) == 1 and runs.loc[0, "modes"] == ["16-mixed", "bf16-mixed"]
    run = _manager().get(runs.loc[0, "run_id"])
    assert run.config.faults == (FaultSpec(kind="loss_scale", step=50, duration=3, factor=1e6),)
    assert run.config.scaler.growth_interval == faults.DEMO_GROWTH_INTERVAL
    assert at.selectbox(key="dbg_run").value == run.run_id
    assert any("Launched" in s.value for s in at.success)
    run.join(120)
    at.run()
    assert not at.exception and not at.error
    overview = _frames(at)["dbg_overview"].set_index("mode")
    assert overview.loc["16-mixed", "skipped steps"] == 3
    assert overview.loc["bf16-mixed", "skipped steps"] == 0


def test_grad_inf_demo_names_the_chosen_parameter(no_leaked_threads):
    at = _page()
    at.selectbox(key="dbg_workload").set_value("mlp_regression").run()
    at.selectbox(key="dbg_kind").set_value("grad_inf").run()
    assert at.selectbox(key="dbg_param").options == ["layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias"]
    at.selectbox(key="dbg_param").set_value("layer2.weight")
    at.number_input(key="dbg_step").set_value(30)
    at.number_input(key="dbg_steps").set_value(40)
    at.multiselect(key="dbg_modes").set_value(["16-mixed"])
    at.button(key=LAUNCH).click().run()
    assert not at.exception and not at.error
    run = _manager().get(at.selectbox(key="dbg_run").value)
    run.join(60)
    at.run()
    skipped = _frames(at)["dbg_skipped"]
    assert skipped.set_index("step").loc[30, "parameters"] == "layer2.weight (1 inf)"


@pytest.mark.parametrize(("widget", "value", "field"), [
    ("dbg_factor", 0.0, "faults.factor"),
    ("dbg_step", 500, "faults.step"),
])
def test_bad_demo_input_names_the_field(widget, value, field):
    at = _page()
    at.number_input(key=widget).set_value(value)
    at.button(key=LAUNCH).click().run()
    assert not at.exception
    assert any(f"**{field}**" in error.value for error in at.error), [e.value for e in at.error]
    assert _manager().list_runs().empty


def test_no_modes_is_refused():
    at = _page()
    at.multiselect(key="dbg_modes").set_value([])
    at.button(key=LAUNCH).click().run()
    assert not at.exception
    assert any("**modes**" in error.value for error in at.error)


def test_run_limit_is_an_error_and_a_live_run_redraws(no_leaked_threads):
    at = _page()
    at.number_input(key="dbg_steps").set_value(100_000)
    for _ in range(3):
        at.button(key=LAUNCH).click().run()
        assert not at.exception
    assert any("**runs**" in error.value and "already going" in error.value for error in at.error)
    assert len(_manager().list_runs()) == 2
    assert any("live: redrawn every second" in c.value for c in at.caption)
    at.run()  # the run_every fragment draws again
    assert not at.exception
    assert "dbg_overview" in _frames(at)
    _manager().stop_all()
    at.run()
    assert not at.exception and not at.error
    assert not any("live: redrawn" in c.value for c in at.caption)


def test_inside_the_app(stored_run):
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    assert not at.exception
    at.switch_page("pages/overflow_debugger.py").run()
    assert not at.exception and not at.error
    assert at.title[0].value == "Overflow debugger"
    assert at.selectbox(key="dbg_run").value == stored_run


def test_an_attached_run_is_followed_live_with_its_skips_and_first_inf_named(fresh_store):
    """A Monitor script in its own process, an inf planted in its module "1" at steps 12 and 13 (step 12 is not
    watched by the layer watch: the failing step's own device flags name the module in step 12 itself) and an
    overflow in the fp16 backward at step 8."""
    proc = start_script(fresh_store, "--steps", "30", "--pause-at", "15", "--overflow-at", "8", "--plant-at", "12,13")
    try:
        paused = said(proc)
        at = _page()
        assert at.selectbox(key="dbg_run").value == paused["run_id"]
        assert any("live: redrawn every second (lane 0 16 steps" in c.value for c in at.caption)
        assert any("An attached run: a Monitor in `monitor_script.py` writes it" in c.value for c in at.caption)
        frames = _frames(at)
        assert frames["dbg_overview"]["skipped steps"].tolist() == [len(paused["skipped"])]
        assert {8, 12, 13} <= set(paused["skipped"])
        assert frames["dbg_skipped"]["step"].tolist() == paused["skipped"]  # every skipped step, as the loop saw it
        first = frames["dbg_first_nonfinite"]
        named = first[first["step"] == 12]
        assert named["module"].tolist() == ["1"] and named["phase"].tolist() == ["forward"]
        assert named["watched"].tolist() == [12] and named["after"].tolist() == ["inf"]
        assert any(e.value.startswith("first inf/NaN: 1 (forward output") for e in at.error)
        review = frames["dbg_review"]
        assert {8, 12, 13} <= set(review.loc[review["what"] == "skipped", "step"])  # the spike band's table
        assert _chart(at, "dbg_spike_chart")["data"]  # the loss against its spike band
        assert not [b for b in at.button if b.key == "dbg_replay"]  # its model lives in the script's process
        assert any("cannot be replayed here" in c.value for c in at.caption)
        go_on(proc)
        said(proc)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    at.run()
    assert not at.exception
    assert not any("live: redrawn" in c.value for c in at.caption)  # finished: drawn once, no timer
    assert "dbg_first_nonfinite" in _frames(at)


def test_a_bf16_jobs_failed_step_counts_its_applied_gradients_and_says_what_applied_means(fresh_store):
    """A user's bf16 loop (no GradScaler) whose module overflows from step 6: the step's NaN gradients were applied,
    and the page counts that step (measured because its loss was not finite, not left "not measured"), names the
    parameters, and says what "applied" means there (not the fp16 backward's NaN-from-overflow note)."""
    import torch
    from test_nonfinite import planted_loop

    from amp_core.views.debugger import APPLIED_UNSCALED, NAN_FROM_OVERFLOW

    run_id = planted_loop(fresh_store, torch.bfloat16, scaled=False, at=6, steps=10)
    at = _page()
    assert at.selectbox(key="dbg_run").value == run_id
    table = _frames(at)["dbg_skipped"]
    assert table["step"].tolist() == [6] and table["outcome"].tolist() == ["applied: no scaler to catch it"]
    assert "0.weight" in table["parameters"].iloc[0] and table["NaN"].iloc[0] > 0
    captions = [c.value for c in at.caption]
    assert APPLIED_UNSCALED in captions and NAN_FROM_OVERFLOW not in captions
