"""Train page: choose a workload and precision modes, see what each mode costs here, launch, watch the lanes live."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from amp_core.config import OPTIMIZERS, ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.precision import BASELINE_MODE, MODE_HELP, availability, default_modes, resolve_device, runnable_modes
from amp_core.probes.cost import SLOW_FACTOR, ProbeBoard, ProbeResult, estimate_step, relative_costs
from amp_core.records.store import LIVE_STATUSES
from amp_core.views import plots
from amp_core.views.live import RecordFollower, control_note, format_ratio, format_scale, progress
from amp_core.views.summary import LaneSeries, lanes, rank_table, summarize
from amp_core.workloads import WORKLOADS
from pages.common import STATUS_ICONS, get_manager, run_picker

REFRESH_S = 1.0
PROBE_STEPS = 5
PROBE_CAP_S = 2.0
DEFAULT_WORKLOAD = "digits_mlp"

manager = get_manager()
device = resolve_device("auto")
available = runnable_modes(device)


@st.cache_resource
def probe_board() -> ProbeBoard:
    """The server's cost probes (measured off the page's thread, remembered for the server's life)."""
    return ProbeBoard(steps=PROBE_STEPS, time_cap_s=PROBE_CAP_S)


st.title("Train")
st.caption("Every lane starts from the same weights and sees the same batches; one thread steps them in turn "
           "(A B C A B C …) so the machine's noise hits every lane alike.")

# --- the form: widgets -> one RunConfig --------------------------------------------------------------------------
with st.container(border=True):
    c1, c2, c3 = st.columns([2, 1, 3])
    workload = c1.selectbox("Workload", list(WORKLOADS), index=list(WORKLOADS).index(DEFAULT_WORKLOAD),
                            format_func=lambda name: WORKLOADS[name].title, key="train_workload")
    size = c2.selectbox("Size", list(WORKLOADS[workload].sizes), key="train_size",
                        help="small runs in seconds on a laptop CPU; xl is a size for a GPU")
    modes = c3.multiselect("Precision modes (one lane each)", available,
                           default=[m for m in default_modes(device) if m in available], key="train_modes",
                           help="\n\n".join(f"**{m}**: {MODE_HELP[m]}" for m in available))
    c1.caption(WORKLOADS[workload].description)
    c1, c2, c3, c4, c5, c6 = st.columns(6)
    steps = c1.number_input("Steps", value=300, step=50, key="train_steps")
    batch_size = c2.number_input("Batch size", value=64, step=16, key="train_batch")
    optimizer = c3.selectbox("Optimizer", OPTIMIZERS, key="train_optimizer")
    lr = c4.number_input("Learning rate", value=1e-3, step=1e-4, format="%.2e", key="train_lr",
                         help="The peak LR when OneCycleLR is on.")
    seed = c5.number_input("Seed", value=0, step=1, key="train_seed",
                           help="Seeds the initial weights and the batch order, the same in every lane.")
    onecycle = c6.toggle("OneCycleLR", key="train_onecycle")
    with st.expander("GradScaler settings (16-mixed only)"):
        g1, g2, g3, g4 = st.columns(4)
        init_scale = g1.number_input("Initial scale", value=2.0**16, format="%g", key="train_init_scale")
        growth_factor = g2.number_input("Growth factor", value=2.0, key="train_growth")
        backoff_factor = g3.number_input("Backoff factor", value=0.5, key="train_backoff")
        growth_interval = g4.number_input("Growth interval (steps)", value=2000, step=100, key="train_interval")
    with st.expander("More: Adam eps, fused Adam, gradient clipping, faults, name"):
        m0, m1, m2, m3 = st.columns([1, 1, 3, 2])
        eps = m0.number_input("Adam/AdamW eps", value=1e-8, format="%.1e", key="train_eps",
                              help="torch's default 1e-8 is 0 in fp16: a 16-true lane with Adam needs about 1e-4.")
        fused = m0.toggle("Fused Adam/AdamW", key="train_fused",
                          help="One fused kernel for the update, where the device has it; with a GradScaler the "
                               "optimizer skips an overflowed step on the device, and GradScaler.step needs no host "
                               "sync.")
        grad_clip = m1.number_input("Clip grad norm (0 = off)", value=0.0, key="train_clip")
        faults_text = m2.text_input("Faults to inject (demos)", key="train_faults", placeholder="loss_scale:1e6@50+10",
                                    help="Comma-separated `kind:arg@step+duration`, e.g. `loss_scale:1e6@50+10`, "
                                         "`grad_inf:fc1.weight@30`, `grad_nan@30`, `lr_scale:10@100+20`, "
                                         "`init_scale:1024`.")
        name = m3.text_input("Run name", key="train_name")

