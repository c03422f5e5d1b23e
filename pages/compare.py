"""Compare page: any lanes of any runs (live or stored) against a baseline lane — loss, time, memory, skips."""

from functools import partial

import streamlit as st

from amp_core.config import FINAL_LOSS_WINDOW
from amp_core.records import StoreError
from amp_core.views import compare, plots, report
from amp_core.views import compiled as compiled_views
from amp_core.views.summary import (
    DIFFERENCE_RULE,
    by_lane,
    default_baseline,
    difference_sentences,
    has_replicates,
    lane_key,
    rank_table,
    replicate_differences,
    replicate_table,
    replicated_keys,
    summarize,
)
from amp_core.views.tables import content_widths
from pages.common import LIVE_MARK, app_frame, get_manager, run_label, store_guarded

# While a chosen run trains, the comparison redraws this often. Compare is for reading runs side by side; the Train
# page is the live view (every 3 s). Each redraw re-plots Compare's wide charts in the browser, about 1.2 Chromium
# CPU s, which a run training on the same machine pays (2 cores; Train + Compare watching a CLI run: Chromium 33 CPU s
# a minute with Compare at 5 s, 26 at 10 s).
LIVE_REFRESH_S = 10.0
# Short headers (and their full meaning on hover) for the summary's widest columns: the table fits 1440 px.
SUMMARY_HEADERS = {
    "median ms/step": ("ms/step", "Median step time (ms): robust to a slow first step"),
    "peak memory": ("peak mem", "The CUDA allocator's peak where there is one, else the bytes held"),
    "memory ratio": ("mem ratio", "Peak memory ÷ the baseline's"),
    "skipped steps": ("skipped", "Optimizer steps the GradScaler skipped (inf/NaN gradients)"),
}

app_frame()  # first: a page opened by its URL on a fresh server is drawn inside the app
st.title("Compare runs")
st.caption("Pick runs, then the lanes to lay side by side. Colour is the precision mode (as on every page); the "
           "dash style tells runs apart. Live runs keep updating.")
manager = get_manager()  # app.py shows the store banner when the store could not be opened

try:
    runs = manager.list_runs()
except StoreError as error:
    st.error(f"The run store could not be read: {error}")
    st.stop()
if runs.empty:
    st.info("No runs yet. Launch one on the **Train** page (or `python -m amp_core run ...`), then come back "
            "here to compare its lanes, or lanes of several runs.")
    st.stop()

run_ids = runs["run_id"].tolist()
run_labels = {row["run_id"]: run_label(row) for _, row in runs.iterrows()}


def lane_options(chosen_runs: list[str]):
    try:
        return compare.lane_table(manager, chosen_runs)
    except StoreError as error:
        st.error(f"The run store could not be read: {error}")
        st.stop()


def sync_lanes() -> None:
    """Runs added to the choice bring all their lanes; runs taken away take theirs; other lanes stay as chosen."""
    chosen = st.session_state["cmp_runs"]
    try:
        table = compare.lane_table(manager, chosen)
    except StoreError:
        return  # the page itself says why just after
    known = st.session_state.get("cmp_known_runs", [])
    kept = [key for key in st.session_state.get("cmp_lanes", []) if key in set(table["key"])]
    added = table[~table["run_id"].isin(known)]["key"].tolist()
    st.session_state["cmp_lanes"] = kept + [key for key in added if key not in kept]
    st.session_state["cmp_known_runs"] = list(chosen)


if "cmp_runs" not in st.session_state:
    st.session_state["cmp_runs"] = run_ids[:1]  # the newest run: most often the one just launched
# A run can leave the list (an in-memory run the manager let go); a stale choice must not break the widget.
st.session_state["cmp_runs"] = [run_id for run_id in st.session_state["cmp_runs"] if run_id in run_labels]
if "cmp_lanes" not in st.session_state:
    sync_lanes()

chosen_runs = st.multiselect("Runs", run_ids, format_func=run_labels.get, key="cmp_runs", on_change=sync_lanes,
                             help="Live and stored runs, newest first. Adding a run adds all its lanes below.")
