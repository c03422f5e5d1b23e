"""What every page shares: the server's warm-up (heavy imports off the first paint), the process-wide RunManager and
cost probes (one per server, every tab sees every run), the device facts, pickers.

Importing this module is light (no torch, pandas or plotly): the Train page draws its form from it and from
amp_core.catalog while the warm-up imports the rest on a background thread.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import streamlit as st
from streamlit.logger import get_logger

from amp_core import background, imports

imports.serialize_every_parse()  # every session's page scripts and torch parse on threads of this one process

if TYPE_CHECKING:
    import pandas as pd

    from amp_core import Sharing
    from amp_core.diagnostics import ProbeBoard
    from amp_core.race import RunManager

# Marks in Streamlit's own icon font (Markdown only): an emoji needs an emoji font, which a plain Linux box may lack
# (Debian's Chromium with no emoji font drew each as an empty box). Plain-text labels (a picker's options, a table's
# cells) say the status in words.
LIVE_MARK = ":green[:material/radio_button_checked:]"
"""Before a page's "live: redrawn every ..." caption."""
CORE_MODULES = ("amp_core.config", "amp_core.precision", "amp_core.workloads")
"""What the Train form needs beyond the light catalog: which modes this device runs (imports torch), and the workload
plugins named in $AMP_LAB_WORKLOADS (loaded once per server, never from anything typed on a page)."""
OTHER_MODULES = ("pandas", "plotly.graph_objects", "amp_core.records.store", "amp_core.race.runner",
                 "amp_core.diagnostics.cost", "amp_core.views.summary", "amp_core.views.plots", "amp_core.views.live",
                 "amp_core.views.compare", "amp_core.views.tables")
"""The rest of what the Train and Compare pages draw with."""
PAINT_WAIT_S = 2.0
"""The longest the warm-up waits for the first page to draw before it imports (a page that fails before it says so)."""
PAINT_SETTLE_S = 0.5
"""Then how long it leaves the browser to fetch the code of the page's widgets from this server (a request each)."""
PAGE_FAILED = "could not be drawn"
"""In the one line a page (or a live part of it) shows instead of a traceback when drawing it raised (page_failed)."""
LOG = get_logger("amp_lab.pages")
"""The server's log (Streamlit's format, on the server's output): where a page's failure goes with its stack."""


@dataclass(frozen=True, slots=True)
class DeviceFacts:
    """What this machine can do, as the sidebar and the mode picker show it."""

    device: str
    name: str
    torch: str
    modes: dict[str, tuple[bool, str]]
    """Every mode: (runs here, a note: why not, or a caveat)."""
    runnable: list[str]
    defaults: list[str]
    native_note: str = ""
    """Set when AMP_LAB_CPU_NATIVE decides which 16-bit formats count as native (or holds a value it does not take)."""
    native_refused: bool = False
    """AMP_LAB_CPU_NATIVE holds a value it does not take: the 16-bit CPU modes are refused until it is mended."""


def read_device_facts() -> DeviceFacts:
    from amp_core.precision import (
        MODES,
        availability,
        cpu_math,
        default_modes,
        device_name,
        resolve_device,
        torch_version,
    )

    device = resolve_device("auto")
    modes = {mode: availability(mode, device) for mode in MODES}
    runnable = [mode for mode, (ok, _) in modes.items() if ok]
    try:
        native_note, refused = (cpu_math().note() if device == "cpu" else ""), False
    except ValueError as error:
        native_note, refused = f"{error}. The 16-bit modes are refused here until it is mended.", True
    return DeviceFacts(device, device_name(device), torch_version(), modes, runnable,
                       [mode for mode in default_modes(device) if mode in runnable], native_note, refused)


