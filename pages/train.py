"""Train page: choose a workload and precision modes, see what each mode costs here, launch, watch the lanes live.

The form is drawn from light data (amp_core.catalog) before torch is imported; the mode picker, the cost probe and
the runs follow as the server's warm-up (pages.common.WarmUp) gets there, in the same script run.
"""

from __future__ import annotations

import streamlit as st

from amp_core import catalog, missing_extras
from amp_core.config import (
    FAULT_GRAMMAR,
    MAX_SEEDS,
    OPTIMIZERS,
    RUN_DEFAULTS,
    ConfigError,
    FaultSpec,
    RunConfig,
    ScalerConfig,
    field_docs,
)
from pages.common import (
    app_frame,
    can_control,
    device_panel,
    get_manager,
    plugin_panel,
    probe_board,
    run_picker,
    store_banner,
    store_guarded,
    warm_up,
)
from pages.common import control_note as presenter_note

PROBE_POLL_S = 0.5  # how often the cost panel looks whether its race is done (only while one is under way)
DEFAULTS, DOCS, SCALER_DOCS = RUN_DEFAULTS, field_docs(RunConfig), field_docs(ScalerConfig)
# The settings in the form's folded sections, as the form starts (RunConfig's defaults).
FOLDED_DEFAULTS = {"init_scale": DEFAULTS.scaler.init_scale, "growth_factor": DEFAULTS.scaler.growth_factor,
                   "backoff_factor": DEFAULTS.scaler.backoff_factor, "growth_interval": DEFAULTS.scaler.growth_interval,
                   "eps": DEFAULTS.eps, "fused_optimizer": DEFAULTS.fused_optimizer, "grad_clip": DEFAULTS.grad_clip,
                   "faults": "", "name": ""}
# The folded sections' widgets by key: the setting of FOLDED_DEFAULTS each shows.
FOLDED_KEYS = {"train_init_scale": "init_scale", "train_growth": "growth_factor", "train_backoff": "backoff_factor",
               "train_interval": "growth_interval", "train_eps": "eps", "train_fused": "fused_optimizer",
               "train_clip": "grad_clip", "train_faults": "faults", "train_name": "name"}
DEFAULT_WORKLOAD = DEFAULTS.workload
MODES, BASELINE_MODE, MODE_HELP = catalog.modes()
RECIPE_OPTION_HELP, RECIPE_PRESETS = catalog.recipes()
# The live view's status mark, in Streamlit's own icon font: an emoji needs an emoji font, which a browser may lack
# (headless Chromium here drew each as an empty box).
STATUS_SYMBOLS = {"running": ":material/play_circle:", "paused": ":material/pause_circle:",
                  "pending": ":material/hourglass_empty:", "finished": ":material/check_circle:",
                  "stopped": ":material/stop_circle:", "failed": ":material/error:",
                  "interrupted": ":material/warning:", "diverged": ":material/bolt:"}

warm = warm_up()
light_first = not warm.done.is_set()  # this script run draws before everything is imported (a server's first)


def workload_entries() -> dict[str, catalog.WorkloadEntry]:
    """Workloads by name, sorted by title: the registry's once torch is imported (plugins too), else the catalog's.
    A server started with plugins waits for them: a first list without the user's own workload would mislead."""
    if warm.core.is_set() or catalog.plugins_named():
        warm.wait_core()
        from amp_core.workloads import WORKLOADS

        found = [catalog.WorkloadEntry(name, w.title or name, w.description, tuple(w.sizes), tuple(w.requires))
                 for name, w in WORKLOADS.items()]
        return {entry.name: entry for entry in sorted(found, key=lambda entry: entry.title.lower())}
    return {entry.name: entry for entry in catalog.builtin_workloads()}


def needs_extra(entry: catalog.WorkloadEntry) -> str:
    """' · needs pip install -e '.[hf]'' for a workload whose extra is missing here, else ''."""
    missing = missing_extras(entry.requires)
    return f" · needs {' '.join(extra.install for extra in missing)}" if missing else ""


def reset_form(workload: str, size: str) -> None:
    """The "Reset the form" button: every setting back to its default, the recipe lanes added to the picker out of
    it. Each widget's value is set, not deleted: a deleted key leaves the browser showing (and sending back) the old
    value. Which sections are open, the run shown and the charts' options stay as they are."""
    state = st.session_state
    state.update(train_workload=workload, train_size=size, train_steps=DEFAULTS.steps,
                 train_batch=DEFAULTS.batch_size, train_optimizer=DEFAULTS.optimizer, train_lr=DEFAULTS.lr,
                 train_seed=DEFAULTS.seed, train_seeds=DEFAULTS.seeds,
                 train_onecycle=DEFAULTS.scheduler == "onecycle", train_recipe_lanes=[], train_recipe_options=[],
                 train_recipe_error="", train_folded=dict(FOLDED_DEFAULTS), train_modes_reset=True)
    for key, name in FOLDED_KEYS.items():
        state[key] = FOLDED_DEFAULTS[name]


app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
st.title("Train")
st.caption("Every lane starts from the same weights and sees the same batches; one thread steps them in turn "
           "(A B C A B C …) so the machine's noise hits every lane alike.")

