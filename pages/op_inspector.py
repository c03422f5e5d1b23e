"""Op inspector page: what autocast really did on this device, op by op, in one forward + backward."""

import streamlit as st

from amp_core.config import INSPECT_DEFAULTS, ConfigError, InspectConfig, RunConfig, field_docs
from amp_core.diagnostics import Answer
from amp_core.precision import MODES, availability, resolve_device, runnable_modes
from amp_core.probes import compiled_ops, optrace
from amp_core.race import compiled_one_line, eager_recipe, lane_compiles
from amp_core.runs import is_live
from amp_core.views import compiled as compiled_views
from amp_core.views import optrace as trace_views
from amp_core.views.tables import content_widths
from amp_core.workloads import WORKLOADS
from pages.answered import answer_for, awaiting
from pages.common import (
    app_frame,
    attached_request,
    can_control,
    control_note,
    get_manager,
    live_lane_probe,
    recipe_of,
    run_picker,
    store_guarded,
    with_options,
)

DEVICE = resolve_device("auto")
DEFAULT_WORKLOAD = RunConfig.__dataclass_fields__["workload"].default
SOURCES = ("One mode", "Two modes side by side", "A live lane", "An attached run", "A compiled lane's own compile")
# The per-module table's columns on the page (the per-dtype FLOP split stays in the trace).
MODULE_COLUMNS = ("module", "format", "forward_dtype", "backward_dtype", "ops", "casts", "cast_bytes", "flops",
                  "low_precision_share")
SEED_DEMO = """x = torch.rand([32, 32])
y = torch.rand([32, 32])            # then: y = y.half() (or bfloat16)
with torch.autocast(device_type, dtype=...):
    a = x + y
    b = x @ y
print(a.dtype, b.dtype)"""


def traced(state_key: str, workload: str, mode: str, size: str, batch_size: int) -> Answer:
    """The trace's answer (an OpTrace), made off the page's thread and remembered for the server."""
    return answer_for(state_key, ("optrace", workload, mode, size, DEVICE, batch_size),
                      lambda: optrace.trace_workload(workload, mode, size=size, device=DEVICE, batch_size=batch_size))


@st.cache_data(show_spinner=False)
def demo_rows(device: str) -> list[dict[str, str]]:
    return optrace.autocast_demo(device)


def workload_traces() -> list[optrace.OpTrace]:
    """Widgets for a workload trace in one or two modes; the traces, or [] after a note (being traced) or an error."""
    runnable = runnable_modes(DEVICE)
    left, middle, right = st.columns(3)
    names = list(WORKLOADS)
    workload = left.selectbox("Workload", names, index=names.index(DEFAULT_WORKLOAD), key="opi_workload",
                              format_func=lambda name: WORKLOADS[name].title)
    if can_control():
        size = middle.selectbox("Size", list(WORKLOADS[workload].sizes), key="opi_size")
        batch_size = right.number_input("Batch size", min_value=1, max_value=1024, value=optrace.DEFAULT_TRACE_BATCH,
                                        key="opi_batch", help=field_docs(InspectConfig)["trace_batch_size"])
    else:  # a visitor's trace runs on the presenter's CPU: the smallest size at the default batch, cached for all
        size, batch_size = next(iter(WORKLOADS[workload].sizes)), optrace.DEFAULT_TRACE_BATCH
        middle.caption(f"Size **{size}**, batch **{batch_size}**: larger traces are the presenter's to run.")
    preferred = INSPECT_DEFAULTS.trace_mode if INSPECT_DEFAULTS.trace_mode in runnable else runnable[-1]
    if st.session_state.opi_source == SOURCES[0]:
        mode_col, options_col = st.columns(2)
        modes = [recipe_of(mode_col.selectbox("Mode", runnable, index=runnable.index(preferred), key="opi_mode"),
                           options_col, "opi_options")]
    else:
        first, second = st.columns(2)
        modes = [recipe_of(first.selectbox("Mode A", runnable, index=0, key="opi_mode_a"), first, "opi_options_a"),
                 recipe_of(second.selectbox("Mode B", runnable, index=runnable.index(preferred), key="opi_mode_b"),
                           second, "opi_options_b")]
    refused = [f"{m} ({availability(m, DEVICE)[1]})" for m in MODES if m not in runnable]
    if refused:
        st.caption(f"Not offered on {DEVICE}: " + "; ".join(refused))
    answers = [traced(f"opi_answer_{index}", workload, mode, size, int(batch_size))
               for index, mode in enumerate(modes)]
    waiting = [answer for answer in answers if not answer.done.is_set()]
    failed = [answer.error for answer in answers if answer.done.is_set() and answer.error is not None]
    if waiting:
        awaiting(waiting[0], f"Tracing one forward + backward in {' and in '.join(modes)}, size {size}, batch "
                             f"{int(batch_size)}…")
    elif not failed:
        return [answer.value for answer in answers]
    elif isinstance(failed[0], (ConfigError, ValueError)):
        st.error(f"Cannot trace: {failed[0]}")
    elif isinstance(failed[0], RuntimeError):  # e.g. out of memory at a large size
        st.error(f"The trace failed: {str(failed[0]).splitlines()[0]}. Try a smaller size or batch.")
    else:
        raise failed[0]
    return []