class WarmUp:
    """The server's imports and device facts, made on a background thread that the first script run starts: the
    first page is drawn from light data meanwhile. `core` is set once the device facts are read (torch imported),
    `done` once everything the pages draw with is imported (torch's compiler stack and torchao follow, through the
    import gate: amp_core.imports). Then the objects imported so far are frozen out of the garbage collector's full
    passes: each would otherwise walk torch's objects while holding the GIL a training thread needs.

    The imports wait until the first page has drawn what it can without them (`painted`, set when a page first waits
    for them) and the browser has fetched what it needs to show it: importing torch holds the interpreter for
    seconds (up to a second at a stretch while its libraries load), and the first paint's script run and the
    server's loop that sends it and serves the browser the widgets' code would get only a share of it meanwhile."""

    def __init__(self):
        self.core, self.done, self.painted = threading.Event(), threading.Event(), threading.Event()
        self.facts: DeviceFacts | None = None
        self.plugin_problems: list = []
        """PluginProblem of each plugin module that did not load (the built-ins and other plugins still work)."""
        self.started = time.monotonic()
        background.start(self._work, "amp-warm-up")

    def _work(self) -> None:
        if self.painted.wait(PAINT_WAIT_S):
            time.sleep(PAINT_SETTLE_S)
        try:
            for name in CORE_MODULES:
                importlib.import_module(name)
            from amp_core.workloads import load_plugins, plugin_modules

            self.plugin_problems = load_plugins(plugin_modules())
            self.facts = read_device_facts()
        finally:
            self.core.set()
        try:
            for name in OTHER_MODULES:
                importlib.import_module(name)
            gc.collect()
            gc.freeze()
        finally:
            self.done.set()
        # Then torch's compiler stack and torchao, through the import gate: sessions arriving together would
        # otherwise import them from several threads at once (they import in cycles). A page that needs one meanwhile
        # waits at the gate, under a "loading" note (loading_note).
        try:
            imports.warm()
        except imports.ImportBroken as broken:  # each page that needs it says so, at its edge
            LOG.error("the warm-up's imports failed", exc_info=broken)
        gc.collect()
        gc.freeze()

    def wait_core(self) -> None:
        """Wait for torch and the device facts (a page that waits has drawn all it can without them)."""
        self.painted.set()
        self.core.wait()

    def device_facts(self) -> DeviceFacts:
        """The facts, once read (waits for the warm-up's first part; reads them here if it failed, to raise why)."""
        self.wait_core()
        return self.facts or read_device_facts()


_THIS_RUN = threading.local()
"""Per script thread: `framed` while app.py runs the page (a session's script runs on its own thread)."""


@contextlib.contextmanager
def framed():
    """app.py runs the page inside this: the page's app_frame() then knows it is drawn inside the app's frame."""
    _THIS_RUN.framed = True
    try:
        yield
    finally:
        _THIS_RUN.framed = False


def app_frame() -> None:
    """Draw this page inside app.py's frame (sidebar, wide layout, device panel); every page calls it first.

    Streamlit reads a pages/ folder the old way until an app's st.navigation has run once in the server: a page opened
    by its own URL first (a bookmark, a reload after a restart) then runs alone, narrow and without the sidebar. Here
    that is put right: say st.navigation has taken over (what its first run would set) and run again, so that app.py
    draws the frame and the page the URL names. Streamlit's own switch (1.67, pinned); nothing else reads it. Whether
    this run is framed is asked of this run (`framed`), not of the switch: sessions that opened their pages at the same
    moment all started alone, and the first to get here turns the switch for all of them."""
    from streamlit.runtime.pages_manager import PagesManager

    if not getattr(_THIS_RUN, "framed", False) and not _under_app_test():
        PagesManager.uses_pages_directory = False
        st.rerun()


def _under_app_test() -> bool:
    """Streamlit's AppTest sets the switch back before every run it makes (and then runs a page alone): a rerun
    there would drop the click that started the run, and there is no browser whose layout it would mend."""
    from unittest.mock import Mock

    from streamlit.runtime import Runtime

    return isinstance(getattr(Runtime, "_instance", None), Mock)


@st.cache_resource(show_spinner=False)
def warm_up() -> WarmUp:
    """The server's one warm-up, started by the first script run of any session."""
    return WarmUp()


@st.cache_resource(show_spinner=False)
def get_manager() -> RunManager:
    """The one RunManager of this server (its store at $AMP_LAB_STORE or ~/.amp_lab/runs.sqlite3)."""
    from amp_core.race import RunManager
    from amp_core.records import StoreError, open_store

    try:
        return RunManager(open_store())
    except StoreError as exc:  # a damaged or foreign file: keep it untouched, run in memory, say why
        return RunManager(None, store_error=str(exc))


@st.cache_resource(show_spinner=False)
def probe_board() -> ProbeBoard:
    """The server's cost probes (raced off the page's thread, remembered for the server's life)."""
    from amp_core.diagnostics import ProbeBoard

    return ProbeBoard()


STORE_RECHECK_S = 3.0
"""How often a page that found the store's server unreachable looks again."""


