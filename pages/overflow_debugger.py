"""Overflow debugger page: which parameters overflowed and when, the scale's story, and what silently underflows."""

import streamlit as st

from amp_core.config import FAULT_KINDS, RUN_DEFAULTS, ConfigError, RunConfig, field_docs
from amp_core.diagnostics import recorded_replays, replay_run
from amp_core.precision import MODE_HELP, resolve_device, runnable_modes, uses_scaler
from amp_core.probes import SpikeRule, faults
from amp_core.runs import is_live
from amp_core.views import debugger
from amp_core.views import replay as replay_views
from amp_core.views.tables import content_widths, fit_widths
from amp_core.workloads import WORKLOADS, param_names
from pages.bisect_panel import bisect_panel
from pages.common import (
    LIVE_MARK,
    app_frame,
    can_control,
    control_note,
    first_nonfinite_list,
    fresh_selectbox,
    get_manager,
    run_picker,
    store_guarded,
)
from pages.forecast_panel import fix_race_panel, was_it_forecast_panel

DEMO_WORKLOADS = ("digits_mlp", "mlp_regression")
FAULT_HELP = {
    "loss_scale": "loss x factor for a few steps (a loss spike): fp16's scaled gradients overflow",
    "grad_inf": "inf into one element of a parameter's gradient",
    "grad_nan": "NaN into one element of a parameter's gradient",
    "lr_scale": "LR x factor for a few steps",
    "init_scale": "GradScaler starts at scale = factor (e.g. 2^24: the first steps overflow)",
    "batch_outlier": "the batch's inputs (and value targets) x factor for a few steps: a data outlier",
}
# What the fault picker shows (its box holds ~50 characters at 1440 px); FAULT_HELP is said under it in full.
FAULT_SHORT = {"loss_scale": "a loss spike (loss x factor)", "grad_inf": "inf in one gradient element",
               "grad_nan": "NaN in one gradient element", "lr_scale": "an LR spike (LR x factor)",
               "init_scale": "a bad initial scale", "batch_outlier": "a data outlier (inputs x factor)"}
PERCENT = st.column_config.NumberColumn(format="%.4f%%")
# The lane overview's longest header, shortened (the help says it in full): nine columns fit a 1440-px window.
OVERVIEW_LABELS = {"steps with inf/NaN applied": "inf/NaN applied"}
OVERVIEW_HELP = {
    "skipped steps": "Steps the GradScaler skipped: inf/NaN in the scaled gradients",
    "steps with inf/NaN applied": "Steps whose inf/NaN gradients the optimizer applied (a lane with no GradScaler to "
                                  "catch them)",
    "scale now": "The GradScaler's scale after the last step", "scale min": "Its lowest scale so far",
    "scale max": "Its highest scale so far"}
LR_SCHEDULER_NOTE = (
    "**Why the LR scheduler waits too.** On a skipped step `scaler.step(optimizer)` does not call "
    "`optimizer.step()`. A loop that calls `scheduler.step()` anyway moves the schedule past a step that never "
    "happened; on the very first step (often skipped while the scaler finds its scale) PyTorch warns *Detected call "
    "of `lr_scheduler.step()` before `optimizer.step()`*, the warning users meet with OneCycleLR and GradScaler. "
    "AMP Lab steps the scheduler only when the optimizer stepped, so the LR holds still across skipped steps. In "
    "your own loop: remember `scale = scaler.get_scale()` before `scaler.update()` and call `scheduler.step()` only "
    "if the scale did not drop.")

manager = get_manager()


@st.cache_data(show_spinner=False)
def parameter_names(workload: str) -> list[str]:
    return param_names(workload)


app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
st.title("Overflow debugger")
st.caption("Which parameters overflowed, and when; how the GradScaler's scale backs off and grows back; and what "
           "GradScaler cannot see: gradients that silently underflow to zero.")

# ---- fault injection ------------------------------------------------------------------------------------
# Open by default: a newcomer finds the demo here whether or not runs exist (collapse it to give the run room).
if not can_control():  # a visitor of a shared server: faults are planted by the presenter only
    control_note()