# --- the form: widgets -> one RunConfig --------------------------------------------------------------------------
entries = workload_entries()
names = list(entries)
first_workload = DEFAULT_WORKLOAD if DEFAULT_WORKLOAD in names else names[0]
# Above the form, not only below it, a button: Streamlit's frontend loads a widget kind's code when it first draws
# one, and Launch, drawn after seven widgets of other kinds, became usable half a second after the rest of the form
# in a fresh browser session (bench.coldstart's second session: 1.75-1.86 s, 1.16-1.31 s with a button up here).
st.button("Reset the form", key="train_reset", type="tertiary", icon=":material/restart_alt:", on_click=reset_form,
          args=(first_workload, entries[first_workload].sizes[0]),
          help="Every setting back to its default (RunConfig's), and the recipe lanes you added out of the picker.")
with st.container(border=True):
    # The workload column holds its longest title whole at 1440 px (at [2, 1, 3] the digits' title was cut off).
    c1, c2, c3 = st.columns([3, 1, 2.5])
    workload = c1.selectbox("Workload", names, index=names.index(first_workload),
                            format_func=lambda name: entries[name].title + needs_extra(entries[name]),
                            key="train_workload")
    size = c2.selectbox("Size", list(entries[workload].sizes), key="train_size",
                        help="small runs in seconds on a laptop CPU; large and xl are sizes for a GPU")
    modes_slot = c3.empty()
    c1.caption(entries[workload].description)
    parameters_slot = c2.empty()  # each size's parameter count, once torch is imported
    missing = missing_extras(entries[workload].requires)
    # The LR box is widest: "1.00e-3" must show whole at 1440 px beside six other settings, and so must the toggle's
    # label (a toggle's label is cut with an ellipsis, not wrapped).
    c1, c2, c3, c4, c5, c6, c7 = st.columns([1.1, 1.1, 1.1, 1.5, 0.8, 1.1, 1.3])
    # Defaults and help are RunConfig's own (config.py: one source for the form and the CLI).
    steps = c1.number_input("Steps", value=DEFAULTS.steps, step=50, key="train_steps", help=DOCS["steps"])
    batch_size = c2.number_input("Batch size", value=DEFAULTS.batch_size, step=16, key="train_batch",
                                 help=DOCS["batch_size"])
    optimizer = c3.selectbox("Optimizer", OPTIMIZERS, index=OPTIMIZERS.index(DEFAULTS.optimizer),
                             key="train_optimizer", help=DOCS["optimizer"])
    lr = c4.number_input("Learning rate", value=DEFAULTS.lr, step=1e-4, format="%.2e", key="train_lr",
                         help=DOCS["lr"])
    seed = c5.number_input("Seed", value=DEFAULTS.seed, step=1, key="train_seed", help=DOCS["seed"])
    seeds = c6.number_input("Seeds per mode", value=DEFAULTS.seeds, min_value=1, max_value=MAX_SEEDS, step=1,
                            key="train_seeds", help=DOCS["seeds"])
    onecycle = c7.toggle("OneCycleLR", value=DEFAULTS.scheduler == "onecycle", key="train_onecycle",
                         help=DOCS["scheduler"])
    # The folded settings draw their widgets only while open (a closed expander's widgets would cost a fresh
    # browser session its first paint: each is drawn, and a widget kind not seen yet loads its code first); their
    # values are kept in `folded` meanwhile (a widget not drawn in a run loses its own state).
    folded = st.session_state.setdefault("train_folded", dict(FOLDED_DEFAULTS))
    scaler_box = st.expander("GradScaler settings (16-mixed only)", key="train_scaler_open", on_change="rerun")
    if scaler_box.open:
        g1, g2, g3, g4 = scaler_box.columns(4)
        folded["init_scale"] = g1.number_input("Initial scale", value=folded["init_scale"], format="%g",
                                               key="train_init_scale", help=SCALER_DOCS["init_scale"])
        folded["growth_factor"] = g2.number_input("Growth factor", value=folded["growth_factor"], key="train_growth",
                                                  help=SCALER_DOCS["growth_factor"])
        folded["backoff_factor"] = g3.number_input("Backoff factor", value=folded["backoff_factor"],
                                                   key="train_backoff", help=SCALER_DOCS["backoff_factor"])
        folded["growth_interval"] = g4.number_input("Growth interval (steps)", value=folded["growth_interval"],
                                                    step=100, key="train_interval",
                                                    help=SCALER_DOCS["growth_interval"])
    more_box = st.expander("More: Adam eps, fused Adam, gradient clipping, faults, name", key="train_more_open",
                           on_change="rerun")
    if more_box.open:
        m0, m1, m2, m3 = more_box.columns([1.6, 1.4, 2.2, 1.6])  # the toggle's label and the clip label on one line
        folded["eps"] = m0.number_input("Adam/AdamW eps", value=folded["eps"], format="%.1e", key="train_eps",
                                        help=DOCS["eps"])
        folded["fused_optimizer"] = m0.toggle("Fused Adam/AdamW", value=folded["fused_optimizer"], key="train_fused",
                                              help=DOCS["fused_optimizer"])
        folded["grad_clip"] = m1.number_input("Clip grad norm (0 = off)", value=folded["grad_clip"],
                                              key="train_clip", help=DOCS["grad_clip"])
        folded["faults"] = m2.text_input("Faults to inject (demos)", value=folded["faults"], key="train_faults",
                                         placeholder="loss_scale:1e6@50+10",
                                         help=f"Comma-separated, each {FAULT_GRAMMAR}.")
        folded["name"] = m3.text_input("Run name", value=folded["name"], key="train_name")
