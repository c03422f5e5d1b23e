"""Layer numerics page: where in a model precision breaks — the first inf/NaN, each layer's error against fp32, each
layer's ranges against fp16, and a run's per-layer abs max over steps."""

import streamlit as st

from amp_core.config import INSPECT_DEFAULTS, RUN_DEFAULTS, ConfigError, RunConfig, field_docs
from amp_core.diagnostics import Answer
from amp_core.precision import MODE_HELP, resolve_device, runnable_modes
from amp_core.probes import block_numerics, numerics
from amp_core.runs import RunInfo, SourceKind, StoredConfig, is_live
from amp_core.views import block_numerics as block_views
from amp_core.views import numerics as numerics_views
from amp_core.views.tables import content_widths
from amp_core.workloads import WORKLOADS
from pages.answered import answer_for, awaiting
from pages.bisect_panel import bisect_panel
from pages.common import (
    LIVE_MARK,
    app_frame,
    attached_request,
    can_control,
    control_note,
    first_nonfinite_list,
    get_manager,
    live_lane_probe,
    recipe_of,
    run_picker,
    store_guarded,
)
from pages.forecast_panel import fix_race_panel, headroom_panel
from pages.plan_panel import plan_panel

DEVICE = resolve_device("auto")
SOURCES = ("A workload", "A live lane")
PERCENT = st.column_config.NumberColumn(format="percent")
SCIENTIFIC = st.column_config.NumberColumn(format="%.3e")
# The ranges table's short headers (the tensor is chosen above it); RANGE_HELP says each in full.
RANGE_LABELS = {"abs_max": "abs max", "min_nonzero": "min ≠ 0", "range_log2": "log2 span",
                "ref_abs_max": "fp32 abs max", "fp16_overflow": "fp16 inf", "fp16_subnormal": "fp16 subn.",
                "fp16_zero": "fp16 → 0", "bf16_zero": "bf16 → 0"}
RANGE_HELP = {
    "abs_max": "Largest |value| of the mode's own tensor.", "min_nonzero": "Smallest non-zero |value| of it.",
    "range_log2": "log2(abs max / min ≠ 0): how many binades the values span.",
    "inf": "Elements that are inf in the mode's tensor.", "nan": "Elements that are NaN in the mode's tensor.",
    "ref_abs_max": "Largest |value| of the fp32 copy's tensor.",
    "fp16_overflow": "Share of the fp32 values (finite, non-zero) that become inf when cast to fp16 (> 65504).",
    "fp16_subnormal": "Share that land in fp16's subnormal range (below 2^-14: fewer significant bits).",
    "fp16_zero": "Share that become 0 in fp16 (below about 3e-8).", "bf16_zero": "Share that become 0 in bf16."}
NEWCOMER = """
**What is probed.** One batch goes through two copies of the model, forward and backward, with no optimizer step:
one copy in the mode you pick, one in plain fp32 (`32-true`) with the same weights and the same batch. Your model
and any running lane are never touched.

**Error against fp32** is ‖y − y_fp32‖ / ‖y_fp32‖ for each module's output: 0.001 means the output is off by
0.1 % of its size. bf16 keeps about 3 significant digits, fp16 about 3.5, so errors of 1e-3 to 1e-2 are normal;
an error near 1 means the output was lost (e.g. flushed to zeros).

**Ranges.** fp16 holds magnitudes from 2^-24 (about 6e-8, with fewer bits below 2^-14, the *subnormal* range) up
to 65504; anything larger becomes inf, anything below about 3e-8 becomes 0. bf16 has fp32's range (up to 3e38) but
fewer digits. The shares in the table come from really casting the fp32 values to fp16 and bf16.

**Gradients** are shown as the backward held them: in `16-mixed` multiplied by the GradScaler's scale, which lifts
small gradients out of fp16's underflow zone and, if too large, pushes them over 65504 (the scaler then skips the
step and halves the scale).
"""


def probed(workload: str, mode: str, size: str, device: str, batch_size: int) -> Answer:
    """The probe's answer (a NumericsReport), made off the page's thread and remembered for the server."""
    return answer_for("lnum_answer", ("numerics", workload, mode, size, device, batch_size),
                      lambda: numerics.probe_workload(workload, mode, size=size, device=device, batch_size=batch_size))