def lane_trace() -> list[optrace.OpTrace]:
    """Widgets to trace a lane of a run; the trace made on the last click, or []."""
    trace = live_lane_probe("opi", "trace", "Copies the lane's current weights and traces one forward + backward of "
                            "its latest batch.", optrace.trace_lane, "opi_lane_trace")
    return [trace] if trace is not None else []


def attached_trace() -> list[optrace.OpTrace]:
    """An attached run (a Monitor or a trainer callback in another process): ask it to trace its next step; the trace
    once it has arrived, or []."""
    from amp_core.probes import trace_from_answer as from_answer

    manager = get_manager()
    run_id = run_picker(manager, "opi_attached_run")
    info = manager.run_info(run_id) if run_id is not None else None
    if info is None or not info.attached:
        st.info("Pick a run written by a Monitor or a trainer callback (AmpLabCallback) in your own script: its "
                "process traces its next step on request.")
        return []
    live = is_live(info)
    # Per run: the request whose trace is shown, and the trace.
    arrived: dict[str, tuple[int, optrace.OpTrace]] = st.session_state.setdefault("opi_attached_traces", {})

    def status() -> None:
        live_now = is_live(manager.run_info(run_id))
        answered = attached_request("opi", "trace", run_id, live_now)
        if answered is not None and answered[0] != arrived.get(run_id, (None,))[0]:  # a new trace: draw the page
            arrived[run_id] = (answered[0], from_answer(answered[1]))
            st.rerun(scope="app")
        if live and not live_now:
            st.rerun(scope="app")  # the run ended: draw the page once more, with no timer

    # While the run is live the status is looked at every second: a request asked again later is followed too.
    st.fragment(store_guarded(status), run_every=1.0 if live else None)()
    return [arrived[run_id][1]] if run_id in arrived else []


@st.cache_data(show_spinner="Compiling one forward + backward with inductor (seconds to a minute)…", max_entries=8)
def compiled_traced(workload: str, mode: str, size: str, device: str, batch_size: int):
    return compiled_ops.trace_workload_compiled(workload, mode, size=size, device=device, batch_size=batch_size)


