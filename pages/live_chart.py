"""A live chart that receives only what changed: a Streamlit component drawing a plotly figure, fed ChartFeed's
updates (amp_core.views.chart_feed) — the points since its last draw, not the whole figure at every redraw.

The component's page (live_chart_frontend/index.html) loads plotly.js from the installed plotly package, copied beside
it into a folder of this machine's temp directory once per plotly version: nothing is fetched from a network, and a
component's files must lie under its own folder (Streamlit serves nothing outside it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import streamlit as st
import streamlit.components.v1 as components

from amp_core.views.chart_feed import ChartFeed

FRONTEND = Path(__file__).with_name("live_chart_frontend") / "index.html"
PLOTLY_JS = Path(importlib.util.find_spec("plotly").origin).parent / "package_data" / "plotly.min.js"


def _served_folder() -> Path:
    """The component's folder: its index.html and plotly's bundle, made once per version of either."""
    page = FRONTEND.read_bytes()
    tag = hashlib.sha256(page).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"amp-lab-live-chart-{importlib.metadata.version('plotly')}-{tag}"
    if not (folder / "index.html").exists():
        building = Path(tempfile.mkdtemp(prefix="amp-lab-live-chart-"))
        shutil.copyfile(PLOTLY_JS, building / "plotly.min.js")
        (building / "index.html").write_bytes(page)  # last: a folder with an index.html is complete
        try:
            os.replace(building, folder)
        except OSError:  # another process made it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    return folder


# Redraws that send a chart whole after the page was drawn or the chart asked (see ChartFeed.reset): a session's first
# three seconds, at most 3 × a figure's size once; a blank chart in a loaded room otherwise waited for its asks.
RESETS = 3

_component = components.declare_component("amp_live_chart", path=str(_served_folder()))


def live_chart(spec: dict, key: str, whole: bool = False, tag=None, shared=None) -> dict:
    """Draw `spec` (figure_spec's) in the live chart `key`, sending only what changed since this session's last draw
    of it; `whole`: send the whole figure (the page was drawn anew). `tag` and `shared`: see ChartFeed.update (the
    changes between two ticks' figures computed once for the sessions that drew alike). Returns the update sent."""
    feeds: dict[str, ChartFeed] = st.session_state.setdefault("live_chart_feeds", {})
    handled: dict[str, object] = st.session_state.setdefault("live_chart_resets", {})
    feed = feeds.setdefault(key, ChartFeed())
    asked = (st.session_state.get(key) or {}).get("reset")  # the chart lost its place and asked for the whole figure
    if whole or (asked is not None and asked != handled.get(key)):
        handled[key] = asked
        feed.reset(times=RESETS)
    update = feed.update(spec, tag, shared)
    _component(update=update, key=key, default=None)
    return update