def probe_failed(error: BaseException) -> None:
    """A probe's failure in one line (what was asked of it, or what ran out); anything else goes to the page's edge."""
    if isinstance(error, (ConfigError, ValueError)):
        st.error(f"Cannot probe: {error}")
    elif isinstance(error, RuntimeError):  # e.g. out of memory at a large size
        st.error(f"The probe failed: {str(error).splitlines()[0]}. Try a smaller size or batch.")
    else:
        raise error


def workload_report() -> numerics.NumericsReport | None:
    """Widgets for a workload probe; the report, or None after a note (it is being made) or an error."""
    runnable = runnable_modes(DEVICE)
    names = list(WORKLOADS)
    first, second, third, fourth = st.columns([3, 2, 2, 2])
    workload = first.selectbox("Workload", names, index=names.index("tiny_transformer"), key="lnum_workload",
                               format_func=lambda name: WORKLOADS[name].title)
    if can_control():
        size = second.selectbox("Size", list(WORKLOADS[workload].sizes), key="lnum_size")
        batch_size = third.number_input("Batch size", min_value=1, max_value=4096,
                                        value=numerics.DEFAULT_NUMERICS_BATCH, key="lnum_batch",
                                        help="Ranges depend on the batch: a larger one reaches further into the tails.")
    else:  # a visitor's probe runs on the presenter's CPU: the smallest size at the default batch, cached for all
        size, batch_size = next(iter(WORKLOADS[workload].sizes)), numerics.DEFAULT_NUMERICS_BATCH
        second.caption(f"Size **{size}**, batch **{batch_size}**: larger probes are the presenter's to run.")
    preferred = next((m for m in (INSPECT_DEFAULTS.numerics_mode, "bf16-mixed") if m in runnable), runnable[-1])
    mode = fourth.selectbox("Mode", runnable, index=runnable.index(preferred), key="lnum_mode",
                            help="\n\n".join(f"**{m}**: {MODE_HELP[m]}" for m in runnable))
    mode = recipe_of(mode, st.columns([3, 2, 4])[2], "lnum_options", placeholder="+keep:blocks.*.mlp")
    answer = probed(workload, mode, size, DEVICE, int(batch_size))
    if not answer.done.is_set():
        awaiting(answer, f"Probing one forward + backward in {mode} and in fp32, size {size}, batch {int(batch_size)}…")
    elif answer.error is not None:
        probe_failed(answer.error)
    else:
        return answer.value
    return None


def lane_report() -> numerics.NumericsReport | None:
    """Widgets to probe a lane of a live run; the report made on the last click, or None."""
    return live_lane_probe("lnum", "probe", "Copies the lane's current weights, batch and loss scale, and probes one "
                           "forward + backward against fp32.", numerics.probe_lane, "lnum_lane_report")


def show_first_nonfinite(report: numerics.NumericsReport) -> None:
    first = report.first_nonfinite
    if first is None:
        st.success(f"**No inf or NaN** in any module's output or output gradient ({report.label}).",
                   icon=":material/check_circle:")
        return
    st.error(f"**First non-finite: `{first.module}` ({first.phase})** — {first.why}.",
             icon=":material/local_fire_department:")
    if first.inputs is not None:
        st.caption(f"Its inputs: {first.inputs.describe()}.")