def compiled_section() -> None:
    """The same workload and mode compiled with inductor: its graphs' ops and dtypes, its kernels, the casts kept and
    fused away against the eager trace."""
    if st.session_state.get("opi_source") != SOURCES[0]:
        return
    st.subheader("Compiled (`+compile`): what inductor made of this step")
    mode = with_options(st.session_state.get("opi_mode", "bf16-mixed"), st.session_state.get("opi_options", ""))
    if not st.toggle(f"Compile {mode} with inductor and show what ran", key="opi_compiled"):
        st.caption("A compiled lane's layer numerics run on an eager copy with the same weights; its replay (Overflow "
                   "debugger) runs the step compiled and eagerly, side by side.")
        return
    recipe = f"{mode}+compile"
    ok, why = availability(recipe, DEVICE)
    if not ok:
        st.error(f"Cannot compile here: {why}")
        return
    try:
        trace, eager_casts = compiled_traced(st.session_state.opi_workload, recipe, st.session_state.opi_size,
                                             DEVICE, int(st.session_state.opi_batch))
    except Exception as error:  # dynamo or inductor refused the model: one line, the page goes on
        st.error(f"The compile failed: {compiled_one_line(error)}")
        return
    left, middle, right = st.columns(3)
    left.metric("Casts eager runs as their own ops", eager_casts)
    middle.metric("Casts in the compiled graphs", trace.graph_casts)
    right.metric("Kernels that only cast (kept)", trace.kept_cast_kernels,
                 help=f"{trace.fusing_kernels} other kernel(s) cast inside a computing kernel (fused away)")
    st.dataframe(trace.kernel_frame(), hide_index=True, key="opi_compiled_kernels")
    st.info(compiled_ops.CANNOT_SEE)
    with st.expander("The post-AOT graphs: every op with its dtype (forward, backward)"):
        st.dataframe(trace.ops, hide_index=True, key="opi_compiled_ops")
    with st.expander("Inductor's generated code"):
        for index, code in enumerate(trace.code):
            st.code(code[:20000], language="python")
            if len(code) > 20000:
                st.caption(f"(first 20,000 of {len(code):,} characters of part {index + 1})")


def compiled_lane_view() -> list[optrace.OpTrace]:
    """A compiled lane of a live or finished run: what its own compile made (its graphs' ops and dtypes, its kernels,
    the casts kept and fused away), beside the eager trace of the same mode; returns that eager trace (drawn below
    like any other), or []."""
    manager = get_manager()
    run_id = run_picker(manager, "opi_compiled_run")
    info = manager.run_info(run_id, count_steps=False) if run_id is not None else None
    lanes = compiled_views.compiled_lanes(info)
    if not lanes:
        st.info("Pick a run with a compiled lane (a `+compile` recipe, e.g. `bf16-mixed,bf16-mixed+compile` on the "
                "Train page): what its own compile made is kept while it compiles, and stored with the run.")
        return []
    lane = st.selectbox("Compiled lane", list(lanes), key="opi_compiled_lane",
                        format_func=lambda index: f"lane {index} · {lanes[index]}")
    captures = lane_compiles(manager, run_id, lane)
    if not captures:
        st.info(f"Nothing captured for lane {lane} yet: it is still compiling, its compile failed (the Train page "
                "says why), or its run was recorded before AMP Lab kept what a lane compiled.")
        return []
    index = st.selectbox("Compile", range(len(captures)), key="opi_compiled_capture",
                         format_func=lambda i: compiled_views.capture_label(captures[i]))
    capture = captures[min(index, len(captures) - 1)]
    counts = compiled_views.cast_counts(capture)
    eager_mode = eager_recipe(capture.recipe)
    eager, compiled = st.columns(2)
    eager.markdown(f"**Eager `{eager_mode}`** — the same step on an eager copy of the lane (same weights, same batch)")
    eager.metric("Casts eager runs as their own ops", "—" if counts["eager"] is None else counts["eager"],
                 help="`_to_copy` ops that changed a dtype, traced when the lane first compiled")
    compiled.markdown(f"**`{capture.recipe}`** — what this lane's own compile made ({capture.trigger})")
    first, second = compiled.columns(2)
    first.metric("Kernels that only cast (kept)", counts["kept"],
                 help="Their casts are written to memory, as eager's `_to_copy` is")
    second.metric("Kernels that fuse casts away", counts["fused"],
                  help="They cast in registers inside a computing kernel: the cast dtype is never stored")
    first.metric("Casts in the compiled graphs", counts["graph"])
    second.metric("Generated kernels", counts["kernels"], help="Matmuls run as extern kernels (listed below)")
    if capture.reused:
        st.caption(f"This lane compiled nothing of its own: {capture.reused}.")
    if capture.reason:
        st.caption(f"Why dynamo recompiled: {capture.reason}")
    st.dataframe(capture.summary.kernels, hide_index=True, key="opi_lane_kernels")
    st.info(compiled_ops.CANNOT_SEE)
    with st.expander("The post-AOT graphs: ops counted by phase and dtype"):
        st.dataframe(capture.summary.op_counts, hide_index=True, key="opi_lane_op_counts")
    if capture.summary.rows_left_out:
        st.caption(f"{capture.summary.rows_left_out} more rows were not kept (a run keeps a bounded summary).")
    if capture.code:
        with st.expander("Inductor's generated code (kept while this process holds the run)"):
            for code in capture.code:
                st.code(code[:20000], language="python")
    else:
        st.caption("Inductor's generated code is kept only in the memory of the process that ran the lane; the "
                   "stored run keeps the kernels and ops above.")
    return eager_lane_trace(run_id, lane, info, eager_mode)