else:
    with st.expander("Fault injection: launch a demo run with a loss spike, an inf/NaN gradient or a bad scale",
                     expanded=True, icon=":material/syringe:"):
        st.markdown("Launch a short run with a fault on purpose. The default, the same loss spike in a `16-mixed` "
                    "and a `bf16-mixed` lane, shows the difference live: fp16's scaled gradients overflow, the "
                    "scaler skips those steps and halves its scale, then grows it back; bf16 skips nothing.")
        top = st.columns(2)
        workload = top[0].selectbox("Workload", list(WORKLOADS), index=list(WORKLOADS).index(DEMO_WORKLOADS[0]),
                                    format_func=lambda name: WORKLOADS[name].title, key="dbg_workload",
                                    help="digits_mlp: 300 steps take a few seconds on a laptop CPU, and its scale "
                                         "never overflows on its own, so every skip is the fault's.")
        kind = top[1].selectbox("Fault", FAULT_KINDS, format_func=lambda k: f"{k}: {FAULT_SHORT[k]}", key="dbg_kind",
                                help="\n\n".join(f"**{k}**: {FAULT_HELP[k]}" for k in FAULT_KINDS))
        top[1].caption(f"`{kind}`: {FAULT_HELP[kind]}.")
        device = resolve_device("auto")
        runnable = runnable_modes(device)
        with st.form("dbg_fault_form"):
            modes = st.multiselect("Modes (one lane each)", runnable,
                                   default=[m for m in ("16-mixed", "bf16-mixed") if m in runnable], key="dbg_modes",
                                   help="\n\n".join(f"**{m}**: {MODE_HELP[m]}" for m in runnable))
            row = st.columns(4)
            if kind == "init_scale":
                step, duration = 0, 1
                row[0].caption("init_scale acts from the first step")
            else:
                step = row[0].number_input("At step", min_value=0, value=50, step=1, key="dbg_step")
                duration = row[1].number_input("For steps", min_value=1, value=3, step=1, key="dbg_duration",
                                               help="A 10-step spike halves the scale 10 times: with the growth "
                                                    "interval below it needs 10 x 50 steps to climb back.")
            factor, param = 1.0, ""
            if kind in ("loss_scale", "lr_scale", "init_scale", "batch_outlier"):
                factor = row[2].number_input("Factor" if kind != "init_scale" else "Initial scale",
                                             value=1e6 if kind == "loss_scale" else 2.0**24 if kind == "init_scale"
                                             else 30.0 if kind == "batch_outlier" else 10.0, format="%g",
                                             key="dbg_factor")
            else:
                param = row[2].selectbox("Parameter", parameter_names(workload), key="dbg_param",
                                         help="The gradient that gets the inf/NaN (its first element).")
            steps = row[3].number_input("Steps", min_value=1, max_value=100_000, value=RUN_DEFAULTS.steps,
                                        step=50, key="dbg_steps", help=field_docs(RunConfig)["steps"])
            growth_interval = st.number_input(
                "GradScaler growth interval (clean steps before the scale doubles)", min_value=1,
                value=faults.DEMO_GROWTH_INTERVAL, step=10, key="dbg_growth",
                help="PyTorch's default is 2000: after a backoff the scale would take thousands of steps to "
                     "climb back, longer than this demo runs. 50 makes the recovery visible.")
            launched = st.form_submit_button("Launch demo run", type="primary")
        if launched:
            try:
                config = faults.demo_config(workload=workload, modes=tuple(modes), kind=kind, step=int(step),
                                              duration=int(duration), factor=float(factor), param=param,
                                              steps=int(steps), growth_interval=int(growth_interval))
                run = manager.launch(config)
            except ConfigError as error:
                st.error(f"Cannot launch the demo: **{error.field}**: {error.why}")
            else:
                st.session_state["dbg_run"] = run.run_id  # the picker below opens on the new run
                st.success(f"Launched {run.run_id}: {config.name}")