table = lane_options(chosen_runs)
lane_labels = dict(zip(table["key"], table["label"], strict=True))
st.session_state["cmp_lanes"] = [key for key in st.session_state["cmp_lanes"] if key in lane_labels]
chosen_lanes = st.multiselect("Lanes", table["key"].tolist(), format_func=lane_labels.get, key="cmp_lanes",
                              help="Label: precision mode · the run's short id.")
if not chosen_runs or not chosen_lanes:
    st.info("Choose at least one run above, then the lanes to compare (a lane is one precision mode of a run). "
            "No runs to choose from? Launch one on the **Train** page.")
    st.stop()

chosen_table = table[table["key"].isin(chosen_lanes)]
seeds = compare.table_seeds(chosen_table)  # lanes of one mode and several seeds are drawn as a mean and a band
# The baseline follows the default (first 32-true lane) as lanes come and go, until the user picks one.
if not st.session_state.get("cmp_baseline_pinned") or st.session_state.get("cmp_baseline") not in chosen_lanes:
    st.session_state["cmp_baseline"] = default_baseline(chosen_table)
    st.session_state["cmp_baseline_pinned"] = False
left, right = st.columns([3, 1])
baseline = left.selectbox("Baseline lane", chosen_lanes, format_func=lane_labels.get, key="cmp_baseline",
                          on_change=lambda: st.session_state.update(cmp_baseline_pinned=True),
                          help="Speedup, memory ratio and loss Δ are measured against this lane "
                               "(by default the first 32-true lane).")
last_k = right.number_input("k (final-loss window)", min_value=1, max_value=1_000_000, value=FINAL_LOSS_WINDOW, step=1,
                            key="cmp_k", help="Final loss = mean of the last k steps' losses (inf/NaN left out).")

try:
    live = compare.live_run_ids(manager, chosen_runs)
except StoreError as error:
    st.error(f"The run store could not be read: {error}")
    st.stop()
if live:
    st.caption(f"{LIVE_MARK} {len(live)} of the chosen runs {'is' if len(live) == 1 else 'are'} still training: "
               f"this part refreshes every {LIVE_REFRESH_S:g} s.")


bands = st.session_state.setdefault("cmp_bands", compare.StepTimeBands())  # finished buckets' step-time figures


def compiled_lanes_section(series) -> None:
    """Compile time, graph breaks, recompiles and drift against eager for the compiled lanes among those shown."""
    run_ids = list(dict.fromkeys(lane.run_id for lane in series if compiled_views.has_compiled([lane.mode])))
    if not run_ids:
        return
    st.subheader("Compiled lanes")
    compiles, drift, drift_table = compiled_views.compiled_view(manager, run_ids)
    compiles, drift_table, verdicts = compiled_views.compare_tables(compiles, drift_table)
    st.dataframe(compiles, hide_index=True, key="cmp_compiled")
    st.caption(compiled_views.COMPILE_NOTE)
    if drift.empty:
        st.info("No drift to show: a compiled lane is measured against the eager lane of the same recipe and seed in "
                "the same run; race both (e.g. bf16-mixed and bf16-mixed+compile).")
        return
    st.dataframe(drift_table, hide_index=True, key="cmp_drift")
    for verdict in verdicts:
        st.markdown(f"- {verdict}")
    st.plotly_chart(compiled_views.drift_figure(drift, lane_labels), key="cmp_chart_drift")
    st.caption(compiled_views.DRIFT_NOTE)