def show_report(report: numerics.NumericsReport) -> None:
    show_first_nonfinite(report)
    modules = report.module_frame()
    errors = report.error_frame()
    worst = errors.iloc[0] if not errors.empty else None
    cards = st.columns(4)
    cards[0].metric("Loss", f"{report.loss:.5g}", help=f"{report.reference_mode}: {report.reference_loss:.5g}")
    cards[1].metric("Worst output error", "—" if worst is None else f"{worst['output_error']:.2g}",
                    help=None if worst is None else f"in {worst['module']}")
    cards[2].metric("Module calls probed", len(modules))
    cards[3].metric("Loss scale", "none" if report.scale is None else f"{report.scale:g}",
                    help="The GradScaler scale the mode's backward used (16-mixed only).")

    st.subheader("Error against fp32, layer by layer")
    st.plotly_chart(numerics_views.error_figure(report), key="lnum_error_chart")
    left, right = st.columns([3, 2])
    left.dataframe(errors, hide_index=True, key="lnum_errors",
                   column_config={"output_error": SCIENTIFIC, "out_abs_max": SCIENTIFIC,
                                  "out_ref_abs_max": SCIENTIFIC})
    right.dataframe(report.param_frame(), hide_index=True, key="lnum_params",
                    column_config={"grad_error": SCIENTIFIC, "ref_grad_norm": SCIENTIFIC})
    right.caption("Each parameter's gradient (unscaled) against fp32's, worst first.")

    st.subheader("Ranges against fp16")
    tensor = st.radio("Tensor", list(numerics_views.TENSORS), horizontal=True, key="lnum_tensor",
                      format_func={"output": "outputs", "input": "inputs", "grad": "output gradients"}.get)
    st.plotly_chart(numerics_views.range_figure(report, tensor), key="lnum_range_chart")
    prefix = numerics_views.TENSORS[tensor]
    shown = ["module", "dtype", *(c for c in modules.columns if c.startswith(f"{prefix}_"))]
    # Headers without the tensor's prefix (the radio says it), each column as wide as its text: 12 columns fit.
    table = modules[shown].rename(columns=lambda c: c.removeprefix(f"{prefix}_"))
    shares = [c for c in table.columns if c.endswith(numerics.SHARES)]
    scientific = [c for c in table.columns if c.endswith(("abs_max", "min_nonzero"))]
    labels = {c: RANGE_LABELS.get(c, c) for c in table.columns}
    as_text = table.assign(**{c: table[c].map("{:.3e}".format) for c in scientific},
                           **{c: table[c].map("{:.2%}".format) for c in shares})
    widths = content_widths(as_text, labels, max_px=260)
    st.dataframe(table, hide_index=True, key="lnum_ranges", column_config={
        c: st.column_config.NumberColumn(labels[c], width=widths[c], help=RANGE_HELP.get(c),
                                         format="percent" if c in shares else "%.3e" if c in scientific else None)
        if c not in ("module", "dtype") else st.column_config.Column(labels[c], width=widths[c])
        for c in table.columns})
    st.caption("*abs max*, *min ≠ 0*, *log2 span*, *inf*, *nan* are the mode's own tensors; *fp32 abs max* and the "
               "shares (*fp16 inf*, *fp16 subn.* (subnormal), *fp16 → 0*, *bf16 → 0*: of the finite non-zero values) "
               "are what really casting the fp32 values does" + (
                   f" (gradients times the scale {report.scale:g})" if report.scale else "") + ".")
    st.download_button("Download the per-module table (CSV)", modules.to_csv(index=False),
                       file_name=f"numerics_{report.label.replace(' · ', '_').replace(' ', '_')}.csv",
                       mime="text/csv", key="lnum_csv")


# The block-scaled tables' columns: SNR to a tenth of a dB, the shares as percentages (a comment: a bare docstring
# here would be drawn by Streamlit's magic).
BLOCK_COLUMNS = {"SNR dB": st.column_config.NumberColumn(format="%.1f"),
                 **{label: PERCENT for label in list(block_views.COLUMNS.values())[4:]}}


def block_probed(workload: str, formats: tuple[str, ...], size: str, device: str, batch_size: int) -> Answer:
    """The block-scaled probe's answer (a BlockNumericsReport), made off the page's thread as the plain probe's."""
    return answer_for("lnum_block_answer", ("block_numerics", workload, formats, size, device, batch_size),
                      lambda: block_numerics.probe_workload_formats(workload, formats, size=size, device=device,
                                                                    batch_size=batch_size))


