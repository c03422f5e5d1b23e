"""Workshop page: guided scenarios. One click launches a prepared race, the page says what to watch, draws the run
live, and checks from the run's own records whether the point showed on this device. A presenter view makes it
readable from the back of a room."""

from __future__ import annotations

import streamlit as st

from amp_core import missing_extras, needs_line
from amp_core.config import ConfigError
from amp_core.views import plots
from amp_core.views import workshop as views
from amp_core.views.live import RecordFollower
from amp_core.views.summary import lanes
from amp_core.workshop import SCENARIOS, ScenarioLaunch, Waiting, evaluate, headline
from pages.common import (
    PRESENTER_KEY,
    app_frame,
    can_control,
    control_note,
    get_manager,
    presenter_on,
    presenter_style,
    store_guarded,
)

REFRESH_S = 1.0  # the live part's redraw period while a scenario's runs go
CARDS_PER_ROW = 3
FOLLOW_S = 2.0  # how often a visitor's page looks whether the presenter launched another scenario

app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
manager = get_manager()
presenter = st.toggle("Presenter view", value=presenter_on(), key="workshop_presenter",
                      help="Large fonts, one column, fewer controls, charts sized for a 1280×720 projector. It stays "
                           "on while you move between pages.")
st.session_state[PRESENTER_KEY] = presenter
if presenter:
    presenter_style()
st.title("Workshop")
controlling = can_control()  # a visitor of a shared server follows the presenter's scenario and launches none


@st.cache_resource(show_spinner=False)
def presented() -> dict[str, ScenarioLaunch]:
    """The scenario this server's presenter launched last (under "latest"), for the visitors' pages to follow."""
    return {}


def launch(name: str) -> None:
    if not can_control():  # (the buttons are not drawn for a visitor; this keeps a callback from ever launching)
        return
    st.session_state["workshop_pick"] = name  # the presenter view's picker shows what runs
    try:
        st.session_state["workshop_launch"] = presented()["latest"] = ScenarioLaunch(manager, SCENARIOS[name])
    except ConfigError as error:
        st.session_state["workshop_error"] = f"**{error.field}** — {error.why}. Nothing was launched."
    else:
        st.session_state.pop("workshop_error", None)


# --- the scenarios ------------------------------------------------------------------------------------------------
if not controlling:
    control_note()
    st.caption("The presenter's latest scenario is drawn below as it runs, and checked from its own records; each "
               "of its runs is on every page (Train, Compare) too.")
elif presenter:  # fewer controls: one picker and one button
    picked_col, button_col = st.columns([4, 1], vertical_alignment="bottom")
    picked_col.selectbox("Scenario", list(SCENARIOS), format_func=lambda n: SCENARIOS[n].title,
                                  key="workshop_pick")
    # The picker's value when the button is pressed (a change and a press can reach the server together).
    button_col.button("Launch", type="primary", key="workshop_launch_presenter", width="stretch",
                      on_click=lambda: launch(st.session_state["workshop_pick"]))
else:
    st.caption("Each scenario is a prepared race that makes one point. Launch one: the page says what to watch, draws "
               "the run live, and checks from the run's own records whether the point showed on this device. The "
               "run is an ordinary run: it is in the store and on every page.")
    names = list(SCENARIOS)
    for row_start in range(0, len(names), CARDS_PER_ROW):
        columns = st.columns(CARDS_PER_ROW)
        for column, name in zip(columns, names[row_start:row_start + CARDS_PER_ROW], strict=False):
            scenario = SCENARIOS[name]
            with column.container(border=True, height="stretch"):
                st.markdown(f"**{scenario.title}**")
                st.caption(scenario.watch)
                if scenario.extras:
                    st.caption(f"This scenario {needs_line(scenario.extras)}")
                st.button("Launch", key=f"workshop_launch_{name}", on_click=launch, args=(name,),
                          disabled=bool(missing_extras(scenario.extras)),
                          help=f"`amp-lab workshop run {name}` does the same from a terminal.")
