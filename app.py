"""AMP Lab: the Streamlit entry point — page router plus the shared frame (what this machine can do).

The first script run of a server starts the warm-up (torch and the views, imported on a background thread) and draws
the Train page's form from light data meanwhile; the device facts join the sidebar as soon as they are read.
"""

from __future__ import annotations

import streamlit as st

from pages.common import (
    device_panel,
    framed,
    get_manager,
    loading_note,
    page_failed,
    plugin_panel,
    sharing_panel,
    store_banner,
    store_panel,
    wait_for_store,
    warm_up,
)

st.set_page_config(page_title="AMP Lab", page_icon=":material/science:", layout="wide")

warm = warm_up()
pages = [
    st.Page("pages/train.py", title="Train", icon=":material/model_training:", default=True),
    st.Page("pages/workshop.py", title="Workshop", icon=":material/school:"),
    st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("pages/op_inspector.py", title="Op inspector", icon=":material/biotech:"),
    st.Page("pages/layer_numerics.py", title="Layer numerics", icon=":material/stacked_bar_chart:"),
    st.Page("pages/overflow_debugger.py", title="Overflow debugger", icon=":material/local_fire_department:"),
    st.Page("pages/formats.py", title="Formats", icon=":material/pin:"),
    st.Page("pages/advise.py", title="Advise", icon=":material/recommend:"),
]
navigation = st.navigation(pages, position="hidden")
# Only the Train page draws before torch is imported; every other page needs it for its first line anyway.
light_first = navigation.title == "Train" and not warm.done.is_set()


def sidebar() -> None:
    with st.sidebar:
        # Our own links: .streamlit/config.toml hides Streamlit's, which would list every file in pages/ at first.
        for page in pages:
            st.page_link(page)
        sharing_panel()  # a visitor of a shared server: watching (read-only); the presenter: how many visitors
        st.divider()
        device_slot = st.empty()
    if light_first and not warm.core.is_set():
        device_slot.caption("Device · checking what this machine runs (PyTorch is loading)…")
        st.session_state["device_slot"] = device_slot  # the Train page fills it once the facts are read
    else:
        with device_slot.container():
            device_panel(warm.device_facts())
            plugin_panel(warm)
            store_panel(get_manager())
    if not light_first:
        store_banner(get_manager())  # (the Train page says it itself when it draws light first)


def edge(what: str, draw) -> None:
    """The page's edge: never a traceback on a page (st.rerun / st.stop are BaseExceptions and pass through)."""
    try:
        draw()
    except Exception as exc:
        from amp_core.records import StoreUnreachable

        if isinstance(exc, StoreUnreachable):  # the store's server unreachable: the page redraws once it answers
            wait_for_store(exc)
        else:  # one line on the page, the stack in the server's log; the next draw runs the page again
            page_failed(what, exc)


def draw_page() -> None:
    with framed():  # the page's app_frame() knows it is drawn in this frame
        navigation.run()


edge("The sidebar", sidebar)  # the frame too: a failure there says one line, and the page below still draws
loading_note()
edge(f"The {navigation.title} page", draw_page)
