"""The *Find a plan* panel of Layer numerics: the plan search (amp_core.diagnostics.plan_search) for the workload
above, off the page's thread, with its progress, a Stop button and the report (the plan, every trial, the final race,
FLOP shares, the *modelled* price and the plan as code)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import streamlit as st

from amp_core.config import ConfigError
from amp_core.diagnostics import PLAN_LADDER as LADDER
from amp_core.diagnostics import PlanJob, PlanSearchConfig
from amp_core.views.plan import plan_text
from pages.common import can_control, control_note, get_manager

# The targets offered: bf16-mixed with each matmul format the ladder knows how to promote.
TARGETS = tuple(f"bf16-mixed+{name}" for name in LADDER if name not in ("bf16", "fp16"))


def plan_panel(workload: str, size: str, device: str, key: str) -> None:
    """For `workload` at `size`: the target, the budget, the button, then the job's progress or report."""
    st.subheader("Find a plan: the cheapest format per layer that still trains like bf16-mixed")
    st.caption("Every Linear starts in the target's format; the layers the table above says hurt most are promoted "
               "(NVFP4 -> MXFP8 -> bf16) until a seeded race trains within seed noise of bf16-mixed, then each is "
               "demoted back where the race still passes. Each trial is a race of 3 seeds: minutes, on a thread of "
               "its own.")
    jobs = st.session_state.setdefault("plan_jobs", {})
    if not can_control():  # a visitor of a shared server: the races would train on the presenter's CPU
        control_note()
        return
    row = st.columns([2, 1, 1])
    target = row[0].selectbox("Target recipe", TARGETS, key=f"{key}_plan_target")
    budget = row[1].number_input("Budget (min)", min_value=1.0, max_value=120.0, value=10.0, step=1.0,
                                 key=f"{key}_plan_budget")
    if row[2].button("Find a plan", key=f"{key}_plan_go", type="primary"):
        folder = Path(tempfile.gettempdir()) / "amp-lab-plans"
        config = PlanSearchConfig(workload=workload, size=size, target=target, budget_s=float(budget) * 60,
                                  device=device, plan_path=str(folder / f"plan-{workload}-{size}-{target}.toml"))
        try:
            jobs[key] = PlanJob(config, get_manager().store)
        except ConfigError as error:
            st.error(f"Cannot search: **{error.field}**: {error.why}")
    _plan_progress(key)


@st.fragment(run_every=1.0)
def _plan_progress(key: str) -> None:
    job = st.session_state.get("plan_jobs", {}).get(key)
    if job is None:
        return
    if not job.done:
        seconds, message, fraction = job.progress[-1] if job.progress else (0.0, "starting", 0.0)
        st.progress(min(max(fraction, 0.0), 1.0), text=f"{message} ({seconds:.0f} s)")
        if st.button("Stop", key=f"{key}_plan_stop"):
            job.stop()
        return
    if job.error:
        st.error(f"No plan: {job.error}")
        return
    report = job.report
    (st.success if report.found else st.warning)(f"{'Found' if report.found else 'Not found'}: {report.why}")
    st.code(plan_text(report), language="text")