def show_block_formats() -> None:
    """The workload above, its Linear layers' GEMM operands in MXFP8 / NVFP4 / blockwise FP8: verdicts, heatmap,
    table."""
    st.subheader("Block-scaled formats: what MXFP8, NVFP4 and blockwise FP8 do to each GEMM operand")
    st.caption("One bf16-mixed step of the workload above; each Linear's input, weight and output gradient quantised "
               "exactly as the recipe's emulated lane does. SNR counts the values beside each block's largest: the "
               "ones a shared scale can crush.")
    formats = st.multiselect("Formats", block_numerics.FORMAT_NAMES, default=["nvfp4", "mxfp8"], key="lnum_formats")
    if not formats:
        st.info("Pick a format.")
        return
    workload = st.session_state.get("lnum_workload", "tiny_transformer")
    size = st.session_state.get("lnum_size", next(iter(WORKLOADS[workload].sizes)))
    batch_size = int(st.session_state.get("lnum_batch", numerics.DEFAULT_NUMERICS_BATCH))
    answer = block_probed(workload, tuple(formats), size, DEVICE, batch_size)
    if not answer.done.is_set():
        awaiting(answer, "Quantising every Linear's GEMM operands in " + ", ".join(formats) + "…")
        return
    if answer.error is not None:
        probe_failed(answer.error)
        return
    report = answer.value
    for name in report.formats:
        shown = st.info if report.lowest(name) is None else st.warning if report.first_below(name) else st.success
        shown(report.verdict(name))
    st.plotly_chart(block_views.snr_heatmap(report), key="lnum_block_heatmap")
    st.dataframe(block_views.display_frame(report), hide_index=True, key="lnum_block_table",
                 column_config=BLOCK_COLUMNS)
    st.caption(block_views.LEGEND + ".")
    if report.skipped:
        st.caption("Not measured: " + "; ".join(f"{name}: {why}" for name, why in report.skipped.items()))
    plan_panel(workload, size, DEVICE, "lnum")


def launch_sampled_run() -> None:
    if not can_control():  # a visitor of a shared server: the presenter launches runs
        control_note()
        return
    with st.expander("Launch a run that samples layer amax"):
        st.caption("Every N steps, after a lane's step, the run refreshes a shadow copy of the lane's model and "
                   "measures every module's output and gradient abs max on it; the training step itself, and its "
                   "step time, are untouched.")
        with st.form("lnum_launch_form"):
            runnable = runnable_modes(DEVICE)
            row = st.columns([3, 3, 2, 2])
            names = list(WORKLOADS)
            workload = row[0].selectbox("Workload", names, index=names.index("tiny_transformer"),
                                        key="lnum_run_workload", format_func=lambda name: WORKLOADS[name].title)
            # A block-scaled lane's samples also measure its GEMM operands in its format.
            block_lanes = [f"bf16-mixed+{name}" for name in block_numerics.FORMAT_NAMES] if "bf16-mixed" in runnable \
                else []
            modes = row[1].multiselect("Modes", runnable + block_lanes,
                                       default=[m for m in ("32-true", "16-mixed") if m in runnable],
                                       key="lnum_run_modes")
            steps = row[2].number_input("Steps", min_value=1, max_value=1_000_000, value=RUN_DEFAULTS.steps,
                                        key="lnum_run_steps", help=field_docs(RunConfig)["steps"])
            every = row[3].number_input("Sample every N steps", min_value=1, value=10, key="lnum_run_every")
            launched = st.form_submit_button("Launch", type="primary")
        if launched:
            try:
                run = get_manager().launch(RunConfig(workload=workload, modes=tuple(modes), steps=int(steps),
                                                     amax_every=int(every), device=DEVICE, name="layer amax"))
            except ConfigError as error:
                st.error(f"Cannot launch: {error}")
            else:
                st.session_state.lnum_run = run.run_id
                st.success(f"Launched run {run.run_id}.")


def show_amax_over_time(run_id: str) -> None:
    """The run's heatmap; redrawn every 2 s while the run is live (a fragment: the rest of the page stays)."""
    info = get_manager().run_info(run_id)
    if info is None:
        st.warning("This run is gone from the store.")
        return
    # Live: training here, or written by another process (the CLI, a Monitor script, torchrun).
    live = is_live(info)
    if live:
        st.caption(f"{LIVE_MARK} live: redrawn every 2 s (" + ", ".join(f"lane {lane.lane} {lane.steps_done} steps"
                                                            for lane in info.lanes) + " at page load)")
    st.fragment(store_guarded(amax_view), run_every=2.0 if live else None)(run_id)