# ---- run and lane ---------------------------------------------------------------------------------------
run_id = run_picker(manager, key="dbg_run", label="Run (live or finished)")
if run_id is None:
    st.info("No runs yet: launch a demo above, or train one on the Train page.")
    st.stop()
info = manager.run_info(run_id)
if info is None:
    st.warning(f"Run {run_id} is no longer available (it left the store).")
    st.stop()
lanes = {lane.lane: lane for lane in info.lanes}
lane_ids = list(lanes)
lane = fresh_selectbox("Lane", lane_ids, {i: f"lane {i} · {lanes[i].mode} · {lanes[i].status}" for i in lane_ids},
                       f"dbg_lane_{run_id}", index=lane_ids.index(debugger.default_lane(info.lanes)))
mode = lanes[lane].mode
live = is_live(info)  # training here, or written by another process (the CLI, a Monitor script, torchrun)
attached = info.attached  # a Monitor or a trainer callback in the user's own process
if attached:
    st.caption(f"An attached run: {info.writer} writes it. Its skipped steps and scale are its own "
               "GradScaler's; after a failed step its layer hooks name the first module whose output (or gradient) "
               "held inf/NaN. Its model lives in that process: fault injection and replay need a run AMP Lab trains.")


def draw_run(run_id: str, lane: int, mode: str, was_live: bool) -> None:
    """The part that moves while a run trains: lane overview, fault effects, scale timeline, skipped steps, the first
    inf/NaN modules an attached run named."""
    info = manager.run_info(run_id)
    steps, events = manager.steps(run_id), manager.events(run_id)
    try:
        windows = debugger.fault_windows(info.config, mode)
        effects = debugger.fault_effects(steps, info.config, info.lanes)
    except ConfigError as error:
        st.warning(f"This run's fault plan cannot be read ({error}); faults are not shown.")
        windows = effects = None
    overview = debugger.lane_overview(steps, events, info.lanes)
    widths = content_widths(overview, OVERVIEW_LABELS)
    st.dataframe(overview, hide_index=True, key="dbg_overview", column_config={
        column: st.column_config.Column(OVERVIEW_LABELS.get(column, column), width=width,
                                        help=OVERVIEW_HELP.get(column)) for column, width in widths.items()})
    if effects is not None and not effects.empty:
        st.markdown("**What the fault did**")
        for row in effects.itertuples(index=False):
            st.markdown(f"- lane {row.lane} `{row.mode}` · {row.fault}: {row.outcome}")
    st.plotly_chart(debugger.scale_timeline_figure(steps, events, lane, mode, windows), key="dbg_timeline")
    scheduler_note = st.container() if info.settings.scheduler != "none" else st.expander(
        "LR schedulers and skipped steps (this run has no scheduler)")
    scheduler_note.markdown(LR_SCHEDULER_NOTE)
    table = debugger.skipped_steps_table(events, lane)
    st.markdown(f"**Steps with inf/NaN gradients, lane {lane} ({mode})**: {len(table)}")
    if table.empty:
        st.caption("None so far." if uses_scaler(mode) else
                   f"{mode} has no GradScaler: an inf/NaN gradient here would be applied, not skipped.")
    else:
        # The parameters (the one column that may run long) get the rest of the row; a cut cell shows whole on click.
        widths = fit_widths(content_widths(table, max_px=2000), "parameters")
        st.dataframe(table, hide_index=True, key="dbg_skipped", column_config={
            **{column: st.column_config.Column(width=width) for column, width in widths.items()},
            "inf": st.column_config.NumberColumn(width=widths["inf"], help="Elements of the parameters' gradients "
                                                                           "that are ±inf (after unscaling)"),
            "NaN": st.column_config.NumberColumn(width=widths["NaN"], help="Elements of the parameters' gradients "
                                                                           "that are NaN (after unscaling)")})
        if not uses_scaler(mode):
            st.caption(debugger.APPLIED_UNSCALED)
        elif table["NaN"].sum() > table["inf"].sum():
            st.caption(debugger.NAN_FROM_OVERFLOW)
    was_it_forecast_panel(steps, events, lane, "dbg")
    if not first_nonfinite_list(events, "dbg_first_nonfinite", lane) and attached:
        st.caption("No first inf/NaN named so far: after a failed step the run's layer hooks name the first module "
                   "whose output (or, failing that, gradient) held inf/NaN.")
    if was_live and not is_live(info):
        st.rerun()  # the run just ended: redraw the whole page once, statically, with its last statistics