def unreachable_notice(exc: Exception) -> None:
    st.warning(f"{exc}. Runs in this server's memory go on; this page draws again by itself once the store answers "
               f"(it looks every {STORE_RECHECK_S:.0f} s).", icon=":material/cloud_off:")


def failure_line(what: str, error: BaseException) -> str:
    """The one line a page shows for `error` raised while drawing `what`: what failed, why in brief, what to do."""
    if isinstance(error, imports.ImportBroken):
        return f"{what} {PAGE_FAILED}: {error}."
    words = " ".join(str(error).split())
    why = f"{type(error).__name__}: {words[:240]}{'…' if len(words) > 240 else ''}" if words else type(error).__name__
    return (f"{what} {PAGE_FAILED} ({why}). The server's log has the details; reload the page to try again, and "
            "restart the server if it keeps failing.")


def page_failed(what: str, error: BaseException) -> None:
    """Say in one line that drawing `what` raised `error`, and log it with its stack: never a traceback on a page.
    The next draw runs the page again from the top."""
    LOG.error("%s %s", what, PAGE_FAILED, exc_info=error)
    st.error(failure_line(what, error), icon=":material/error:")


def loading_note() -> None:
    """A short note while the import gate is busy (a fresh server's warm-up importing torch's compiler stack): a page
    that needs it waits at the gate meanwhile. A toast, gone by itself: a note on the page would have to be cleared
    after the page, and a page that ends with st.stop() draws nothing more."""
    busy = imports.importing()
    if busy is not None:
        st.toast(f"Loading `{busy}` (a fresh server imports it once)…", icon=":material/hourglass_top:",
                 duration="long")


def store_guarded(draw):
    """A view (a live fragment's body) guarded as app.py guards a page: the store's server unreachable is said as
    such, anything else in one line with its stack in the server's log (page_failed); with no traceback either way,
    and its next run tries again. Every fragment's body goes through it: a fragment's own reruns run outside app.py's
    edge. (Streamlit's st.rerun / st.stop raise BaseExceptions and pass through.)"""

    @functools.wraps(draw)
    def guarded(*args, **kwargs):
        from amp_core.records import StoreUnreachable

        try:
            return draw(*args, **kwargs)
        except StoreUnreachable as exc:
            unreachable_notice(exc)
        except Exception as error:
            page_failed("This part of the page", error)
        return None

    return guarded


def wait_for_store(exc: Exception) -> None:
    """A page that could not draw because the store's server is unreachable: say so, and rerun it once it answers."""
    unreachable_notice(exc)

    @st.fragment(run_every=STORE_RECHECK_S)
    @store_guarded
    def watch() -> None:
        store = get_manager().store
        if store is None or store.reachable():
            st.rerun(scope="app")

    watch()


def store_panel(manager: RunManager) -> None:
    """The sidebar's word on where runs are kept (a PostgreSQL URL without its password)."""
    if manager.store is not None:
        st.caption(f"Store · `{manager.store.location}`")


def store_banner(manager: RunManager) -> None:
    """A clear message when the store could not be opened (runs then live in memory only)."""
    if manager.store_error:
        st.error(f"The run store could not be opened, so runs are kept in memory only: {manager.store_error}")


def device_panel(facts: DeviceFacts) -> None:
    """The sidebar's device facts: the device, torch, and each mode's note (modes sharing a note on one line)."""
    from amp_core.precision import MODE_HELP, MODES

    st.markdown(f"**Device** · {facts.name}")
    st.caption(f"torch {facts.torch} · runs on `{facts.device}`")
    if facts.native_refused:
        st.error(facts.native_note)
    elif facts.native_note:
        st.caption(facts.native_note)
    notes: dict[tuple[bool, str], list[str]] = {}
    for mode, (ok, reason) in facts.modes.items():
        note = reason if not ok or "slower" in reason or "native" in reason else "ok"
        notes.setdefault((ok, note), []).append(f"`{mode}`")
    lines = [f"- {'✓' if ok else '✗'} {', '.join(modes)} — {note}" for (ok, note), modes in notes.items()]
    st.markdown("**Precision modes here**\n" + "\n".join(lines),
                help="\n\n".join(f"**{mode}**: {MODE_HELP[mode]}" for mode in MODES))