errors_slot = st.empty()

launch_now = launch_drawn = False
if not can_control():  # a visitor of a shared server: the form is there to read, the runs below to follow
    presenter_note()
    launch_drawn = True
elif not warm.core.is_set():
    # The first paint: Launch is there at once; a press before the device is known waits for it, then launches.
    launch_now, launch_drawn = st.button("Launch", type="primary", key="train_launch"), True
    modes_slot.caption("**Precision modes** — checking which modes this machine runs (PyTorch is loading)…")
facts = warm.device_facts()
if st.session_state.get("device_slot") is not None:  # app.py left the sidebar's device facts to this page
    with st.session_state.pop("device_slot").container():
        device_panel(facts)
        plugin_panel(warm)


def add_recipe_lanes(lanes: tuple[str, ...], replace: bool) -> None:
    """Put recipe lanes in the mode picker (a preset replaces its choice; the builder adds one lane)."""
    known = st.session_state.setdefault("train_recipe_lanes", [])
    known.extend(lane for lane in lanes if lane not in facts.runnable and lane not in known)
    chosen = [] if replace else list(st.session_state.get("train_modes", []))
    st.session_state["train_modes"] = chosen + [lane for lane in lanes if lane not in chosen]


def build_recipe() -> None:
    """The builder's mode + options -> one recipe lane, or the one-line reason it cannot run here."""
    from amp_core.precision import availability, fsdp_refusal

    options = st.session_state.get("train_recipe_options", [])
    plan = st.session_state.get("train_recipe_plan", "").strip()  # +plan:FILE, a format per module (docs/plans.md)
    recipe = "+".join([st.session_state["train_recipe_mode"], *options, *([f"plan:{plan}"] if plan else [])])
    ok, why = availability(recipe, facts.device)
    if ok:  # this page's runs train in its own process: FSDP2's options need a torchrun job (amp-lab run --fsdp)
        why = fsdp_refusal(recipe, fsdp=False)
        ok = not why
    st.session_state["train_recipe_error"] = "" if ok else f"**{recipe}** — {why}"
    if ok:
        add_recipe_lanes((recipe,), replace=False)
        st.session_state["train_recipe_options"] = []  # the next lane starts from a clean choice


recipe_lanes = st.session_state.setdefault("train_recipe_lanes", [])
if st.session_state.pop("train_modes_reset", False):  # "Reset the form" (the defaults are known from here on)
    st.session_state["train_modes"] = list(facts.defaults)
modes = modes_slot.multiselect("Precision modes or recipes (one lane each)", facts.runnable + recipe_lanes,
                               default=facts.defaults, key="train_modes",
                               help="\n\n".join(f"**{m}**: {MODE_HELP[m]}" for m in facts.runnable))
recipes_box = st.expander("Recipes: FP8 matmuls, low-bit optimizer states, bf16 stochastic rounding",
                          key="train_recipes_open", on_change="rerun")
maxbatch_slot = None  # the largest-batch search lives in the recipes section: drawn while it is open
if recipes_box.open:
    with recipes_box:
        r1, r2, r3 = st.columns([2, 1, 4])
        preset = r1.selectbox("Preset race", list(RECIPE_PRESETS), key="train_recipe_preset",
                              help="A named race of recipes: its lanes replace the chosen modes.")
        r2.button("Use preset", key="train_recipe_use", on_click=lambda: add_recipe_lanes(RECIPE_PRESETS[preset], True),
                  help=" vs ".join(RECIPE_PRESETS[preset]))
        r3.caption(f"**{preset}**: " + " vs ".join(f"`{lane}`" for lane in RECIPE_PRESETS[preset]))
        b1, b2, b3 = st.columns([1, 3, 1])
        b1.selectbox("Mode", facts.runnable, key="train_recipe_mode")
        b2.multiselect("Options", list(RECIPE_OPTION_HELP), key="train_recipe_options",
                       help="\n\n".join(f"**+{name}**: {text}" for name, text in RECIPE_OPTION_HELP.items()))
        b3.button("Add lane", key="train_recipe_add", on_click=build_recipe,
                  help="Adds MODE+OPTION... to the lanes, or says why this device cannot run it.")
        st.text_input("Precision plan (optional): a TOML file of module globs -> formats", key="train_recipe_plan",
                      placeholder="plan-llama-nvfp4.toml", help="Adds +plan:FILE to the lane: the modules it names "
                      "take its formats (fp32, bf16, fp16, fp8-…, mxfp8, nvfp4, fp8-blockwise), the rest the lane's "
                      "recipe. `amp-lab plan` or Layer numerics' *Find a plan* writes one.")
        if st.session_state.get("train_recipe_error"):
            st.error(st.session_state["train_recipe_error"])
        st.markdown("\n".join(f"- `+{name}` {text}" for name, text in RECIPE_OPTION_HELP.items()))
        maxbatch_slot = st.container()  # filled once torch is imported: the largest batch of each chosen lane

