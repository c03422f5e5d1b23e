"""The bisect panel shared by Layer numerics and the Overflow debugger: a button that runs the layer bisect off the
page's thread, the report (price line, trials, price race, the fix as code with a copy button) and a button that
races the fixed lane live."""

from __future__ import annotations

import streamlit as st

from amp_core import fix_code
from amp_core.config import ConfigError
from amp_core.diagnostics import fixed_race_config, recorded_bisects, start_bisect
from amp_core.views.bisect import price_frame, trials_frame
from pages.common import can_control, control_note, store_guarded


def bisect_panel(manager, run_id: str, lane: int, key: str) -> None:
    """For lane `lane` of run `run_id`: the Bisect button, the job's progress, and the newest report recorded."""
    jobs = st.session_state.setdefault("bisect_jobs", {})
    if not can_control():  # a visitor of a shared server: a bisect replays on the presenter's CPU
        control_note()
        _progress(manager, run_id, lane, key)
        return
    row = st.columns([1, 4])
    if row[0].button("Find the layers to keep", key=f"{key}_bisect", type="primary",
                     help="Replay the lane's failing step (or its divergence from the 32-true lane) with sets of "
                          "modules kept in fp32 and find the smallest set that fixes it, then race it"):
        jobs[(run_id, lane)] = start_bisect(manager, run_id, lane)
    row[1].caption("Searches the smallest set of modules that, kept in fp32 (`+keep:`), makes the failure go away: "
                   "each trial a replay on copies from the lane's snapshot, on a thread of its own.")
    _progress(manager, run_id, lane, key)


@st.fragment(run_every=1.0)
@store_guarded
def _progress(manager, run_id: str, lane: int, key: str) -> None:
    job = st.session_state.get("bisect_jobs", {}).get((run_id, lane))
    if job is not None and not job.done:
        st.info(f"Bisecting lane {lane} of run {run_id} … (each trial replays the failing steps)")
        return
    if job is not None and job.error:
        st.error(f"Cannot bisect: {job.error}")
        return
    reports = recorded_bisects(manager.events(run_id), lane)
    report = job.report if job is not None and job.report is not None else (reports[-1] if reports else None)
    if report is None:
        return
    show_bisect(manager, report, key)


def show_bisect(manager, report, key: str) -> None:
    """A bisect's report: the price line first, then the trials, the price race and the fix as code."""
    steps = f"step {report.first_step}" if report.first_step == report.last_step else \
        f"steps {report.first_step}-{report.last_step}"
    st.markdown(f"#### Bisect of lane {report.lane} ({report.recipe}) · {steps}")
    if report.verdict == "fixed":
        st.success(report.price_line())
    else:
        st.warning(report.price_line())
    st.caption(f"{len(report.trials)} trials in {report.seconds:.1f} s over {report.candidates} candidate modules. "
               f"From: {report.source}." + "".join(f" {note}." for note in report.notes))
    st.dataframe(trials_frame(report), hide_index=True, key=f"{key}_bisect_trials")
    if report.verdict != "fixed":
        return
    st.dataframe(price_frame(report), hide_index=True, key=f"{key}_bisect_price",
                 column_config={"loss": st.column_config.NumberColumn(format="%.4g")})
    st.markdown(f"**The fix for your own job** (keep {', '.join(f'`{name}`' for name in report.kept)} in fp32):")
    st.code(fix_code(report.kept, report.recipe), language="python")
    launched = st.session_state.setdefault("bisect_races", {})
    race_key = (report.run_id, report.lane, report.fixed_recipe)
    if not can_control():
        return
    if st.button("Race the fixed lane", key=f"{key}_bisect_race",
                 help=f"Launch {report.recipe}, {report.fixed_recipe} and 32-true with this run's settings"):
        info = manager.run_info(report.run_id)
        try:
            run = manager.launch(fixed_race_config(info.config, report))
        except ConfigError as error:
            launched[race_key] = f"Cannot launch: **{error.field}**: {error.why}"
        else:
            launched[race_key] = f"Launched {run.run_id}: {run.config.name} — follow it on the Train page"
    said = launched.get(race_key)  # kept: the panel redraws every second
    if said:
        (st.error if said.startswith("Cannot") else st.success)(said)