def plugin_panel(warm: WarmUp) -> None:
    """The sidebar's word on workload plugins: each that failed to load and why, the ones that joined."""
    from amp_core.workloads import PLUGIN_ORIGINS, PLUGINS_ENV

    for problem in warm.plugin_problems:
        st.error(f"Workload plugin `{problem.module}` was not loaded: {problem.why}. The built-in workloads and the "
                 f"other plugins work as before (plugins come from `{PLUGINS_ENV}` at start-up).")
    if PLUGIN_ORIGINS:
        st.caption("Plugin workloads: " + ", ".join(f"`{name}` ({module})" for name, module in PLUGIN_ORIGINS.items()))


# --- sharing: who may start work or change a run (amp_core.access decides; each control is gated where drawn) ---
VISITORS_REFRESH_S = 5.0
"""How often the presenter's sidebar counts the visitors again (only while the server is shared)."""


def server_sharing() -> Sharing:
    """How this server is shared: $AMP_LAB_SHARE (set by `amp-lab ui --share`) and the address it listens on."""
    from amp_core import sharing

    return sharing(os.environ, st.get_option("server.address"))


def connection_peer() -> str | None:
    """The address this session's browser connected from, as the server's own socket saw it (never a header).

    st.context.ip_address reads it but gives None both for a loopback peer and for a session with no connection behind
    it (AppTest), which the decision must tell apart: when it is None, Streamlit's session client is asked for the same
    field unnormalised (ClientContext.remote_ip in Streamlit 1.67; Streamlit's own backend operations read it as the
    TCP peer). If that ever moves, the answer is None: unknown, so in a shared server nobody controls — never the
    other way round."""
    public = st.context.ip_address
    if public is not None:
        return public
    from streamlit.runtime import Runtime
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    if ctx is None or not Runtime.exists():
        return None
    client = Runtime.instance().get_client(ctx.session_id)
    peer = getattr(getattr(client, "client_context", None), "remote_ip", None)
    return peer if isinstance(peer, str) else None


def can_control() -> bool:
    """May this browser start work or change a run (launch, pause, stop, faults, replays, probes, requests)? Always when
    the server is not shared; when it is, only a direct connection from this machine (or everyone with
    --remote-control). Draw a control only where this is True, and control_note() in its place otherwise: a widget
    that is not drawn cannot be triggered."""
    from amp_core import is_loopback, may_control, was_proxied

    share = server_sharing()
    if not share.shared or share.remote_control:
        return True
    peer = connection_peer()
    # The headers are read only for a loopback peer, and can only take control away (a relayed connection).
    proxied = is_loopback(peer) and was_proxied(st.context.headers.keys())
    return may_control(share, peer, proxied)


def control_note() -> None:
    """The one line a visitor sees where a control would be."""
    from amp_core import PRESENTER_NOTE

    st.caption(f":material/visibility: {PRESENTER_NOTE}")


def connected_peers() -> list[str | None] | None:
    """The address of every connected session (browser tab) of this server, or None where it cannot be read.

    Streamlit 1.67 has no public list of sessions: this reads its runtime's session manager (private), here and
    nowhere else; if that moves, the sidebar says it cannot count rather than failing."""
    from streamlit.runtime import Runtime

    try:
        sessions = list(Runtime.instance()._session_mgr.list_active_sessions())
        peers = [getattr(getattr(info.client, "client_context", None), "remote_ip", None) for info in sessions]
    except (AttributeError, RuntimeError, TypeError):
        return None
    return [peer if isinstance(peer, str) else None for peer in peers]


def sharing_panel() -> None:
    """The sidebar's word on sharing: a visitor is watching (read-only); the presenter sees how many visitors are."""
    share = server_sharing()
    if not share.shared:
        return
    if not can_control():
        st.markdown(":material/visibility: **watching (read-only)**")
        st.caption("This machine's presenter controls the runs; every run, chart and export is yours to look at.")
        return
    if share.problem:
        st.error(share.problem)
    if share.remote_control:
        st.warning("Shared with remote control: anyone who can reach this port can launch, pause and stop runs here.",
                   icon=":material/warning:")
        return

    def visitors() -> None:
        from amp_core import visitor_count

        peers = connected_peers()
        if peers is None:
            st.caption(":material/groups: Shared: visitors watch read-only (this Streamlit does not say how many).")
            return
        people, sessions = visitor_count(peers)
        tabs = f" ({sessions} tabs)" if sessions != people else ""
        st.caption(f":material/groups: Shared: **{people} visitor{'' if people == 1 else 's'}** watching "
                   f"read-only{tabs}; only this machine controls the runs.")

    st.fragment(store_guarded(visitors), run_every=VISITORS_REFRESH_S)()