# The comparison redraws itself every LIVE_REFRESH_S while a chosen run trains (the compiled lanes' section with it).
@st.fragment(run_every=LIVE_REFRESH_S if live else None)
@store_guarded
def comparison() -> None:
    # Each redraw reads the lanes through their multi-resolution summary (a few thousand points per figure, whatever
    # their length): every record is gathered only for a download, when it is asked for.
    try:
        series = compare.gather_lanes(manager, chosen_lanes)
        ended = live and not compare.live_run_ids(manager, chosen_runs)
    except StoreError as error:
        st.error(f"The run store could not be read: {error}")
        return
    if ended:
        st.rerun()  # the last live run just ended: redraw once without the timer
    present = compare.lane_keys(series)
    records = sum(lane.stats.records for lane in series)  # every rank's
    if not present:
        st.info("The chosen lanes have no steps yet. A run just launched writes its first steps within a second "
                "or two.")
        return
    missing = [lane_labels[key] for key in chosen_lanes if key not in present]
    if missing:
        st.warning(f"No steps recorded yet for: {', '.join(missing)}.")
    base = baseline
    if base not in present:
        base = default_baseline(series)
        st.warning(f"The baseline lane {lane_labels[baseline]} has no steps yet; comparing against "
                   f"{lane_labels.get(base, base)} for now.")

    st.subheader("Summary")
    summary = summarize(series, base, int(last_k))
    # The lane label already says the mode, and "diverged" says something only when a lane did: columns that
    # would only push the last ones off the page.
    table = compare.format_summary(summary, lane_labels, base, int(last_k)).drop(columns="mode")
    if not summary["diverged"].any():
        table = table.drop(columns="diverged")
    labels = {column: label for column, (label, _) in SUMMARY_HEADERS.items()}
    widths = content_widths(table, labels)
    st.dataframe(table, hide_index=True, key="cmp_summary", column_config={
        column: st.column_config.Column(labels.get(column, column), width=width,
                                        help=SUMMARY_HEADERS.get(column, (None, None))[1])
        for column, width in widths.items()})
    st.caption(f"★ baseline. Speedup = baseline median ms/step ÷ the lane's (above 1× is faster). Peak memory: the "
               f"CUDA allocator peak where there is one, else the bytes held (parameters + gradients + optimizer "
               f"state + activations saved for backward). Latest loss: the loss of the lane's last step (what the "
               f"Train page shows). Final loss: mean of the last {int(last_k)} steps' losses (inf/NaN left out), "
               "steadier than one step's; Δ: minus the baseline's. " + (
                   "Diverged: the last recorded loss is inf/NaN." if summary["diverged"].any() else
                   "No lane diverged (every last recorded loss is finite)."))
    if has_replicates(series, seeds):
        several_runs = len({lane.run_id for lane in series}) > 1
        replicates = replicate_table(series, seeds, int(last_k))
        st.markdown("**Across seeds** — each mode's seed replicates together")
        st.dataframe(compare.format_replicates(replicates, int(last_k), several_runs), hide_index=True,
                     key="cmp_replicates")
        for sentence in difference_sentences(replicate_differences(replicates), several_runs):
            st.markdown(f"- {sentence}")
        st.caption(f"Mean ± sample standard deviation across the seeds of each mode. Two modes are told apart when "
                   f"the gap is larger than the spread across seeds: {DIFFERENCE_RULE}. The charts draw each such "
                   f"mode as its mean across seeds inside the band from the lowest to the highest seed.")
    if summary["ranks"].max() > 1:  # torchrun jobs: each rank measured itself
        ranks = rank_table(series, int(last_k))
        keys = [lane_key(run_id, lane) for run_id, lane in zip(ranks["run_id"], ranks["lane"], strict=True)]
        ranks = ranks.drop(columns=["run_id", "lane", "mode"])
        ranks.insert(0, "lane", [lane_labels.get(key, key) for key in keys])
        st.dataframe(ranks, hide_index=True, key="cmp_rank_table")
        st.plotly_chart(plots.rank_step_time_figure(series), key="cmp_chart_ranks")
        st.caption("Lanes of torchrun jobs: ms/step in the summary is the median of the ranks' medians; each rank "
                   "is listed here (vs fastest: its median ÷ the fastest rank's). The charts below draw each lane's "
                   "first rank; the downloads hold every rank's records, with their `rank`.")
        series = [ranks_of_lane[0] for ranks_of_lane in by_lane(series).values()]
    if len({lane.run_id for lane in series}) > 1:
        st.caption(":orange[:material/warning:] These lanes come from different runs: they ran at different times, "
                   "maybe with different settings or with other runs beside them, so their speed compares less fairly "
                   "than lanes of one run (which take turns step by step).")

    compiled_lanes_section(series)

    st.subheader("Charts")
    c1, c2, c3 = st.columns(3)
    log_y = c1.toggle("Log loss axis", value=True, key="cmp_log_y")
    log_ms = c1.toggle("Log step-time axis", value=False, key="cmp_log_ms",
                       help="The median and band already keep one slow step from flattening the chart.")
    time_axis = c2.radio("Time axis", list(compare.TIME_AXES), horizontal=True, key="cmp_time_axis",
                         format_func={"compute": "at median speed", "wall": "wall clock"}.get,
                         help="At median speed: each lane's running sum of its median step time — what the mode "
                              "would take on its own at its typical speed (one stalled step adds its step's median, "
                              "not its own length). Lanes of one run take turns (A B C A B C), so their wall clocks "
                              "advance together.")
    raw = c3.toggle("Every step's time", key="cmp_raw_step_times",
                    help="The step-time chart draws each lane's median and p10-p90 band; this adds the measured "
                         "step times themselves.")
    figures = {
        "loss_vs_step": compare.loss_vs_step_figure(series, lane_labels, log_y=log_y, seeds=seeds),
        "loss_vs_time": compare.loss_vs_time_figure(series, lane_labels, time_axis=time_axis, log_y=log_y,
                                                    bands=bands, seeds=seeds),
        "step_time": compare.step_time_figure(series, lane_labels, raw=raw, log_y=log_ms, bands=bands, seeds=seeds),
        "memory": plots.memory_figure(series, lane_labels),
    }
    # Lanes inside a seed band are not drawn as lines of their own: none of them can hide another.
    banded = replicated_keys(series, seeds)
    for note in compare.overlap_notes([lane for lane in series if lane.key not in banded], lane_labels):
        st.info(note)
    for name, fig in figures.items():
        st.plotly_chart(fig, key=f"cmp_chart_{name}")
        if name == "loss_vs_step" and len(present) > 1:
            st.plotly_chart(compare.loss_difference_figure(series, base, lane_labels),
                            key="cmp_chart_loss_difference")
        if name == "loss_vs_time" and time_axis == "compute":
            st.caption("Time at median speed: each lane's step times are replaced by their rolling median before "
                       "they are summed, so a stall (a page redrawing, another program) does not stretch a lane.")

    st.subheader("Downloads")
    st.caption(f"{records:,} step records of {len(present)} lane(s), gathered when you ask for them. Charts download "
               "as standalone HTML with plotly.js inside (about 5 MB each; they open offline). A report is one "
               "self-contained HTML file per run: every chart, the summary, the configuration and the events, "
               "plotly.js inlined once; it opens offline and can be shared as it is.")

    def every_record():
        return compare.gather_steps(manager, chosen_lanes)

    downloads = [
        ("Records · CSV", lambda: compare.csv_bytes(every_record()), "amp_lab_records.csv", "text/csv", "csv"),
        ("Records · Parquet", lambda: compare.parquet_bytes(every_record()), "amp_lab_records.parquet",
         "application/vnd.apache.parquet", "parquet"),
        ("Summary · CSV", partial(compare.csv_bytes, summary), "amp_lab_summary.csv", "text/csv", "summary_csv"),
        *((f"{fig.layout.title.text} · HTML", partial(compare.figure_html, fig), f"amp_lab_{name}.html",
           "text/html", f"html_{name}") for name, fig in figures.items()),
        *((f"Report · HTML · {compare.short_run_id(run_id)}" if len(chosen_runs) > 1 else "Report · HTML",
           partial(report_bytes, run_id), f"amp_lab_report_{run_id}.html", "text/html", f"report_{run_id}")
          for run_id in dict.fromkeys(lane.run_id for lane in series)),
    ]
    columns = [column for _ in range(0, len(downloads), 3) for column in st.columns(3)][:len(downloads)]
    for column, (label, data, file_name, mime, key) in zip(columns, downloads, strict=True):
        # Built only when clicked: every record, or three inlined plotly.js pages, per refresh would be sent for
        # nothing.
        column.download_button(label, data, file_name=file_name, mime=mime, key=f"cmp_download_{key}",
                               on_click="ignore", width="stretch")


def report_bytes(run_id: str) -> bytes:
    """A run's self-contained HTML report (built when its button is clicked)."""
    return report.run_report_html(manager, run_id).encode()


comparison()
