"""Advise page: which precision to train this model in, here. The advisor (amp_core.diagnostics.advise) measures it
off the page's thread — cost probe, seeded race, stability, memory, largest batch — with its progress shown and a Stop
button; the page then shows the recommendation, every candidate with its verdict and figure, and the evidence runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import streamlit as st

from amp_core.config import ADVISE_BUDGET_S, ConfigError
from amp_core.diagnostics import AdviceJob, AdviseConfig
from amp_core.precision import BASELINE_MODE, recipe_candidates, resolve_device
from amp_core.views import advise as views
from amp_core.workloads import WORKLOADS
from pages.answered import answer_for, awaiting
from pages.common import app_frame, can_control, control_note, get_manager, store_guarded
from pages.plan_panel import plan_panel

REFRESH_S = 1.0  # the progress redraw period while the advisor measures
JOB_KEY = "advise_job"

app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
manager = get_manager()
st.title("Advise")
st.caption("Which precision should this model train in, on this device? The advisor probes every mode and recipe "
           "the device runs, races the promising ones against 32-true with seed replicates, checks their stability, "
           "memory and largest batch, and recommends the fastest that trains like fp32 within seed noise. Every "
           "figure is an ordinary run in the store (Compare shows it).")

names = sorted(WORKLOADS, key=lambda name: (WORKLOADS[name].title or name).lower())
device = resolve_device("auto")


def start() -> None:
    """The Advise button's callback: the job starts before the script reruns, so this run already follows it."""
    state = st.session_state
    try:
        state[JOB_KEY] = AdviceJob(AdviseConfig(
            workload=state["advise_workload"], size=state["advise_size"], budget_s=float(state["advise_budget"]) * 60,
            device=device, candidates=tuple(state["advise_candidates"]),
            plan_dir=str(Path(tempfile.gettempdir()) / "amp-lab-plans")), manager.store)
    except ConfigError as error:
        state["advise_error"] = f"**{error.field}** — {error.why}. Nothing was started."
    else:
        state.pop("advise_error", None)


job: AdviceJob | None = st.session_state.get(JOB_KEY)
busy = job is not None and not job.done
with st.container(border=True):
    c1, c2, c3 = st.columns([2, 1, 1])
    workload = c1.selectbox("Workload", names, format_func=lambda name: WORKLOADS[name].title or name,
                            index=names.index("tiny_transformer") if "tiny_transformer" in names else 0,
                            key="advise_workload")
    c2.selectbox("Size", list(WORKLOADS[workload].sizes) or ["small"], key="advise_size")
    c3.number_input("Budget (minutes)", value=ADVISE_BUDGET_S / 60, min_value=0.0, step=0.5, key="advise_budget",
                    help="How long it may measure; a phase that would overrun it is cut short or left out, and the "
                         "advice says so.")
    # Which recipes run here is asked off the page's thread: +compile's answer imports torch's compiler stack, which a
    # fresh server is still importing while a room opens its pages (the picker waits; Advise with none picked works).
    candidates = answer_for("advise_recipes", ("recipe_candidates", device), lambda: recipe_candidates(device))
    known = candidates.done.is_set() and candidates.error is None
    runnable = [recipe for recipe, ok, _ in candidates.value if ok and recipe != BASELINE_MODE] if known else []
    st.multiselect("Only these candidates (empty: every one this device runs)", runnable, key="advise_candidates",
                   disabled=not known)
    if not candidates.done.is_set():
        awaiting(candidates, "Checking which recipes this device runs…")
    elif candidates.error is not None:
        raise candidates.error
    if can_control():
        st.button("Advise", type="primary", key="advise_go", disabled=busy, on_click=start)
    else:  # a visitor of a shared server: the advice measures on the presenter's machine
        control_note()
if "advise_error" in st.session_state:
    st.error(st.session_state["advise_error"])
with st.expander("Find a plan for one recipe: a format per layer (the advice runs it for a failing matmul format)"):
    plan_panel(workload, st.session_state["advise_size"], device, "advise")
if job is None:
    st.info("Choose a workload and a budget, then press Advise.")
    st.stop()


def open_in_compare(run_ids: list[str]) -> None:
    st.session_state["cmp_runs"] = run_ids
    st.session_state.pop("cmp_lanes", None)
    st.session_state.pop("cmp_known_runs", None)


def draw_result(job: AdviceJob) -> None:
    if job.error:
        (st.warning if job.error.startswith("stopped") else st.error)(job.error)
    advice = job.advice
    if advice is None:
        return
    (st.success if advice.decided else st.warning)(f"**{advice.line()}**")
    for line in views.savings(advice):
        st.markdown(f"- {line}")
    # A static table: its cells wrap, so a long reason is read whole at 1440 px (a data grid clips it). What was
    # measured, the decision first; what was not (the budget, or refused here) counted in a line each. The layers to
    # keep are listed whole further down.
    st.table(views.advice_table(advice).drop(columns=["figure", "layers to keep"]).set_index("recipe"))
    for line in (*views.unmeasured_lines(advice), *views.budget_lines(advice)):
        st.caption(line)
    keep = views.keep_lines(advice)
    if keep:  # the bisect's and the plan search's answers for a candidate that failed, and their price
        st.markdown("**Layers to keep in fp32 or promote** (the layer bisect, from the failing step's snapshot; the "
                    "plan search, for a matmul format)\n"
                    + "\n".join(f"- {line}" for line in keep))
    with st.expander("The figure that decided each verdict"):
        st.markdown("\n".join(f"- {line}" for line in views.figure_lines(advice)))
    with st.expander("What could not be told here", expanded=True):
        st.markdown("\n".join(f"- {line}" for line in advice.cannot_tell))
    st.markdown("**Evidence** (ordinary runs in the store): " + " · ".join(f"`{line}`" for line in
                                                                            views.evidence_lines(advice)))
    evidence = advice.evidence
    left, right = st.columns(2)
    if left.button("Open the evidence in Compare", key="advise_compare"):
        open_in_compare([evidence.race_run, *evidence.probe_runs])
        st.switch_page("pages/compare.py")
    right.download_button("Advice · HTML report", lambda: views.advice_report_html(manager, advice),
                          file_name=f"amp_lab_advice_{evidence.workload}.html", mime="text/html",
                          key="advise_report")


@st.fragment(run_every=REFRESH_S if busy else None)
@store_guarded
def progress_view() -> None:
    if not job.done:
        message = job.progress[-1][1] if job.progress else "starting…"
        st.progress(min(job.fraction, 1.0), text=message)
        st.button("Stop", key="advise_stop", on_click=job.stop)
        if job.run_ids:
            st.caption("Runs so far: " + ", ".join(f"`{run_id}`" for run_id in job.run_ids))
    elif busy:
        st.rerun()  # it ended: one full rerun draws the result and turns the timer off
    with st.expander("Progress", expanded=not job.done):
        st.markdown("\n".join(f"- {seconds:5.1f} s · {message}" for seconds, message, _ in job.progress) or "…")


progress_view()
if job.done:
    draw_result(job)