def live_lane_probe(prefix: str, verb: str, what: str, probe, state_key: str):
    """Widgets to probe a running lane of a live run in this process (`verb` "trace" / "probe", `what` says what the
    click does): `probe(run, lane_index)` on the click, kept in session state under `state_key`; returns the result
    of the last click, or None. A lane that ends meanwhile, or a probe that fails, gets a message, not a traceback."""
    from amp_core.config import ConfigError
    from amp_core.race import is_compiled_recipe

    lanes = {f"run {run.run_id} · lane {lane.index} · {lane.mode} ({lane.status})": (run, lane.index)
             for run in get_manager().runs() if run.alive for lane in run.lanes if lane.status == "running"}
    if not lanes:
        st.info(f"No live runs: launch one on the Train page, then {verb} any of its running lanes here "
                "(a finished lane has freed its model).")
        return None
    choice = st.selectbox("Lane", list(lanes), key=f"{prefix}_lane")
    if is_compiled_recipe(lanes[choice][0].lanes[lanes[choice][1]].mode):
        st.caption(f"This lane is compiled (`+compile`): the {verb} runs on an eager copy with the same weights "
                   "(a copy of a compiled module is eager). The op inspector's compiled view shows what inductor "
                   "made of the step.")
    if not can_control():  # a probe copies a live lane's weights: the presenter's CPU and memory
        control_note()
        return None
    if st.button(f"{verb.capitalize()} this lane now", key=f"{prefix}_{verb}_lane",
                 help=f"{what} The lane's parameters, gradients, optimizer and scaler are not touched."):
        run, index = lanes[choice]
        try:
            st.session_state[state_key] = probe(run, index)
        except (ConfigError, ValueError, LookupError, RuntimeError) as error:
            st.error(f"Cannot {verb} this lane: {str(error).splitlines()[0]}")
    return st.session_state.get(state_key)


RECIPE_OPTIONS_HELP = ("Optional `+OPTION`s after the mode, as a lane's recipe is written: `+keep:GLOB` (modules "
                       "computed in fp32), `+fp8-rowwise`, `+mxfp8`, `+plan:FILE` (a format per module), … Empty: the "
                       "mode alone. A recipe that cannot run here is refused in one line, as at launch.")


def with_options(mode: str, options: str) -> str:
    """`mode` followed by the recipe options typed for it (`+keep:fc2+fp8-rowwise`; the first `+` may be left out)."""
    options = options.strip().lstrip("+").strip()
    return f"{mode}+{options}" if options else mode


def recipe_of(mode: str, where, key: str, placeholder: str = "+keep:fc2") -> str:
    """`mode` with the recipe options typed in a box drawn in `where` (a column, or `st`). The presenter's only: a
    visitor's probe runs on the presenter's machine, and an option such as `+plan:FILE` reads a file there."""
    if not can_control():
        return mode
    return with_options(mode, where.text_input("Recipe options", key=key, placeholder=placeholder,
                                               help=RECIPE_OPTIONS_HELP))


def run_label(row: pd.Series, status: bool = True) -> str:
    """A run as pickers list it: its name first (`amp-lab list` shows the same), or its id when it has none; `status`
    False leaves its status out (for a page that shows it live elsewhere)."""
    when = time.strftime("%m-%d %H:%M:%S", time.localtime(row["created_at"]))
    name = f"{row.get('name') or row['run_id']} · "
    tail = f" · {row['status']}" if status else ""
    return f"{name}{row['workload']} · {', '.join(row['modes'])} · {when}{tail}"


def run_picker(manager: RunManager, key: str, label: str = "Run", default: str | None = None,
               status: bool = True) -> str | None:
    """A selectbox over every run (live and stored, newest first); returns the run_id or None if there are none."""
    runs = manager.list_runs()
    if runs.empty:
        return None
    ids = runs["run_id"].tolist()
    labels = dict(zip(ids, (run_label(row, status) for _, row in runs.iterrows()), strict=True))
    index = ids.index(default) if default in ids else 0
    return fresh_selectbox(label, ids, labels, key, index=index)