def attached_note(info: RunInfo) -> None:
    """Where an attached run's samples come from (its own step, not a shadow copy)."""
    if not info.attached:
        return
    every, budget = info.settings.layers_every, info.settings.probe_budget
    spaced = f" every {every} steps" if every else ""
    if every and budget:
        spaced += (f" while its costly probes stay within {budget:.2%} of the loop's time (a watched step costs a few "
                   "steps' time on a small model, so there they are further apart)")
    st.caption(f"An attached run: {info.writer} measures every module's output and output gradient with "
               "hooks during the script's own step" + spaced + ", after a failed step (to name the first inf/NaN) "
               "and on request; the figures stay on the device until its next flush.")


def one_format(table, key: str, default: str | None = None):
    """The table's module columns and one format's shares (a radio picks it, `default` first: four formats do not
    fit side by side)."""
    formats = list(dict.fromkeys(c.rsplit(" ", 1)[0] for c in table.columns if c.endswith(
        numerics_views.CAST_EFFECTS)))
    chosen = st.radio("Cast to", formats, horizontal=True, key=key,
                      index=formats.index(default) if default in formats else 0)
    shown = [c for c in table.columns if not c.endswith(numerics_views.CAST_EFFECTS) or c.rsplit(" ", 1)[0] == chosen]
    return table[shown].rename(columns=lambda c: c.removeprefix(f"{chosen} "))


def show_cast_shares(events, lane: int, which: str) -> None:
    shares = numerics_views.cast_shares(events, lane, which)
    if shares.empty:
        return
    st.markdown(f"**What a cast does to each module's {'outputs' if which == 'output' else 'output gradients'}** "
                f"at step {shares.attrs['step']} (share of the finite non-zero values)")
    fp8 = shares.attrs.get("fp8")
    if fp8:
        cast = fp8["casts"][which]
        st.caption(f"An FP8 lane (torchao {fp8['recipe']}): *fp8 … scaled* is a real cast after the scale torchao's "
                   f"own code computes ({fp8['scaling']}), so nothing overflows and the subnormal and → 0 shares are "
                   f"what FP8 loses; plain *fp8 …* is a cast without a scale. torchao casts these tensors, where they "
                   f"enter a Float8Linear, to **{cast.removesuffix(' scaled')}**; every module's are measured as if "
                   "they did.")
    shown = one_format(shares, "lnum_cast_format", default=fp8["casts"][which] if fp8 else None)
    st.dataframe(shown, hide_index=True, key="lnum_cast_shares",
                 column_config={c: PERCENT for c in numerics_views.CAST_EFFECTS})


def requested_layers(run_id: str, live: bool) -> None:
    """An attached run: ask its process for every module's figures at its next step; the answer when it arrives."""
    answered = attached_request("lnum", "layers", run_id, live)
    answer = answered[1] if answered is not None else None
    if not answer or not answer.get("layers"):
        return
    layers = answer["layers"]
    for message in answer["messages"]:
        st.caption(message)
    table = numerics_views.cast_shares_table(layers, "output")
    table.insert(1, "output |max|", numerics_views.amax_texts(layers["output_amax"]))
    table.insert(2, "grad |max|", numerics_views.amax_texts(layers["grad_amax"]))
    shown = one_format(table, "lnum_requested_format")
    st.dataframe(shown, hide_index=True, key="lnum_requested",
                 column_config={c: PERCENT for c in numerics_views.CAST_EFFECTS})


def show_block_over_steps(events, lane: int, mode: str, run_id: str) -> None:
    """A lane's block-scaled numerics at its sampled steps (a block-scaled lane's, or an attached run's
    `block_formats`): the latest verdicts, the SNR heatmap over steps, the latest sample's table."""
    samples = block_views.block_samples(events)
    samples = samples[samples["lane"] == lane]
    if samples.empty:
        return
    step, verdicts = block_views.latest_verdicts(events, lane)
    st.markdown(f"**Block-scaled GEMM operands over steps** (latest sample: step {step})")
    for verdict in verdicts:
        st.caption(verdict)
    formats = list(dict.fromkeys(samples["format"]))
    row = st.columns([2, 3])
    chosen = row[0].radio("Format", formats, horizontal=True, key=f"lnum_block_format_{run_id}")
    operand = row[1].radio("Operand", (block_views.LOWEST, "input", "weight", "grad_output"), horizontal=True,
                           key=f"lnum_block_operand_{run_id}")
    st.plotly_chart(block_views.snr_over_steps(samples, lane, mode, chosen, operand), key="lnum_block_over_steps")
    st.dataframe(block_views.latest_table(samples[samples["format"] == chosen], lane), hide_index=True,
                 key="lnum_block_latest", column_config=BLOCK_COLUMNS)
    st.caption(block_views.LEGEND + ".")