if live:
    total = info.settings.steps  # 0: unknown (a Monitor's loop that did not say)
    progress = ", ".join(f"lane {i} {lane_info.steps_done}" + (f"/{total}" if total else " steps")
                         for i, lane_info in lanes.items())
    st.caption(f"{LIVE_MARK} live: redrawn every second ({progress} at page load)")
    st.fragment(run_every=1.0)(store_guarded(draw_run))(run_id, lane, mode, True)
else:
    draw_run(run_id, lane, mode, False)


def show_replay(replayed) -> None:
    """A replay's verdict, table, first inf/NaN modules and where it came from."""
    verdict = replayed.verdict
    st.markdown(f"### Replay of step {replayed.step} · verdict: {verdict.kind}")
    st.markdown(f"**Lane {replayed.lane} ({replayed.mode})** — {verdict.why}")
    replay_table = replay_views.replay_frame(replayed)
    replay_widths = content_widths(replay_table, max_px=132)
    st.dataframe(replay_table, hide_index=True, key="dbg_replay_table", placeholder="NaN", column_config={
        **{column: st.column_config.Column(width=width) for column, width in replay_widths.items()},
        "loss": st.column_config.NumberColumn(format="%.6g", width=replay_widths["loss"]),
        "what broke": st.column_config.Column(width=replay_widths["what broke"],
                                              help="band: the loss is above the band; loss: the loss is inf/NaN; "
                                                   "inf/NaN: in the gradients; skip: the GradScaler skipped the step"),
        "scale": st.column_config.Column(width=replay_widths["scale"], help="The GradScaler's scale, before → after"),
        "update vs fp32": st.column_config.Column(width=replay_widths["update vs fp32"],
                                                  help="×: this update's norm over fp32's (0: no step); cos: the "
                                                       "cosine between the two updates")})
    st.caption("▶ the lane's own mode · ref: the references every mode is judged against.")
    for row in replayed.rows:
        if row.first_nonfinite_why:
            st.caption(f"**{row.mode}** · first inf/NaN in `{row.first_nonfinite}`: {row.first_nonfinite_why}")
    st.caption(f"From: {replayed.source} (steps {replayed.start_step}-{replayed.step}, "
               f"{replayed.replay_s:.2f} s). {replay_views.sentence(replayed.reproduction_line())}"
               + "".join(f" {replay_views.sentence(note)}" for note in replayed.notes))



def replay_panel(run_id: str, lane: int, steps_done: int, review, spike_rule: SpikeRule, recorded) -> None:
    """The step picker, the Replay button and the last replay's verdict and table (runs AMP Lab trains); replays
    recorded in the run earlier show when none was asked here."""
    last_step = max(steps_done - 1, 0)
    replay_row = st.columns([2, 1, 3])
    replay_step_value = replay_row[0].number_input(
        "Step to replay", min_value=0, max_value=last_step,
        value=min(replay_views.first_to_replay(review, last_step), last_step), step=1,
        key=f"dbg_replay_step_{run_id}_{lane}",
        help="Opens on the lane's first spike, else its first skipped step or non-finite loss (a scaler's first steps "
             "often skip while it finds its scale).")
    if not can_control():  # a replay trains copies on the presenter's machine and records its verdict in the run
        with replay_row[2]:
            control_note()
    elif replay_row[1].button("Replay", key="dbg_replay", type="primary"):
        with st.spinner(f"Replaying step {replay_step_value} of lane {lane} in every mode ..."):
            try:
                st.session_state["dbg_replay_report"] = replay_run(manager, run_id, lane, int(replay_step_value),
                                                                   spike_rule, record=True)
            except ConfigError as error:
                st.session_state["dbg_replay_report"] = f"Cannot replay: **{error.field}**: {error.why}"
    replayed = st.session_state.get("dbg_replay_report")
    if isinstance(replayed, str):
        st.error(replayed)
    elif replayed is not None and (replayed.run_id, replayed.lane) == (run_id, lane):
        show_replay(replayed)
    elif recorded:
        st.caption(f"Replayed earlier (recorded in the run): {len(recorded)} step(s); the latest:")
        show_replay(recorded[-1])


