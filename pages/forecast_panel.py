"""The forecast's panels shared by Layer numerics and the Overflow debugger: each layer's headroom over steps with the
forecast's line and the predicted break, "was it forecast" for each failed step, and the button that races the fix a
forecast names from the lane's weights at the step it was told."""

from __future__ import annotations

import streamlit as st

from amp_core import fix_code
from amp_core.diagnostics import acted_forecast, forecast_fixes, recorded_fix_races, start_fix_race
from amp_core.probes import FORMAT_LIMITS
from amp_core.probes import HEADROOM_LIMITS as LIMITS
from amp_core.views import forecast as forecast_views
from amp_core.views import headroom as headroom_views
from amp_core.views.tables import content_widths, fit_widths
from pages.common import can_control, control_note, store_guarded


def headroom_panel(events, steps, lane: int, mode: str, tensor: str, key: str) -> None:
    """The lane's headroom chart for a format and limit picked here (the lane's own format first), and its line."""
    formats = list(dict.fromkeys([*forecast_views.shown_formats(mode), *FORMAT_LIMITS]))
    row = st.columns([3, 2])
    format_name = row[0].radio("Format", formats, horizontal=True, key=f"{key}_headroom_format")
    limit = row[1].radio("Limit", LIMITS, horizontal=True, key=f"{key}_headroom_limit",
                         format_func={"max": "largest value", "smallest normal": "smallest normal"}.get)
    st.plotly_chart(headroom_views.headroom_figure(events, steps, lane, mode, tensor, format_name, limit),
                    key=f"{key}_headroom_chart")
    told = forecast_views.lane_forecast_lines(events, {lane: mode})  # the Train page's line for the lane
    if told:
        st.warning(f"Forecast · {told[0].split(': ', 1)[1]}", icon=":material/trending_up:")
    else:
        headrooms = forecast_views.lane_headrooms(events)
        headroom = headrooms.get(lane)
        if headroom is not None:
            formats_shown = forecast_views.shown_formats(mode)
            st.caption(forecast_views.forecast_line(headroom.earliest(formats_shown), mode))
    st.caption("Headroom: log2(format max / abs max) bits to the largest value, log2(abs max / smallest normal) to "
               "the smallest normal. The forecast fits a robust (Theil–Sen) trend to each layer's last 16 samples and "
               "is told only when the trend is clear beyond the sampling noise (docs/forecast.md).")


def was_it_forecast_panel(steps, events, lane: int, key: str) -> None:
    """For each of the lane's failed steps: was it forecast, how many steps ahead (nothing for a lane that sampled no
    layers: there was nothing to forecast from)."""
    if not headroom_views.sampled(events, lane):
        return
    table = headroom_views.was_it_forecast(steps, events, lane)
    if table.empty:
        return
    seen = (table["forecast"] != "no").sum()
    st.markdown(f"**Was it forecast?** {seen} of {len(table)} failed steps had a forecast told before them")
    widths = fit_widths(content_widths(table, max_px=2000), "layer")  # the one column that may run long
    helps = {"told at": "The step the forecast was first told (its first warning)",
             "steps ahead": "How many steps before the failure it was told",
             "interval": "The forecast's interval for the step the limit is reached"}
    st.dataframe(table, hide_index=True, key=f"{key}_was_forecast", column_config={
        column: st.column_config.Column(width=width, help=helps.get(column)) for column, width in widths.items()})


def fix_race_panel(manager, run_id: str, lane: int, mode: str, key: str) -> None:
    """For a lane with a forecast (nothing otherwise): the fixes it names, a button that races them from the
    forecast's step (off the page's thread), and the newest race recorded."""
    found = acted_forecast(manager.events(run_id), lane)
    if found is None:  # nothing to act on (a lane without sampled layers, or with no clear trend)
        return
    st.subheader("Act on the forecast: race the fix it names")
    told_at, data = found
    fixes = forecast_fixes(mode, data)
    st.markdown(f"The forecast told at step {told_at} names {data['module']}: "
                + "; ".join(f"`{recipe}` ({why})" for recipe, why in fixes) + ".")
    jobs = st.session_state.setdefault("fix_race_jobs", {})
    if not can_control():  # a visitor of a shared server: a race trains on the presenter's CPU
        control_note()
    elif st.button("Race the fix from the forecast's step", key=f"{key}_fix_race", type="primary",
                   help=f"From lane {lane}'s weights at step {told_at + 1}: {mode} as it is, "
                        + ", ".join(recipe for recipe, _ in fixes) + " and 32-true on the same batches, past the "
                        "forecast's interval: does the break come, and does the fix avoid it?"):
        jobs[(run_id, lane)] = start_fix_race(manager, run_id, lane)
    _race_progress(manager, run_id, lane, key)


@st.fragment(run_every=1.0)
@store_guarded
def _race_progress(manager, run_id: str, lane: int, key: str) -> None:
    job = st.session_state.get("fix_race_jobs", {}).get((run_id, lane))
    if job is not None and not job.done:
        st.info(f"Racing the fix for lane {lane} of run {run_id} … (from the forecast's step, past its interval)")
        return
    if job is not None and job.error:
        st.error(f"Cannot race the fix: {job.error}")
        return
    races = recorded_fix_races(manager.events(run_id), lane)
    race = job.race if job is not None and job.race is not None else (races[-1] if races else None)
    if race is None:
        return
    (st.success if race.verdict == "avoided" else st.warning)(race.line())
    table = headroom_views.fix_race_frame(race)
    widths = fit_widths(content_widths(table, max_px=2000), "what it changes")  # a cut cell shows whole on click
    st.dataframe(table, hide_index=True, key=f"{key}_fix_race_table", column_config={
        **{column: st.column_config.Column(width=width) for column, width in widths.items()},
        "last finite loss": st.column_config.NumberColumn(format="%.4g", width=widths["last finite loss"])})
    st.caption(f"From: {race.source}. {race.seconds:.1f} s." + "".join(f" {note}." for note in race.notes))
    kept = f"{race.recipe}+keep:{race.forecast['module']}"
    held = race.lane_of(kept)
    if race.verdict == "avoided" and held is not None and held.broke_at is None:
        st.markdown(f"**The fix for your own job** (keep `{race.forecast['module']}` in fp32):")
        code = fix_code([race.forecast["module"]], race.recipe).splitlines()
        code[0] = f"# Keep 1 module in fp32 (named by the forecast on {race.recipe}, raced by amp-lab)"
        st.code("\n".join(code), language="python")