def amax_view(run_id: str) -> None:
    manager = get_manager()
    info = manager.run_info(run_id)
    events = manager.events(run_id)
    samples = numerics_views.amax_samples(events)
    settings = info.settings if info is not None else StoredConfig()
    attached = info is not None and info.attached
    if attached:
        attached_note(info)
        requested_layers(run_id, is_live(info))
    every = settings.amax_every or settings.layers_every
    if samples.empty:
        if every:
            st.info(f"This run samples every {every} steps; no sample has arrived yet.")
        elif attached:
            st.info("This attached run samples its layers only after a failed step (its `layers_every` is 0).")
        else:
            st.info("This run did not sample layer amax (its `amax_every` is 0): launch one above.")
        return
    lanes = {lane.lane: lane.mode for lane in info.lanes} if info is not None else {}
    sampled = sorted(set(samples["lane"]))
    row = st.columns([3, 2])
    lane = row[0].selectbox("Lane", sampled, format_func=lambda i: f"lane {i} · {lanes.get(i, '?')}",
                            key=f"lnum_amax_lane_{run_id}")
    which = row[1].radio("Tensor", ("output", "grad"), horizontal=True, key=f"lnum_amax_which_{run_id}",
                         format_func={"output": "outputs", "grad": "output gradients"}.get)
    st.markdown(f"**{numerics_views.amax_story(samples, lane, which)}**")
    st.plotly_chart(numerics_views.amax_heatmap(samples, lane, lanes.get(lane, "?"), which), key="lnum_heatmap")
    headroom_panel(events, manager.steps(run_id), lane, lanes.get(lane, "?"), which, "lnum")
    first_nonfinite_list(events, "lnum_first_nonfinite")
    show_cast_shares(events, lane, which)
    show_block_over_steps(events, lane, lanes.get(lane, "?"), run_id)


app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
st.title("Layer numerics")
st.caption("Where in a model precision breaks: the first module whose output or gradient holds inf or NaN, each "
           "module's error against an fp32 run of the same weights and batch, and each module's ranges against "
           f"fp16's limits. Everything is measured on this machine ({DEVICE}) from the values that really came out.")
with st.expander("New here? What these figures mean"):
    st.markdown(NEWCOMER)

source = st.radio("Probe", SOURCES, key="lnum_source", horizontal=True)
report = lane_report() if source == SOURCES[1] else workload_report()
if report is not None:
    show_report(report)
if source == SOURCES[0] and report is not None:  # the same workload, once its plain probe ran
    st.divider()
    show_block_formats()

st.divider()
st.subheader("Over time: per-layer abs max of a run")
st.caption("A heatmap of each module's largest |value| at every sampled step. Blue darkens toward fp16's largest "
           "value, 65504; red is above it (or inf/NaN). An activation that grows step after step shows as a row "
           "darkening to the right, before it overflows.")
launch_sampled_run()
run_id = run_picker(get_manager(), "lnum_amax_run", default=st.session_state.get("lnum_run"))
if run_id is None:
    st.info("No runs yet.")
else:
    show_amax_over_time(run_id)
    run_info = get_manager().run_info(run_id)
    if run_info is not None and run_info.kind not in (SourceKind.MONITOR, SourceKind.INTEGRATION):
        lane_modes = {entry.lane: entry.mode for entry in run_info.lanes}
        forecast_lane = st.session_state.get(f"lnum_amax_lane_{run_id}")
        if forecast_lane in lane_modes:
            fix_race_panel(get_manager(), run_id, forecast_lane, lane_modes[forecast_lane], "lnum")
        st.subheader("Keep layers in fp32: find the smallest set that fixes a lane, and its price")
        bisect_lane = st.selectbox("Lane to bisect", list(lane_modes), key=f"lnum_bisect_lane_{run_id}",
                                   format_func=lambda i: f"lane {i} · {lane_modes[i]}")
        bisect_panel(get_manager(), run_id, bisect_lane, "lnum")