# ---- replay: precision or data? -----------------------------------------------------------------------------
st.subheader("Replay a step: precision or data?")
st.caption("A step is replayed from the lane's weights before it, once in every mode of the run and in fp32 and "
           "float64, each on its own copy, away from the training: *precision* when fp32 is finite and in the loss "
           "band and only narrower formats break, *data* when fp32 breaks too, *unclear* when no mode breaks. "
           + ("An attached run replays its own failed steps (skipped, a non-finite loss, a loss above the band) in "
              "its process, right after the step, from a copy of its state from before the step (see its setting "
              "below); it cannot be replayed here: its model and data live in that process."
              if attached else "A run this server holds replays from its snapshots; a stored run is re-trained from "
                               "its seed to the step."))
if attached:
    replay_setting = info.settings.replay
    st.caption(replay_views.sentence(replay_setting.get("why", "this Monitor recorded no replay setting (it predates "
                                                                "replays)")))
default_rule = SpikeRule()
with st.expander(f"Spike band: median + {default_rule.k:g}·MAD over {default_rule.window} steps (change)"):
    band_row = st.columns(2)
    band_window = band_row[0].number_input("Window (steps before the step)", min_value=2, max_value=100_000,
                                           value=default_rule.window, step=10, key="dbg_spike_window")
    band_k = band_row[1].number_input("k (MADs above the median)", min_value=0.5, max_value=1000.0,
                                      value=default_rule.k, step=0.5, key="dbg_spike_k")
spike_rule = SpikeRule(window=int(band_window), k=float(band_k),
                       min_history=min(default_rule.min_history, int(band_window)))
st.session_state["spike_rule"] = spike_rule  # the Train page's loss chart marks spikes by the same band
lane_steps_now = manager.steps(run_id)
review = replay_views.steps_to_review(lane_steps_now, lane, spike_rule)
st.plotly_chart(replay_views.spike_loss_figure(lane_steps_now, lane, mode, spike_rule), key="dbg_spike_chart")
st.caption(f"Spike band: {spike_rule.describe()}.")
if review.empty:
    st.caption("No skipped step, non-finite loss or spike in this lane so far"
               + ("." if attached else "; any step can still be replayed."))
else:
    st.dataframe(review, hide_index=True, key="dbg_review",
                 column_config={"loss": st.column_config.NumberColumn(format="%.4g"),
                                "band ≤": st.column_config.NumberColumn(format="%.4g")})
recorded = recorded_replays(manager.events(run_id), lane)


if attached:
    if recorded:
        chosen_replay = st.selectbox("Replayed step", range(len(recorded)), index=len(recorded) - 1,
                                     format_func=lambda i: f"step {recorded[i].step} · {recorded[i].verdict.kind}",
                                     key=f"dbg_attached_replay_{run_id}")
        show_replay(recorded[chosen_replay])
    else:
        st.info("No step of this run has been replayed"
                + (" so far." if live else ".") + (" Replays are off for it (see above)."
                                                   if not info.settings.replay.get("on") else ""))
else:
    replay_panel(run_id, lane, lanes[lane].steps_done, review, spike_rule, recorded)
    fix_race_panel(manager, run_id, lane, mode, "dbg")
    st.subheader("Keep layers in fp32: find the smallest set that fixes it, and its price")
    bisect_panel(manager, run_id, lane, "dbg")

