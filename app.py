"""AMP Lab: the Streamlit entry point — page router plus the shared frame (what this machine can do)."""

from __future__ import annotations

import streamlit as st

from amp_core.precision import MODE_HELP, MODES, availability, device_name, resolve_device, torch_version
from amp_core.workloads import PLUGIN_ORIGINS, PLUGINS_ENV, PluginProblem, load_plugins, plugin_modules
from pages.common import get_manager, store_banner

st.set_page_config(page_title="AMP Lab", page_icon="🧪", layout="wide")


@st.cache_data
def device_facts() -> dict:
    device = resolve_device("auto")
    return {"device": device, "name": device_name(device), "torch": torch_version(),
            "modes": {mode: availability(mode, device) for mode in MODES}}


@st.cache_resource
def plugin_problems() -> list[PluginProblem]:
    """Workload plugins named in $AMP_LAB_WORKLOADS, loaded once per server (never from anything typed here)."""
    return load_plugins(plugin_modules())


def sidebar(pages: list) -> None:
    facts = device_facts()
    with st.sidebar:
        # Our own links: .streamlit/config.toml hides Streamlit's, which would list every file in pages/ at first.
        for page in pages:
            st.page_link(page)
        st.divider()
        st.markdown(f"**Device** · {facts['name']}")
        st.caption(f"torch {facts['torch']} · runs on `{facts['device']}`")
        lines = []
        for mode, (ok, reason) in facts["modes"].items():
            mark = "✓" if ok else "✗"
            note = reason if not ok or "slower" in reason or "native" in reason else "ok"
            lines.append(f"- {mark} `{mode}` — {note}")
        st.markdown("**Precision modes here**\n" + "\n".join(lines), help="\n\n".join(
            f"**{m}**: {MODE_HELP[m]}" for m in MODES))
        for problem in plugin_problems():
            st.error(f"Workload plugin `{problem.module}` was not loaded: {problem.why}. The built-in workloads "
                     f"and the other plugins work as before (plugins come from `{PLUGINS_ENV}` at start-up).")
        if PLUGIN_ORIGINS:
            st.caption("Plugin workloads: " + ", ".join(f"`{name}` ({module})"
                                                        for name, module in PLUGIN_ORIGINS.items()))


manager = get_manager()
pages = [
    st.Page("pages/train.py", title="Train", icon=":material/model_training:", default=True),
    st.Page("pages/compare.py", title="Compare", icon=":material/compare_arrows:"),
    st.Page("pages/op_inspector.py", title="Op inspector", icon=":material/biotech:"),
    st.Page("pages/layer_numerics.py", title="Layer numerics", icon=":material/stacked_bar_chart:"),
    st.Page("pages/overflow_debugger.py", title="Overflow debugger", icon=":material/local_fire_department:"),
    st.Page("pages/formats.py", title="Formats", icon=":material/pin:"),
]
navigation = st.navigation(pages, position="hidden")
sidebar(pages)
store_banner(manager)
navigation.run()