def eager_lane_trace(run_id: str, lane: int, info, eager_mode: str) -> list[optrace.OpTrace]:
    """The eager trace beside a compiled lane: of the lane's eager copy while it runs here (on a click), else of a
    fresh build of its workload in the same mode."""
    run = get_manager().get(run_id)
    if run is not None and run.lanes[lane].status == "running":
        if not can_control():
            control_note()
            return []
        traces: dict[tuple[str, int], optrace.OpTrace] = st.session_state.setdefault("opi_compiled_eager", {})
        if st.button("Trace the lane's eager copy now", key="opi_compiled_eager_trace",
                     help="Copies the lane's current weights (a copy of a compiled module is eager) and traces one "
                          "forward + backward of its latest batch, op by op; the lane is not touched."):
            try:
                traces[(run_id, lane)] = optrace.trace_lane(run, lane)
            except (ValueError, RuntimeError) as error:
                st.error(f"Cannot trace this lane: {str(error).splitlines()[0]}")
        return [traces[(run_id, lane)]] if (run_id, lane) in traces else []
    config = info.settings
    answer = traced("opi_compiled_eager_answer", config.workload, eager_mode, config.size, optrace.DEFAULT_TRACE_BATCH)
    if not answer.done.is_set():
        awaiting(answer, f"Tracing `{eager_mode}` on a fresh build of {config.workload}…")
        return []
    if isinstance(answer.error, (ConfigError, ValueError, KeyError, RuntimeError)):
        st.caption(f"No eager trace to set beside it here: {str(answer.error).splitlines()[0]}")
        return []
    if answer.error is not None:
        raise answer.error
    trace = answer.value
    st.caption(f"Below: the eager trace of `{eager_mode}` on a fresh build of {config.workload} (the lane has "
               "ended and freed its model).")
    return [trace]


def show_summary(trace: optrace.OpTrace) -> None:
    summary = trace.summary()
    st.markdown(f"**{trace.label}** on {trace.device}")
    first, second = st.columns(2)
    first.metric("Ops (forward + backward)", summary.ops, help=f"{summary.forward_ops} forward, "
                 f"{summary.backward_ops} backward, views included")
    second.metric("Casts", summary.casts, help="`_to_copy` ops that changed a dtype; "
                  f"{optrace.format_bytes(summary.cast_bytes)} written")
    first.metric("FLOPs in bf16 / fp16", f"{summary.low_precision_share:.0%}",
                 help=f"{summary.flops:,} FLOPs in all (torch.utils.flop_counter: matmuls, convolutions, attention)")
    second.metric("Widened to fp32", summary.widened,
                  help="Ops that took a bf16/fp16 result and produced fp32")