# ---- gradient histogram ---------------------------------------------------------------------------------
st.subheader("Gradient magnitudes against fp16 and bf16")
stat_steps = manager.grad_stat_steps(run_id, lane)
if not stat_steps:
    every = info.settings.gradstats_every
    st.info(f"No gradient statistics for lane {lane} yet: they are sampled every {every} steps and on every "
            "skipped step." if every else "This run was launched with gradient statistics off (gradstats_every 0).")
    st.stop()
lane_steps = manager.steps(run_id)
labels = debugger.stat_step_labels(stat_steps, lane_steps, lane)
pick = st.columns(2)
opening = debugger.default_stat_step(stat_steps, lane_steps, lane)  # the first skipped step, if any
chosen_step = pick[0].selectbox("Step", stat_steps, index=stat_steps.index(opening), format_func=labels.get,
                                key=f"dbg_stat_step_{run_id}_{lane}",
                                help="Sampled every few steps and on every skipped step; opens on the first skipped "
                                     "one.")
step_stats = manager.grad_stats(run_id, lane, chosen_step)
chosen_param = pick[1].selectbox("Parameter", ["(all)"] + [s.param for s in step_stats],
                                 key=f"dbg_stat_param_{run_id}_{lane}")
stats = debugger.stats_for(step_stats, chosen_param)
if stats is None:
    st.warning(f"No statistics for {chosen_param} at step {chosen_step}.")
    st.stop()
st.plotly_chart(debugger.gradient_histogram_figure(stats, mode, f"{chosen_param}, step {chosen_step} ({mode})"),
                key="dbg_histogram")
st.caption(
    "Bars: the unscaled gradient (after `unscale_`) counted by floor(log2|g|); for a scaled lane the hatched bars "
    "are the same values times the scale, where the fp16 backward held them. Strips: the formats' nominal ranges. "
    "Strictly, rounding moves the edges by half a unit: fp16 turns |g| <= 2^-25 into 0 (values between 2^-25 "
    "and 2^-24 round up to 2^-24) and |g| >= 65520 into inf; bf16 turns |g| <= 2^-134 into 0. bf16's overflow "
    "starts near 2^128, far off this chart. The end bins are clamped (2^-140 holds everything smaller, 2^20 "
    "everything larger).")
counts = debugger.special_counts(stats)
cards = st.columns(5)
for column, (label, value) in zip(cards, counts.items(), strict=True):
    column.metric(label, f"{value:,}")
if stats.inf or stats.nan:
    st.caption(f"{stats.inf + stats.nan:,} of {stats.numel:,} elements are inf or NaN at this step: the bars show only "
               "the finite rest. " + debugger.NAN_FROM_OVERFLOW.removeprefix("Why NaN rather than inf? "))
st.markdown("**Share of the finite non-zero gradient each format loses** (from real casts, not thresholds). "
            "GradScaler sees only inf/NaN: a gradient that becomes 0 or loses bits as a subnormal trains "
            "silently wrong. Scaling moves the whole histogram right, out of the underflow zone.")
fractions = debugger.fractions_frame(stats)
value_columns = list(debugger.FRACTION_COLUMNS)
fractions[value_columns] = fractions[value_columns] * 100
st.dataframe(fractions, hide_index=True, key="dbg_fractions", placeholder="— (nothing finite)", column_config={
    "gradient": st.column_config.Column(help="unscaled: the gradient after `unscale_`; x scale: the same values times "
                                             "the scale, as the fp16 backward held them"),
    **dict.fromkeys(value_columns, PERCENT)})
if stats.lost_update_fraction is not None:
    st.metric("Updates lost to rounding", f"{stats.lost_update_fraction:.2%}",
              help="Of the elements with a finite non-zero gradient: the share whose weight did not change "
                   "this step because the update was smaller than half the spacing of the weight's format "
                   "(16-true and bf16-true with a small LR).")