config: RunConfig | None = None
try:
    config = RunConfig(
        workload=workload, size=size, modes=tuple(modes), steps=int(steps), batch_size=int(batch_size),
        optimizer=optimizer, lr=float(lr), eps=float(eps), fused_optimizer=bool(fused),
        scheduler="onecycle" if onecycle else "none", seed=int(seed),
        grad_clip=float(grad_clip), name=name.strip(),
        scaler=ScalerConfig(init_scale=float(init_scale), growth_factor=float(growth_factor),
                            backoff_factor=float(backoff_factor), growth_interval=int(growth_interval)),
        faults=tuple(FaultSpec.parse(text) for text in faults_text.split(",") if text.strip()))
except ConfigError as error:
    st.error(f"**{error.field}** — {error.why}. Nothing was launched.")

# --- what each mode costs here, measured before launch -----------------------------------------------------------
def cost_table(costs: pd.DataFrame) -> None:
    table = pd.DataFrame({
        "mode": costs["mode"],
        "ms / step": costs["ms_per_step"].map(lambda v: f"{v:.3g}"),
        f"time vs {BASELINE_MODE}": costs["time_vs_baseline"].map(format_ratio),
        "steps timed": costs["steps_timed"].astype(str) + costs["capped"].map({True: " (capped)", False: ""}),
    })
    st.dataframe(table, hide_index=True, key="train_probe_table")
    for row in costs[costs["far_slower"]].itertuples():
        st.warning(f"**{row.mode}** takes {row.time_vs_baseline:.1f}× the time of {BASELINE_MODE} per step here "
                   f"({availability(row.mode, device)[1]}).")
    st.caption(f"Measured on this {device.upper()}: {PROBE_STEPS} steps per mode after a warm-up, at most "
               f"{PROBE_CAP_S:g} s a mode, remembered per workload, size, batch and mode. Above {SLOW_FACTOR:g}× "
               "is flagged. A run going at the same time shares the cores and skews these figures.")


@st.cache_data(show_spinner="Estimating what a step would take…")
def step_estimates(workload: str, size: str, batch_size: int, modes: tuple[str, ...], device: str) -> pd.DataFrame:
    """Per mode: an estimate of one step's time (counted FLOPs ÷ this device's measured matmul rate), or why not."""
    rows = []
    for mode in modes:
        try:
            estimate = estimate_step(workload, size, batch_size, mode, device)
        except (ConfigError, RuntimeError) as error:
            rows.append({"mode": mode, "estimated time / step": f"cannot estimate: {error}", "basis": ""})
            continue
        seconds = estimate.ms_per_step / 1e3
        rows.append({"mode": mode, "estimated time / step": f"≈ {seconds:.3g} s (estimate)" if seconds >= 1
                     else f"≈ {estimate.ms_per_step:.3g} ms (estimate)",
                     "basis": f"{estimate.flops_per_step / 1e9:,.0f} GFLOP ÷ {estimate.matmul_flops_per_s / 1e9:.3g} "
                              f"GFLOP/s ({estimate.compute_dtype} matmul)"})
    return pd.DataFrame(rows, columns=["mode", "estimated time / step", "basis"])


def probe_outcomes(config: RunConfig) -> dict[str, ProbeResult | str | None]:
    """Each mode's probe (32-true first, as the yardstick): a result, an error text, or None while measuring."""
    modes = [BASELINE_MODE] + [m for m in config.modes if m != BASELINE_MODE]
    board = probe_board()
    return {mode: board.get((config.workload, config.size, config.batch_size, mode, device)) for mode in modes}