app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
st.title("Op inspector")
st.caption(f"Every row is an aten op that really ran on this machine ({DEVICE}) in one forward + backward, after "
           "autocast rewrote it: the casts it inserted are ops too. No policy table is consulted.")

source = st.radio("Trace", SOURCES, key="opi_source", horizontal=True)
traces = (lane_trace() if source == SOURCES[2] else attached_trace() if source == SOURCES[3]
          else compiled_lane_view() if source == SOURCES[4] else workload_traces())

if traces:
    for column, trace in zip(st.columns(len(traces)), traces, strict=True):
        with column:
            show_summary(trace)
    st.plotly_chart(trace_views.flop_share_figure(traces), key="opi_flop_share")

    size_by = st.radio("Box size", ("ops", "flops"), key="opi_size_by", horizontal=True,
                       format_func=lambda s: {"ops": "op count", "flops": "FLOPs"}[s])
    for index, (column, trace) in enumerate(zip(st.columns(len(traces)), traces, strict=True)):
        column.plotly_chart(trace_views.module_treemap(trace, size_by), key=f"opi_treemap_{index}")
    st.caption("Each box is a module's own ops (children drawn inside it), coloured by the dtype most of its "
               "FLOPs ran in, or most of its ops where it has no FLOPs (LayerNorm, ReLU). Grey: no float compute. "
               "Three boxes are not modules: " + "; ".join(
                   f"**{name}** holds {what}" for name, (_, what) in trace_views.SPECIAL_MODULES.items())
               + ". Hover a box for its dtypes, ops, FLOPs and casts.")
    formatted = [(index, trace) for index, trace in enumerate(traces) if trace_views.mixes_formats(trace)]
    if formatted:
        st.subheader("Each module's format, as it ran")
        st.caption("Read from the traced model's own layers (a plan lane's formats, a block-scaled or FP8 option's "
                   "layers, modules kept in fp32), beside the dtypes their ops computed in: an emulated block-scaled "
                   "GEMM multiplies its dequantised operands in fp32.")
        for column, (index, trace) in zip(st.columns(len(formatted)), formatted, strict=True):
            column.markdown(f"**{trace.label}**")
            column.dataframe(trace_views.format_table(trace), hide_index=True, key=f"opi_formats_{index}",
                             column_config={"FLOPs": st.column_config.NumberColumn(format="localized")})
    if len(traces) == 2:
        st.subheader("Module by module")
        comparison = optrace.compare_modules(*traces).replace("", "—")  # "" = no op in that pass
        # One table per mode, side by side (rows align: the same model): one wide table would run off the page.
        modes = list(dict.fromkeys(c[c.index(" [") + 2:-1] for c in comparison.columns if c != "module"))
        for index, (column, mode) in enumerate(zip(st.columns(len(modes)), modes, strict=True)):
            suffix = f" [{mode}]"
            part = comparison[["module", *(c for c in comparison.columns if c.endswith(suffix))]]
            column.markdown(f"**{mode}**")
            column.dataframe(part.rename(columns={c: c.removesuffix(suffix) for c in part.columns}), hide_index=True,
                             key=f"opi_compare_{index}", placeholder="— (no FLOPs)", column_config={
                                 "forward_dtype": "forward", "backward_dtype": "backward",
                                 "low_precision_share": st.column_config.NumberColumn("bf16/fp16 FLOP share",
                                                                                      format="percent")})

    frames = [trace.to_frame() for trace in traces]
    staged = [(trace, trace_views.block_stage_table(frame)) for trace, frame in zip(traces, frames, strict=True)]
    if any(not table.empty for _, table in staged):
        st.subheader("Block-scaled GEMMs: what quantised what")
        st.caption("An emulated block-scaled lane's Linear layers, stage by stage: each GEMM operand quantised and "
                   "dequantised in its format and blocks (the ops below are that recipe's own code), then the GEMM "
                   "of the quantised operands, in fp32 here (no tensor cores for the format on this device).")
        for index, (trace, table) in enumerate(staged):
            if not table.empty:
                st.markdown(f"**{trace.label}**")
                st.dataframe(table, hide_index=True, key=f"opi_block_{index}",
                             column_config={"FLOPs": st.column_config.NumberColumn(format="localized")})

    st.subheader("Every op")
    modules = list(dict.fromkeys(m for trace in traces for m in trace.modules))
    dtypes = sorted({d for frame in frames for col in ("in_dtypes", "out_dtypes") for cell in frame[col]
                     for d in cell.split(", ") if d})
    phase_col, module_col, dtype_col, view_col = st.columns([2, 3, 2, 2])
    phases = phase_col.multiselect("Phase", ["forward", "backward"], key="opi_phase")
    chosen_modules = module_col.multiselect("Module (and its submodules)", modules, key="opi_module")
    chosen_dtypes = dtype_col.multiselect("Dtype in or out", dtypes, key="opi_dtype")
    hide_views = view_col.checkbox("Hide views/detach", value=True, key="opi_hide_views")
    tabs = st.tabs([trace.label for trace in traces]) if len(traces) == 2 else [st.container()]
    for index, (tab, trace, frame) in enumerate(zip(tabs, traces, frames, strict=True)):
        with tab:
            shown = optrace.filter_ops(frame, phases=phases, modules=chosen_modules, dtypes=chosen_dtypes,
                                       hide_views=hide_views)
            st.caption(f"{len(shown)} of {len(frame)} ops. Inputs and outputs: dtype, then each tensor's shape "
                       "([]: a 0-d tensor; ×n: n alike in a row). Note: *cast* = the bytes a dtype cast wrote; "
                       "*widens #n* = this op took op n's bf16/fp16 result and produced fp32; *view* = no data moved. "
                       "The CSV holds every column.")
            table = trace_views.op_table(shown)
            widths = content_widths(table)
            st.dataframe(table, hide_index=True, key=f"opi_table_{index}", column_config={
                **{column: st.column_config.TextColumn(width=width) for column, width in widths.items()},
                "#": st.column_config.NumberColumn(width=widths["#"], help="Position in the step"),
                "FLOPs": st.column_config.NumberColumn(width=widths["FLOPs"], format="localized")})
            st.download_button("Download the op table (CSV, all rows)", frame.to_csv(index=False),
                               file_name=f"optrace_{trace.label.replace(' · ', '_').replace(' ', '_')}.csv",
                               mime="text/csv", key=f"opi_csv_{index}")
            with st.expander("Where a bf16/fp16 result was widened to fp32"):
                st.dataframe(trace.widened_frame(), hide_index=True, key=f"opi_widened_{index}")
            with st.expander("Per module"):
                st.dataframe(trace.module_frame().replace({"forward_dtype": "", "backward_dtype": ""}, "—"),
                             hide_index=True, key=f"opi_modules_{index}", placeholder="— (no FLOPs)",
                             column_order=MODULE_COLUMNS, column_config={
                                 "low_precision_share": st.column_config.NumberColumn(
                                     "low-precision FLOP share", format="percent"),
                                 "flops": st.column_config.NumberColumn("FLOPs", format="localized")})

compiled_section()

st.subheader("The seed demo: `x + y` and `x @ y` under autocast, run here")
st.markdown("From *EffectivePyTorch* (Mixed precision → Autocast): on a CUDA GPU under fp16 autocast the notes "
            "print `float32` for the sum and `float16` for the product, for fp32 inputs and again with `y` in half "
            f"precision; they do not try bf16. Here is what this machine ({DEVICE}) really returns, beside what the "
            "notes print:")
st.code(SEED_DEMO, language="python")
st.dataframe(trace_views.autocast_demo_table(demo_rows(DEVICE)), hide_index=True, key="opi_demo")
st.caption("Autocast casts the inputs of ops on its lower-precision list (matmul) and leaves the others alone: "
           "`x + y` follows ordinary type promotion, and fp32 + fp16 is fp32.")