config: RunConfig | None = None
try:
    config = RunConfig(
        workload=workload, size=size, modes=tuple(modes), steps=int(steps), batch_size=int(batch_size),
        optimizer=optimizer, lr=float(lr), eps=float(folded["eps"]), fused_optimizer=bool(folded["fused_optimizer"]),
        scheduler="onecycle" if onecycle else "none", seed=int(seed), seeds=int(seeds),
        grad_clip=float(folded["grad_clip"]), name=folded["name"].strip(),
        scaler=ScalerConfig(init_scale=float(folded["init_scale"]), growth_factor=float(folded["growth_factor"]),
                            backoff_factor=float(folded["backoff_factor"]),
                            growth_interval=int(folded["growth_interval"])),
        faults=tuple(FaultSpec.parse(text) for text in folded["faults"].split(",") if text.strip()))
except ConfigError as error:
    errors_slot.error(f"**{error.field}** — {error.why}. Nothing was launched.")
if missing:
    config = None  # nothing to launch or probe: its model cannot be built here
    errors_slot.error(f"**{entries[workload].title}** needs the {' and '.join(extra.name for extra in missing)} "
                      f"extra, which is not installed here: `{' '.join(extra.install for extra in missing)}`, then "
                      "restart the app. Nothing was launched.")
if not launch_drawn:
    launch_now = st.button("Launch", type="primary", disabled=config is None, key="train_launch")
# Below Launch: a table's first draw in a browser loads the grid's code, and what follows it waits for that.
cost_slot = st.container()

if not warm.done.is_set():
    with st.spinner("Warming up: loading the charts and the run store…"):
        warm.done.wait()

import pandas as pd  # noqa: E402  (imported by the warm-up by now: the first paint did not wait for them)

from amp_core.diagnostics import (  # noqa: E402
    MIN_TIMED_S,
    SLOW_FACTOR,
    TIME_CAP_S,
    TIMED_STEPS,
    WARMUP_STEPS,
    ProbeResult,
    estimate_step,
    relative_costs,
)
from amp_core.precision import availability  # noqa: E402
from amp_core.probes import SpikeRule  # noqa: E402
from amp_core.runs import RunInfo, SourceKind, is_live  # noqa: E402
from amp_core.views import block_scales as block_scale_views  # noqa: E402
from amp_core.views import compiled as compiled_views  # noqa: E402
from amp_core.views import costs as cost_views  # noqa: E402
from amp_core.views import forecast as forecast_views  # noqa: E402
from amp_core.views import plots  # noqa: E402
from amp_core.views.board import board_view, lane_table  # noqa: E402
from amp_core.views.compare import format_replicates  # noqa: E402
from amp_core.views.live import (  # noqa: E402
    LANE_COLUMNS,
    PROGRESS_PX,
    control_note,
    lane_medians,
    what_ran_warnings,
)
from amp_core.views.shared import LiveFrame, live_refresh_s, live_room  # noqa: E402
from amp_core.views.summary import (  # noqa: E402
    DIFFERENCE_RULE,
    difference_sentences,
    has_replicates,
    lane_seeds,
    rank_table,
    replicate_differences,
    replicate_table,
)
from amp_core.views.tables import markdown_table  # noqa: E402
from pages.live_chart import live_board  # noqa: E402

# The live board's period while a run goes (AMP_LAB_LIVE_REFRESH_S, default 1 s: charts that move every second). What
# a viewer costs a run is kept small by sharing: a tick's reading of the run, its table and the charts' changes are
# computed once and written to files every session's browser fetches (amp_core.views.live_feed), so a room costs the
# server about what one does, and no session's script reruns each second. Read here, after the first paint:
# amp_core.views.shared imports pandas.
REFRESH_S, REFRESH_PROBLEM = live_refresh_s()
# The live view's own redraw period for a run that shows parts the board does not carry (seed replicates, ranks,
# compiled lanes, forecasts, block scales, a trainer's warnings): they follow the run this often; other runs' live
# views rerun only when the board's signal changes.
TIMED_PARTS_S = 5 * REFRESH_S


@st.cache_data(show_spinner=False)
def parameter_counts(workload: str, sizes: tuple[str, ...]) -> str:
    """'small 34.2K · medium 3.3M · ...': each size's parameters, counted on the meta device (nothing allocated)."""
    from amp_core.workloads import parameter_count

    return " · ".join(f"{size} {format_count(parameter_count(workload, size))}" for size in sizes)