def fresh_selectbox(label: str, options: list, labels: dict, key: str, **kwargs):
    """st.selectbox whose options are shown as `labels[option]`, and whose chosen option shows its label as it is now.

    A label that changes while its option stays chosen (a run's status: running, then finished) would otherwise stay
    as it was in the browser: Streamlit keeps the chosen value and sends the new labels, but the box goes on showing
    the text the browser last drew. Setting the value again makes Streamlit send it, with the new text."""
    chosen, shown = st.session_state.get(key), st.session_state.get(f"{key}__label")
    if chosen in labels and shown is not None and shown != labels[chosen]:
        st.session_state[key] = chosen
        kwargs.pop("index", None)  # the value comes from the session state (both would earn a warning on the page)
    value = st.selectbox(label, options, format_func=labels.get, key=key, **kwargs)
    st.session_state[f"{key}__label"] = labels.get(value)
    return value


PRESENTER_KEY = "presenter"
"""Session state: the presenter view is on (the Workshop page's toggle sets it; any page may honour it)."""
PRESENTER_CSS = """<style>
[data-testid="stSidebar"], [data-testid="stSidebarCollapsedControl"] { display: none; }
.stMain .block-container { max-width: 1320px; padding-top: 1.5rem; }
.stMain [data-testid="stMarkdownContainer"] p, .stMain [data-testid="stMarkdownContainer"] li,
.stMain [data-testid="stAlertContentInfo"] p, .stMain label p { font-size: 1.45rem; line-height: 1.45; }
.stMain h1 { font-size: 3rem; }
.stMain h2, .stMain h3 { font-size: 2.3rem; }
.stMain [data-testid="stTable"] td, .stMain [data-testid="stTable"] th { font-size: 1.25rem; }
.stMain button p { font-size: 1.35rem; }
.stMain [data-testid="stSelectbox"] input { font-size: 1.35rem; }
.stMain [data-testid="stCaptionContainer"] { font-size: 1.1rem; }
</style>"""
"""The presenter view's page styling: large text, no sidebar, the page as wide as a 1280-px projector."""


def presenter_on() -> bool:
    return bool(st.session_state.get(PRESENTER_KEY, False))


def presenter_style() -> None:
    """Apply the presenter view's styling to this page (call once per script run while it is on)."""
    st.html(PRESENTER_CSS)


def attached_request(prefix: str, kind: str, run_id: str, live: bool) -> tuple[int, dict] | None:
    """A button asking an attached run's process for `kind` at its next step (amp_core.records.requests), and where
    the last request from this page stands: waiting, refused, or its process gone, each said in words. Returns the
    last request's id and its answer's data once it has arrived, else None. The caller redraws it (a fragment) while
    the run is live."""
    from amp_core.records import requests

    store = get_manager().store
    key = f"{prefix}_request_{run_id}"
    if store is None:
        st.info("Requests go through the store, and this server has none.")
        return None
    if not can_control():  # a request is work for the user's own training process
        control_note()
        return None
    if st.button(requests.KINDS[kind].capitalize(), key=f"{prefix}_ask_{kind}", disabled=not live,
                 help="Written to the store; the run's process reads it at its next flush and answers at its next "
                      "step." if live else "The run has ended: no process is left to ask."):
        try:
            st.session_state[key] = requests.ask(store, run_id, kind)
        except requests.RequestRefused as refused:
            st.warning(f"Not asked: {refused}.")
    if not live and key not in st.session_state:
        st.caption("This run has ended: requests go to a live attached run's process.")
    request_id = st.session_state.get(key)
    if request_id is None:
        return None
    current = requests.state(store, request_id)
    if current is None:
        st.warning("The request is gone from the store.")
    elif current.status == "answered":
        st.success(f"Answered: {current.message}.")
        return request_id, current.answer
    elif current.status in ("refused", "gone"):
        st.warning(f"Not answered: {current.message}.")
    else:
        st.info(f"Asked ({requests.KINDS[current.kind]}): "
                + ("waiting for the process to read it at its next flush…" if current.status == "open" else
                   "the process took it and answers after its next step…"))
    return None


def first_nonfinite_list(events: pd.DataFrame, key: str, lane: int | None = None) -> bool:
    """An attached run's first inf/NaN events (amp_core.probes.layerwatch), the newest three as messages and all as a
    table (`lane`: that lane's only); False when there are none."""
    from amp_core.views.numerics import first_nonfinite_events

    first = first_nonfinite_events(events, lane)
    if first.empty:
        return False
    st.markdown("**First inf/NaN of each failed step**")
    for message in first["message"].head(3):
        st.error(message, icon=":material/local_fire_department:")
    st.dataframe(first.drop(columns="message"), hide_index=True, key=key)
    return True