if config is not None:
    probe_key = (config.workload, config.size, config.batch_size, device)
    asked = st.session_state.setdefault("train_probed", set())
    measuring = (config.size == "small" or probe_key in asked) and None in probe_outcomes(config).values()

    # The timer stays until the next full rerun (any widget, Launch). A st.rerun() from this fragment once the
    # probes were done left the Launch button hidden (display: none) in a server's first browser session.
    @st.fragment(run_every=0.5 if measuring else None)
    def cost_panel() -> None:
        with st.container(border=True):
            st.markdown(f"**What each mode costs here** · {WORKLOADS[config.workload].title}, {config.size}, "
                        f"batch {config.batch_size}")
            if config.size != "small" and probe_key not in asked:
                modes = tuple([BASELINE_MODE] + [m for m in config.modes if m != BASELINE_MODE])
                st.dataframe(step_estimates(config.workload, config.size, config.batch_size, modes, device),
                             hide_index=True, key="train_estimate_table")
                st.caption("**Estimates, not measurements**: the FLOPs of one forward and backward (counted by "
                           "torch.utils.flop_counter) ÷ the rate this device reached on a real matmul in the mode's "
                           "dtype. Elementwise ops, the optimizer and launch overheads are left out: a real step "
                           "takes longer. One step at this size can take a while in a slow mode, so measuring waits "
                           "for you.")
                if st.button("Measure the cost of each mode", key="train_probe_go"):
                    asked.add(probe_key)
                    st.rerun()
                return
            outcomes = probe_outcomes(config)
            failed = {mode: text for mode, text in outcomes.items() if isinstance(text, str)}
            for mode, text in failed.items():
                st.warning(f"The cost probe of {mode} failed: {text}")
            if None in outcomes.values():
                st.caption("Timing a few steps of each mode…")
            else:
                cost_table(relative_costs([r for r in outcomes.values() if isinstance(r, ProbeResult)]))

    cost_panel()

if st.button("Launch", type="primary", disabled=config is None, key="train_launch") and config is not None:
    try:
        run = manager.launch(config)
    except ConfigError as error:
        st.error(f"**{error.field}** — {error.why}. Nothing was launched.")
    else:
        st.session_state["train_run_id"] = run.run_id
        st.session_state["train_run_pick"] = run.run_id
        st.toast(f"Launched {config.workload} × {', '.join(config.modes)} ({run.run_id})", icon="🚀")

# --- the run: picker, controls, live view ------------------------------------------------------------------------
st.divider()
run_id = run_picker(manager, key="train_run_pick", label="Run", default=st.session_state.get("train_run_id"))
if run_id is None:
    st.info("No runs yet: choose a workload and modes above and press Launch.")
    st.stop()


def is_live(info: dict | None) -> bool:
    """Alive in this process, or still being written by another (the store says it is going)."""
    return info is not None and (info["live"] or info["status"] in LIVE_STATUSES)


followers: dict[str, RecordFollower] = st.session_state.setdefault("train_followers", {})
live_at_start = is_live(manager.run_info(run_id))


def controls(info: dict) -> None:
    """Pause / resume / stop for a run going in this process (callbacks, so the rerun shows the new state); for a run
    another process writes, why there are none."""
    run = manager.get(run_id)
    note = control_note(info, run is not None)
    if note:
        st.caption(note)
    if run is None or not run.alive or run.status not in ("running", "paused"):
        return
    b1, b2, _ = st.columns([1, 1, 6])
    if run.status == "paused":
        b1.button("Resume", key="train_resume", icon="▶️", on_click=run.resume)
    else:
        b1.button("Pause", key="train_pause", icon="⏸️", on_click=run.pause)
    b2.button("Stop", key="train_stop", icon="⏹️", on_click=run.stop)


def headline_cards(info: dict, series: list[LaneSeries]) -> None:
    total = info["config"].get("steps", 0)
    heads = summarize(series).set_index("lane")
    base = heads.loc[heads["is_baseline"], "mode"].iloc[0] if not heads.empty else BASELINE_MODE
    columns = st.columns(len(info["lanes"]))
    for column, lane in zip(columns, info["lanes"], strict=True):
        with column:
            fraction, done = progress(lane["steps_done"], total)
            st.progress(fraction, text=f"**{lane['mode']}** · {lane['status']} · {done}")
            if lane["lane"] not in heads.index:
                continue
            head = heads.loc[lane["lane"]]
            m1, m2, m3 = st.columns(3)
            m1.metric("loss", f"{head['latest_loss']:.4g}")
            if len(info["lanes"]) == 1:  # nothing to compare with (a Monitor's run has one lane): its own figures
                m2.metric("ms / step", f"{head['median_ms']:.3g}", help="Median step time of the lane.")
                m3.metric("skipped", int(head["skipped_steps"]), help="Optimizer steps the GradScaler skipped.")
            else:
                m2.metric(f"speed vs {base}", format_ratio(head["speedup"]),
                          help="Median ms/step of the baseline lane ÷ this lane's: above 1× is faster.")
                m3.metric(f"memory vs {base}", format_ratio(head["mem_ratio"]),
                          help="The lane's own peak memory ÷ the baseline lane's: what the lane holds plus, on CUDA, "
                               "its step's allocator peak above the step's start (other lanes do not inflate it).")
            if len(info["lanes"]) == 1:
                st.caption(f"median of {int(head['steps'])} steps · scale {format_scale(head['scale'])}")
            else:
                st.caption(f"{head['median_ms']:.3g} ms/step (median) · {int(head['skipped_steps'])} skipped · "
                           f"scale {format_scale(head['scale'])}")