def format_count(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


if not missing:
    parameters_slot.caption(f"Parameters: {parameter_counts(workload, entries[workload].sizes)}")
manager = get_manager()
if light_first:
    store_banner(manager)
board = probe_board()
device = facts.device


# --- what each mode costs here, measured before launch -----------------------------------------------------------
def cost_table(costs: pd.DataFrame) -> None:
    # Text, not a data grid: the first view loads no grid code.
    st.markdown(markdown_table(cost_views.cost_table(costs)))
    for row in costs[costs["far_slower"]].itertuples():
        st.warning(f"**{row.mode}** takes {row.time_vs_baseline:.1f}× the time of {BASELINE_MODE} per step here "
                   f"({availability(row.mode, device)[1]}).")
    st.caption(f"Measured on this {device.upper()} as a run measures it: the modes race through the runner "
               f"(lanes in turn, the run's own threads) for {WARMUP_STEPS} warm-up steps and {TIMED_STEPS} timed "
               f"steps, raced again for longer where those took under {MIN_TIMED_S:g} s (at most {TIME_CAP_S:g} s in "
               f"all); each figure is its lane's median. Remembered per workload, size, "
               f"batch and settings; a finished run that disagrees by more than 20% replaces it. Above "
               f"{SLOW_FACTOR:g}× is flagged.")


@st.cache_data(show_spinner="Estimating what a step would take…")
def step_estimates(workload: str, size: str, batch_size: int, modes: tuple[str, ...], device: str) -> pd.DataFrame:
    """Per mode: an estimate of one step's time, or why not (its table shaped by amp_core.views.costs), kept for these
    settings."""
    estimates: dict[str, object] = {}
    for mode in modes:
        try:
            estimates[mode] = estimate_step(workload, size, batch_size, mode, device)
        except (ConfigError, RuntimeError) as error:
            estimates[mode] = str(error)
    return cost_views.step_estimates(estimates)


def draw_costs(outcomes: dict[str, ProbeResult | str]) -> None:
    for mode, text in outcomes.items():
        if isinstance(text, str):
            st.warning(f"The cost probe of {mode} failed: {text}")
    measured = [r for r in outcomes.values() if isinstance(r, ProbeResult)]
    if measured:
        cost_table(relative_costs(measured))


# --- the largest batch each chosen lane allows (diagnostics.maxbatch, as `amp-lab maxbatch`) --------------------------
def start_maxbatch(budget_mib: float) -> None:
    """Check the input at once (a message, not a traceback), then search off the page's thread."""
    from amp_core.diagnostics import MaxBatchJob

    st.session_state.pop("train_maxbatch", None)
    try:
        if not modes:
            raise ConfigError("modes", "choose at least one mode or recipe above")
        st.session_state["train_maxbatch"] = MaxBatchJob(workload, tuple(modes), size=size, device=device,
                                                         budget_mib=budget_mib or None, optimizer=optimizer)
    except ConfigError as error:
        st.error(f"**{error.field}** — {error.why}. Nothing was searched.")


def maxbatch_result(polling: bool) -> None:
    """The search's table when it is done (redrawn every half second until then: a fragment, the page stays)."""
    job = st.session_state.get("train_maxbatch")
    if job is None:
        return
    if not job.done:
        st.caption("Looking for the largest batch of each lane" + (" by real steps…" if device == "cuda" else
                                                                    " (two measured steps per lane)…"))
        return
    if polling:
        st.rerun()  # done: one full run draws the table, with no timer left behind
    if job.error:
        st.error(f"The search failed: {job.error}")
        return
    table, modelled = cost_views.maxbatch_table(job.rows())
    st.dataframe(table, hide_index=True, key="train_maxbatch_table", column_config={
        "max batch": st.column_config.NumberColumn(format="%d"),
        "bytes / sample": st.column_config.NumberColumn(format="%.0f"),
        "fixed MiB": st.column_config.NumberColumn(format="%.2f"),
        "budget MiB": st.column_config.NumberColumn(format="%.0f"),
        "samples / s": st.column_config.NumberColumn(format="%.0f")})
    config_text = f"{entries[job.config.workload].title}, {job.config.size}, {job.config.optimizer}"
    if modelled:
        from amp_core.diagnostics import MAXBATCH_PROBE_BATCHES as PROBE_BATCHES

        st.caption(f"**Modelled** ({config_text}): no batch was tried at that size. Each lane's fixed bytes "
                   "(parameters, gradients, optimizer state, after a real step) and bytes per sample (saved for "
                   f"backward, measured on real steps at batches {PROBE_BATCHES[0]} and {PROBE_BATCHES[1]}) against "
                   "the budget.")
    else:
        st.caption(f"Found by real steps ({config_text}): a bounded search, an out-of-memory caught and the "
                   "allocator emptied; the throughput is timed at the batch found.")


if maxbatch_slot is not None:
    with maxbatch_slot:
        st.markdown("**Largest batch each lane allows**")
        m1, m2 = st.columns([2, 3], vertical_alignment="bottom")
        budget_mib = m1.number_input("Memory budget (MiB, 0 = what is free now)", min_value=0.0, value=0.0, step=256.0,
                                     key="train_maxbatch_budget",
                                     help="0: the free GPU memory on CUDA, the machine's available memory on a CPU.")
        if not can_control():
            with m2:
                presenter_note()
        elif m2.button("Find the largest batch", key="train_maxbatch_go",
                     help="For the chosen workload, size, optimizer and lanes — the same search as `amp-lab maxbatch`. "
                          "On a CPU it is modelled from measured bytes (seconds); on CUDA it tries real steps."):
            start_maxbatch(float(budget_mib))
        job = st.session_state.get("train_maxbatch")
        polling = job is not None and not job.done
        st.fragment(store_guarded(maxbatch_result), run_every=0.5 if polling else None)(polling)


if config is not None:
    probe_key = (config.workload, config.size, config.batch_size, device)
    asked = st.session_state.setdefault("train_probed", set())
    waits_for_user = config.size != "small" and probe_key not in asked
    known = board.known(config)
    busy = manager.training_here() if known is None and not waits_for_user else []
    watching = not can_control()  # a visitor sees what was measured, and starts no race
    racing = not watching and not waits_for_user and not busy and known is None

    @st.fragment(run_every=PROBE_POLL_S if racing else None)
    @store_guarded
    def cost_panel() -> None:
        with st.container(border=True):
            st.markdown(f"**What each mode costs here** · {entries[config.workload].title}, {config.size}, "
                        f"batch {config.batch_size}")
            if watching:
                if known is None:
                    st.caption("Not measured for these settings yet: the presenter's cost probe measures them.")
                else:
                    draw_costs(known)
                return
            if waits_for_user:
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
            if busy and known is None:
                st.caption(f"Measured once no run is going: run `{busy[0]}` trains on this machine (here or in "
                           "another process), shares its cores, and would slow the race and be slowed by it.")
                return
            outcomes = known if known is not None else board.get(config)
            if outcomes is None:
                st.caption(f"Racing the modes through the runner for a few dozen steps (at most {TIME_CAP_S:g} s)…")
                return
            if racing:
                st.rerun()  # the race is done: one full run draws it, with no timer left behind
            draw_costs(outcomes)

    with cost_slot:
        cost_panel()

if launch_now and config is not None:
    try:
        run = manager.launch(config)
    except ConfigError as error:
        st.error(f"**{error.field}** — {error.why}. Nothing was launched.")
    else:
        st.session_state["train_run_id"] = run.run_id
        st.session_state["train_run_pick"] = run.run_id
        st.toast(f"Launched {config.workload} × {', '.join(config.modes)} ({run.run_id})",
                 icon=":material/rocket_launch:")

# --- the run: picker, controls, live view ------------------------------------------------------------------------
st.divider()
# The picker leaves the status out: the live view below says it, redrawn with the lanes (one source of truth).
run_id = run_picker(manager, key="train_run_pick", label="Run", default=st.session_state.get("train_run_id"),
                    status=False)
if run_id is None:
    st.info("No runs yet: choose a workload and modes above and press Launch.")
    st.stop()


info_at_start = manager.run_info(run_id)
live_at_start = is_live(info_at_start)


def controls(info: RunInfo) -> None:
    """Pause / resume / stop for a run going in this process (callbacks, so the rerun shows the new state); for a run
    another process writes, why there are none."""
    note = control_note(info)
    if note:
        st.caption(note)
    status = info.status
    run = manager.get(run_id)
    if run is None or not info.controllable or status not in ("running", "paused"):
        return
    if not can_control():
        presenter_note()
        return
    b1, b2, _ = st.columns([1, 1, 6])
    if status == "paused":
        b1.button("Resume", key="train_resume", icon=":material/play_arrow:", on_click=run.resume)
    else:
        b1.button("Pause", key="train_pause", icon=":material/pause:", on_click=run.pause)
    b2.button("Stop", key="train_stop", icon=":material/stop:", on_click=run.stop)


def lane_rows(frame: LiveFrame) -> None:
    """The lanes table of a run that has ended, drawn by Streamlit (a live one is on its board)."""
    table, labels, widths, against = lane_table(frame)
    columns = {column: st.column_config.Column(labels.get(column, column), width=width, help=LANE_COLUMNS[column])
               for column, width in widths.items()}
    columns["progress"] = st.column_config.ProgressColumn("progress", help=LANE_COLUMNS["progress"],
                                                          format="percent", min_value=0.0, max_value=1.0,
                                                          width=PROGRESS_PX)
    st.dataframe(table, hide_index=True, key="train_lanes", column_config=columns)
    if against:
        st.caption(against)


def what_ran(info: RunInfo) -> None:
    """Warnings a trainer integration recorded about what really ran (a precision asked and not applied, fp16 without
    loss scaling). They come with the run's first step, so the events are read once the run has a step, then kept."""
    if info.kind is not SourceKind.INTEGRATION:
        return
    seen: dict[str, list[str]] = st.session_state.setdefault("train_what_ran", {})
    if run_id not in seen and (any(lane.steps_done for lane in info.lanes) or not is_live(info)):
        seen[run_id] = what_ran_warnings(manager.events(run_id))
    for message in seen.get(run_id, []):
        st.warning(f"What really ran: {message}.")


def lane_problems(info: RunInfo) -> None:
    """Errors as messages, never tracebacks: the run's own failure once, else each lane that stopped early; records
    the store could not read (a damaged chunk: the rest is shown)."""
    for problem in info.problems:
        st.warning(problem)
    lanes_info = info.lanes
    if lanes_info and all(lane.status == "failed" for lane in lanes_info) and len(
            {lane.error for lane in lanes_info}) == 1:
        st.error(f"The run failed: {lanes_info[0].error or 'see the run events'}")
        return
    for lane in lanes_info:
        if lane.status == "failed":
            others = any(other.status != "failed" for other in lanes_info)
            st.error(f"Lane **{lane.mode}** failed: {lane.error or 'see the run events'}."
                     + (" The other lanes went on." if others else ""))
        elif lane.status == "diverged":
            st.warning(f"Lane **{lane.mode}** stopped: {lane.error}.")
        elif lane.status == "interrupted":
            st.warning(f"Lane **{lane.mode}** was interrupted: the process running it ended.")


def compiled_lanes(info: RunInfo) -> None:
    """Compiled lanes (`+compile`): which is compiling now, and each one's compile time, graph breaks and recompiles
    (read from the run's events only when a lane compiles)."""
    if not compiled_views.has_compiled(lane.mode for lane in info.lanes):
        return
    for lane in info.lanes:
        if lane.status == "compiling":
            st.info(f"Lane **{lane.mode}** is compiling (dynamo + inductor): its timed steps start once the "
                    "compile is done, and the compile time is recorded apart.")
    events = manager.events(run_id)
    for _, event in events[events["kind"] == "compile_slow"].iterrows():
        st.warning(event["message"])
    table = compiled_views.compile_summary(events, list(info.lanes))
    st.dataframe(compiled_views.train_table(table), hide_index=True, key="train_compiled")
    st.caption(compiled_views.COMPILE_NOTE)


def block_scales(info: RunInfo) -> None:
    """What a block-scaled lane's scales take, under the memory chart (read once from the run's started event)."""
    if not block_scale_views.has_block_scaled(lane.mode for lane in info.lanes):
        return
    seen: dict[str, list[str]] = st.session_state.setdefault("train_block_scales", {})
    if run_id not in seen:
        lines = block_scale_views.scale_lines(manager.events(run_id))
        if not lines:
            return  # not started yet: asked again at the next redraw
        seen[run_id] = lines
    st.caption(" · ".join(seen[run_id]) + ". An emulated lane holds them only during each GEMM; torchao's kernels "
               "keep them beside the elements.")


def forecasts(info: RunInfo) -> None:
    """Each lane's latest forecast (amp_core.probes.headroom: a layer heading for its format's limit), read from the
    run's events only when it samples its layers."""
    if not (info.settings.amax_every or info.settings.layers_every):
        return
    lines = forecast_views.lane_forecast_lines(manager.events(run_id), {lane.lane: lane.mode for lane in info.lanes})
    for line in lines:
        st.warning(f"Forecast · {line}")


def replicates(series: list, seeds: dict[str, int]) -> None:
    """Each mode across its seeds, and whether two modes differ by more than the spread across seeds."""
    table = replicate_table(series, seeds)
    st.markdown("**Across seeds** — each mode's seed replicates together")
    st.dataframe(format_replicates(table), hide_index=True, key="train_replicates")
    for sentence in difference_sentences(replicate_differences(table)):
        st.markdown(f"- {sentence}")
    st.caption(f"Mean ± sample standard deviation across seeds; {DIFFERENCE_RULE}. The loss and step-time charts "
               "draw each mode as its mean across seeds inside the band from the lowest to the highest seed.")


def chart_options() -> None:
    """The charts' options, drawn with the page rather than in the live view: a widget in a fragment is sent again at
    each of its redraws, for every session (a room of thirty at 1 s: seven elements each, every second, that never
    change)."""
    o1, o2, o3, _ = st.columns([2, 2, 2, 2])
    o1.radio("Loss axis", plots.LOSS_AXES, horizontal=True, key="train_loss_axis",
             help="auto: log when the loss spans a wide range, else linear with a spike left off the axis "
                  "(▲ on its edge).")
    o2.slider("Loss smoothing (EMA)", 0.0, 0.99, 0.0, 0.01, key="train_smoothing")
    o3.toggle("Every step's time", key="train_raw_step_times",
              help="The step-time chart draws each lane's median and p10-p90 band (one stall does not flatten it); "
                   "this adds the measured step times themselves.")


def controls_shown(info: RunInfo | None) -> tuple:
    """What decides the controls drawn with the page: the live view redraws the page when it changes."""
    return (None,) if info is None else (info.status, info.controllable)


def chart_choices() -> tuple[str, float, bool, SpikeRule]:
    """This session's choices that shape the charts: the options drawn with the page (chart_options) and the spike
    band the Overflow debugger sets (its expander; else the default one)."""
    state = st.session_state
    return (state.get("train_loss_axis", plots.LOSS_AXES[0]), state.get("train_smoothing", 0.0),
            state.get("train_raw_step_times", False), state.get("spike_rule", SpikeRule()))


def spike_caption(spike_rule: SpikeRule) -> str:
    return (f"○ a loss spike: above {spike_rule.describe()}; set on the Overflow debugger, which lists them with a "
            "Replay button.")


def rank_rows(series: list) -> None:
    """A torchrun job's ranks: each rank's figures (its step-time chart is with the others)."""
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


def live_part(frame: LiveFrame, seeds: dict[str, int]) -> None:
    """A live run's lanes table and charts: its board (pages.live_chart), moved in the browser from the run's
    published feed. This session's choices are its feed's name: sessions that chose alike (a room on the defaults)
    share one feed, its board rendered once per tick."""
    axis, smoothing, raw, spike_rule = choices = chart_choices()
    try:
        view = live_board(manager, frame, ("board", *choices, tuple(sorted(seeds.items()))),
                          lambda tick: board_view(tick, axis, smoothing, raw, spike_rule, seeds),
                          key="train_live_board")
    except OSError as error:  # its files could not be written (a full or read-only temp directory): drawn still
        st.warning(f"The live board could not write its feed ({error.strerror or error}): the table and charts below "
                   "show the run as it is now and move when the page is drawn again.")
        lane_rows(frame)
        charts(frame, seeds)
        return
    notes = [spike_caption(spike_rule)]
    lr = view["signal"][-1]
    if lr is not None:
        notes.append(f"Learning rate constant at **{lr}** in every lane (a chart appears when it moves).")
    st.caption(" · ".join(notes))
    if "ranks" in view["charts"]:
        rank_rows(frame.series)


def charts(frame: LiveFrame, seeds: dict[str, int]) -> None:
    """The charts of a run that has ended, drawn by Streamlit."""
    series = frame.series
    axis, smoothing, raw, spike_rule = chart_choices()
    figures = plots.train_figures(series, loss_axis=axis, smoothing=smoothing, raw_step_times=raw,
                                  bands=frame.bands, seeds=seeds, spikes=spike_rule)
    left, right = st.columns(2)
    left.plotly_chart(figures["loss"], key="train_chart_loss")
    left.caption(spike_caption(spike_rule))
    right.plotly_chart(figures["step_time"], key="train_chart_step_time")
    left.plotly_chart(figures["scale"], key="train_chart_scale")
    right.plotly_chart(figures["memory"], key="train_chart_memory")
    lr = plots.constant_lr(series)
    if lr is None:
        left.plotly_chart(figures["lr"], key="train_chart_lr")
    else:
        left.markdown(f"**Learning rate** constant at **{lr:.3g}** in every lane (a chart appears when it moves).")
    if "ranks" in figures:  # a torchrun job: each rank's step time
        right.plotly_chart(figures["ranks"], key="train_chart_ranks")
        rank_rows(series)


def timed_parts(info: RunInfo | None) -> bool:
    """Whether a run shows parts its live board does not carry, read from the store as the run goes (TIMED_PARTS_S)."""
    if info is None:
        return False
    settings, modes = info.settings, [lane.mode for lane in info.lanes]
    return (settings.seeds > 1 or settings.world_size > 1 or bool(settings.amax_every or settings.layers_every)
            or info.kind is SourceKind.INTEGRATION or compiled_views.has_compiled(modes)
            or block_scale_views.has_block_scaled(modes))


@st.fragment(run_every=TIMED_PARTS_S if live_at_start and timed_parts(info_at_start) else None)
@store_guarded
def live_view() -> None:
    # The run as it is now: this part is drawn with the page, when the board's signal changed (its component's value
    # reruns it) and, for a run with parts the board does not carry, every TIMED_PARTS_S; never once per tick.
    frame = live_room().frame(manager, run_id, fresh=True)
    series, info = frame.series, frame.info
    if info is None:
        st.warning(f"Run {run_id} is no longer in the store.")
        return
    if controls_shown(info) != controls_shown(info_at_start):
        st.rerun()  # paused, resumed or stopped elsewhere: the page's controls follow (drawn with the page)
    st.markdown(f"{STATUS_SYMBOLS.get(info.status, '')} Run status: **{info.status}** · `{run_id}`")
    if REFRESH_PROBLEM:
        st.warning(REFRESH_PROBLEM)
    what_ran(info)
    lane_problems(info)
    seeds = lane_seeds(run_id, info.lanes)
    live = is_live(info)
    if live:
        live_part(frame, seeds)
    else:
        lane_rows(frame)
    compiled_lanes(info)
    forecasts(info)
    if has_replicates(series, seeds):
        replicates(series, seeds)
    if not live:
        charts(frame, seeds)
    block_scales(info)
    if info.settings.device == "cuda":
        st.caption("On a GPU, a step's time is the device's: CUDA events around the step, read without a host sync. "
                   "Where the host's kernel launches are the bottleneck (a small model), lanes racing in one run queue "
                   "behind each other and that host time is hidden: compare such a lane with a run of it alone.")
    if not live and info.status in ("finished", "stopped") and info.kind is SourceKind.RACE:
        # The run's own medians correct a remembered cost probe that disagrees with them (a run of the runner's;
        # a Monitor's run trained the user's own loop, which the probe does not measure).
        board.learn_from_run(RunConfig.from_dict(info.config), lane_medians(series), run_id)
    if live_at_start and not live:
        st.rerun()  # the run ended: one full rerun turns the timer off and the controls away


# Drawn with the page, not at every redraw of the live view (sent again for every session each time otherwise).
if info_at_start is not None:
    controls(info_at_start)
chart_options()
live_view()
if info_at_start is not None:  # a run's configuration never changes: drawn once, not at every redraw of the view
    with st.expander("Run configuration"):
        st.json(info_at_start.config, expanded=False)