if "workshop_error" in st.session_state:
    st.error(st.session_state["workshop_error"])

def shown(launch: ScenarioLaunch | None) -> ScenarioLaunch | None:
    """`launch`, or None where it was made through a RunManager this server has since replaced (its runs are in the
    store)."""
    return launch if launch is not None and launch.manager is manager else None


current = shown(st.session_state.get("workshop_launch") if controlling else presented().get("latest"))
if not controlling:
    @st.fragment(run_every=FOLLOW_S)
    @store_guarded
    def follow_presenter() -> None:
        """A visitor's page turns to the presenter's next scenario by itself (compared as `current` was made: a
        launch of a replaced manager against None once reran the page without end)."""
        if shown(presented().get("latest")) is not current:
            st.rerun(scope="app")

    follow_presenter()
if current is None:
    st.info("Pick a scenario and press Launch: its runs take a few seconds here." if controlling else
            "The presenter has not launched a scenario yet: it appears here, live, once they do.")
    st.stop()

scenario = current.scenario
st.divider()
st.header(scenario.title)
st.markdown(scenario.watch)
expected = scenario.expected_here(current.configs[0].device)
if expected:
    st.markdown(expected)
followers: dict[str, RecordFollower] = st.session_state.setdefault("workshop_followers", {})
live_at_start = current.going


def draw_charts(run_id: str) -> None:
    if run_id not in followers:
        followers[run_id] = RecordFollower(run_id)
    follower = followers[run_id]
    series = lanes(follower.update(manager))
    figures = plots.train_figures(series, bands=follower.bands)
    for chart in scenario.charts:
        figure = figures[chart]
        if chart == "loss":
            views.distinguish_lanes(figure)
        if presenter:
            views.presenter_figure(figure)
        st.plotly_chart(figure, key=f"workshop_chart_{run_id}_{chart}")


def draw_checks(results) -> None:
    st.subheader(headline(results))
    for result in results:
        st.markdown(views.check_markdown(result))


def draw_table(evidence) -> None:
    if scenario.table is None:
        return
    try:
        table = scenario.table(evidence)
    except Waiting as waiting:
        st.caption(f"{scenario.table_title}: waiting for {waiting}.")
        return
    st.markdown(f"**{scenario.table_title}**")
    if presenter:
        st.table(views.table_text(table))
    else:
        st.dataframe(views.table_text(table), hide_index=True, key="workshop_table")


@st.fragment(run_every=REFRESH_S if live_at_start else None)
@store_guarded
def live_view() -> None:
    evidence = current.evidence()
    results = evaluate(scenario, evidence)
    statuses = ", ".join(f"{part.config.size}: {part.info.status}" for part in evidence.parts)
    st.caption(f"Runs {', '.join(f'`{run_id}`' for run_id in current.run_ids)} · {statuses}"
               + (f" · run {len(evidence.parts) + 1} of {evidence.expected_parts} starts when this one ends"
                  if len(evidence.parts) < evidence.expected_parts else ""))
    if current.error:
        st.error(current.error)
    for part in evidence.parts:  # a lane that stopped early draws little or nothing: say so in words
        for lane in part.info.lanes:
            if lane.status in ("diverged", "failed"):
                st.warning(f"Lane **{lane.mode}** {lane.status}: {lane.error}")
    if presenter:  # one column: the story, then the checks
        for part in evidence.parts:
            if len(evidence.parts) > 1:
                st.markdown(f"**{part.config.size}**")
            draw_charts(part.run_id)
        st.info(scenario.caveat)
        draw_checks(results)
        draw_table(evidence)
    else:
        left, right = st.columns([3, 2])
        with left:
            for part in evidence.parts:
                if len(evidence.parts) > 1:
                    st.markdown(f"**{part.config.size}**")
                draw_charts(part.run_id)
        with right:
            st.info(scenario.caveat)
            draw_checks(results)
        draw_table(evidence)
    if live_at_start and not current.going:
        st.rerun()  # the runs ended: one full rerun draws the final checks and turns the timer off


live_view()