def lane_problems(info: dict) -> None:
    """Errors as messages, never tracebacks: the run's own failure once, else each lane that stopped early; records
    the store could not read (a damaged chunk: the rest is shown)."""
    for problem in info.get("problems", []):
        st.warning(problem)
    lanes = info["lanes"]
    if lanes and all(lane["status"] == "failed" for lane in lanes) and len({lane["error"] for lane in lanes}) == 1:
        st.error(f"The run failed: {lanes[0]['error'] or 'see the run events'}")
        return
    for lane in lanes:
        if lane["status"] == "failed":
            others = any(other["status"] != "failed" for other in lanes)
            st.error(f"Lane **{lane['mode']}** failed: {lane['error'] or 'see the run events'}."
                     + (" The other lanes went on." if others else ""))
        elif lane["status"] == "diverged":
            st.warning(f"Lane **{lane['mode']}** stopped: {lane['error']}.")
        elif lane["status"] == "interrupted":
            st.warning(f"Lane **{lane['mode']}** was interrupted: the process running it ended.")


def charts(series: list[LaneSeries]) -> None:
    o1, o2, _ = st.columns([1, 2, 3])
    log_y = o1.toggle("log-y loss", key="train_log_y")
    smoothing = o2.slider("loss smoothing (EMA)", 0.0, 0.99, 0.0, 0.01, key="train_smoothing")
    figures = plots.train_figures(series, log_y=log_y, smoothing=smoothing)
    left, right = st.columns(2)
    left.plotly_chart(figures["loss"], key="train_chart_loss")
    right.plotly_chart(figures["step_time"], key="train_chart_step_time")
    left.plotly_chart(figures["scale"], key="train_chart_scale")
    right.plotly_chart(figures["memory"], key="train_chart_memory")
    left.plotly_chart(figures["lr"], key="train_chart_lr")
    if "ranks" in figures:  # a torchrun job: each rank's step time
        right.plotly_chart(figures["ranks"], key="train_chart_ranks")
        ranks = rank_table(series)
        st.dataframe(ranks.drop(columns=["run_id", "lane"]), hide_index=True, key="train_rank_table",
                     column_config={"skipped_steps": st.column_config.NumberColumn("skipped"),
                                    "median_ms": st.column_config.NumberColumn("median ms/step", format="%.3g"),
                                    "vs_fastest": st.column_config.NumberColumn("vs fastest rank", format="%.2f×"),
                                    "latest_loss": st.column_config.NumberColumn("latest loss", format="%.4g"),
                                    "final_loss": st.column_config.NumberColumn("final loss", format="%.4g")})
        st.caption("Each rank measures itself. Loss and step time above: the median across ranks inside the band "
                   "from the smallest to the largest rank's value; under DDP the ranks wait for each other in every "
                   "step's gradient all-reduce, so a slow rank slows them all.")


@st.fragment(run_every=REFRESH_S if live_at_start else None)
def live_view() -> None:
    info = manager.run_info(run_id)
    if info is None:
        st.warning(f"Run {run_id} is no longer in the store.")
        return
    # The picker's label can lag behind in the browser; this line is redrawn with the live view.
    st.markdown(f"{STATUS_ICONS.get(info['status'], '')} Run status: **{info['status']}** · `{run_id}`")
    controls(info)
    follower = followers.setdefault(run_id, RecordFollower(run_id))
    series = lanes(follower.update(manager))  # split once: the headlines and every chart share it
    info = manager.run_info(run_id)  # again: lanes may have moved on while the records were read
    lane_problems(info)
    headline_cards(info, series)
    charts(series)
    with st.expander("Run configuration"):
        st.json(info["config"], expanded=False)
    if live_at_start and not is_live(info):
        st.rerun()  # the run ended: one full rerun turns the timer off and the controls away


live_view()
