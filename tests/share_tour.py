"""The browsers' tour of a shared dashboard (tests/test_sharing_browser.py): the presenter's Chromium on this machine
(over loopback) and a visitor's Chromium inside a network namespace, both driven from the test's own process.

`launch_run` launches a long run from the Train page (the presenter's, so that every page has a live run); `visit`
opens one page at 1440x900 and reads, per page, the text of every button drawn (st.button, form and download buttons),
how many times the presenter's note is drawn, the sidebar's text, tracebacks drawn, and for the Train page the loss
chart's last step at two moments (a live run followed draws later steps); plus a screenshot, OUT/ROLE_PAGE.png.
`pause_run` and `stop_run` press the presenter's Pause and Stop.
"""

from __future__ import annotations

import os
from pathlib import Path

from amp_core.precision import default_modes
from tests.test_browser import CHROMIUM, PLOTS, SETTLED

VIEWPORT = {"width": 1440, "height": 900}
PAGES = {"train": ("", "Train"), "workshop": ("workshop", "Workshop"), "compare": ("compare", "Compare runs"),
         "op_inspector": ("op_inspector", "Op inspector"), "layer_numerics": ("layer_numerics", "Layer numerics"),
         "overflow_debugger": ("overflow_debugger", "Overflow debugger"), "formats": ("formats", "Number formats")}
"""Each page: its URL path and its title."""
PRESENTER_PAGES = ("train", "workshop", "op_inspector", "layer_numerics", "overflow_debugger")
"""The pages with controls: the presenter's tour (Compare and Formats start no work for anyone)."""
LIVE_LANE_PAGES = {"op_inspector": "A live lane", "layer_numerics": "A live lane"}
"""Pages whose live-lane probe is behind a radio choice: the tour picks it."""
NOTE = "This machine's presenter controls the runs"
READ_ONLY_BUTTONS = {"Use preset", "Add lane", "Reset the form"}
"""Buttons a visitor may press: they fill (or reset) the Train page's form in the visitor's own session (no Launch
there)."""
# Train's "Find the largest batch" is in its folded recipes section, drawn only while open (test_sharing checks it
# there, presenter only).
CONTROLS = {"train": {"Launch", "Pause", "Stop"}, "workshop": {"Launch"},
            "op_inspector": {"Trace this lane now"}, "layer_numerics": {"Launch", "Probe this lane now"},
            "overflow_debugger": {"Launch demo run", "Replay"}}
"""The controls each page draws for the presenter while a run of this server is live (training, or paused)."""
LAUNCH_STEPS = 200_000
"""The launched run's steps: it lasts the whole test (paused once both browsers have watched it train, stopped at the
end)."""
LAUNCH_BATCH = 8
"""A small batch: the run shares a busy machine with both browsers."""
BUTTONS = """() => Array.from(document.querySelectorAll(['stMain', 'stSidebarUserContent']
        .map(area => `[data-testid="${area}"] [data-testid^="stBaseButton"]`).join(', ')))
    .filter(button => button.dataset.testid !== 'stBaseButton-elementToolbar')
    .map(button => (button.closest('[data-testid="stDownloadButton"]') ? 'download: ' : '')
        + ((button.querySelector('[data-testid="stMarkdownContainer"]') || button).textContent.trim()
           || button.getAttribute('aria-label') || '(no label)'))"""
"""The page's and the sidebar's buttons (not Streamlit's own header, nor a table's toolbar): their label (an icon's
name left out), a download button's marked "download: "."""
LAST_STEP = f"""() => {{
    const plot = ({PLOTS})().find(div => ((div.layout && div.layout.title && div.layout.title.text) || '')
        .includes('Loss'));
    if (!plot || !plot._fullData) return 0;
    const drawn = plot._fullData.filter(trace => trace.x && trace.x.length);
    return Math.max(0, ...drawn.map(trace => Number(trace.x[trace.x.length - 1])));
}}"""
"""The last step the loss chart draws (a live run's, in its frame): a long run's chart is decimated, so its point count
stops growing."""


def chromium_in(namespace: str, folder: Path) -> Path:
    """An executable that starts Chromium inside network `namespace` (`ip netns exec` keeps the pipe Playwright
    drives it through): a browser launched with it reaches nothing but the namespace's own addresses."""
    wrapper = folder / "chromium-in-namespace"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {namespace} {CHROMIUM} "$@"\n')
    os.chmod(wrapper, 0o755)
    return wrapper


def open_page(page, url: str, name: str) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    path, title = PAGES[name]
    page.goto(f"{url}/{path}")
    page.get_by_role("heading", name=title, exact=True).wait_for(timeout=90_000)
    # A page opened by its URL is drawn again inside the app's frame (pages.common.app_frame): its sidebar links show
    # once that run has drawn, and the page's own widgets with it (before, they can be placeholders).
    page.locator("[data-testid='stSidebarUserContent'] a").first.wait_for(timeout=90_000)
    page.wait_for_function(SETTLED, timeout=90_000)
    if name in LIVE_LANE_PAGES:
        choice = page.locator("[data-testid='stRadio'] label", has_text=LIVE_LANE_PAGES[name])
        lane_picker = page.get_by_text("Lane", exact=True)  # the picker of the live run's lanes
        for attempt in range(3):  # a click that lands while the page is still redrawing can be lost: click again
            choice.click(timeout=60_000)
            try:
                lane_picker.wait_for(timeout=30_000)
                break
            except PlaywrightTimeout:
                if attempt == 2:
                    raise
        page.wait_for_function(SETTLED, timeout=60_000)


def launch_run(page, url: str) -> None:
    """The presenter's run: Launch on the Train page with many steps, until the page says it is running."""
    open_page(page, url, "train")
    # One lane: the run shares a busy machine with both browsers. The form's second lane is this CPU's mixed mode
    # (bf16-mixed where bf16 math is native, else 16-mixed), removed by that name; what follows 32-true is removed.
    for mode in default_modes("cpu")[1:]:
        page.get_by_role("button", name=f"Remove {mode}").click()
        page.wait_for_function(SETTLED, timeout=60_000)
    for label, value in (("Steps", LAUNCH_STEPS), ("Batch size", LAUNCH_BATCH)):
        box = page.get_by_label(label, exact=True)
        box.fill(str(value))
        box.press("Enter")
        page.wait_for_function(SETTLED, timeout=60_000)
    page.get_by_role("button", name="Launch", exact=True).click()
    page.get_by_text("Run status: running").wait_for(timeout=90_000)


def visit(page, url: str, name: str, shots: Path, role: str) -> dict:
    """What `role`'s browser sees on page `name` (a screenshot of it in `shots`; one of what it drew instead if this
    fails)."""
    try:
        return read_page(page, url, name, shots, role)
    except Exception:
        page.screenshot(path=str(shots / f"{role}_{name}_failed.png"))
        raise


def read_page(page, url: str, name: str, shots: Path, role: str) -> dict:
    open_page(page, url, name)
    seen: dict = {}
    if name == "train":  # the run followed live: its chart grows while this browser watches
        page.get_by_text("Run status: running").wait_for(timeout=60_000)
        # Each step is read by the wait that sees it (its handle's value): Streamlit redraws the chart as a new element,
        # whose trace data is briefly absent, so a second read after the wait could find 0.
        first = page.wait_for_function(f"() => {{ const step = ({LAST_STEP})(); return step > 0 && step; }}",
                                       timeout=60_000).json_value()
        then = page.wait_for_function(f"() => {{ const step = ({LAST_STEP})(); return step > {first} && step; }}",
                                      timeout=60_000).json_value()
        seen["last_step"] = [first, then]
    # A page whose script is still running has no stale element yet (SETTLED holds) while its later parts are still
    # to come (the op inspector's Trace button after its lane picker, the debugger's replay panel below the fold):
    # wait for what the role must see there (each control; the visitor's note where a control would be) first.
    main = page.get_by_test_id("stMain")
    # A control by its label as BUTTONS reads it (a button's accessible name has its icon's name too).
    expected = ([main.locator("[data-testid^='stBaseButton']").filter(has=page.get_by_text(label, exact=True))
                 for label in CONTROLS.get(name, ())] if role == "presenter"
                else [main.get_by_text(NOTE)] if name in CONTROLS else [])
    for element in expected:  # drawn, maybe in a closed expander (Layer numerics' Launch): attached, not visible
        element.first.wait_for(state="attached", timeout=120_000)
    page.wait_for_function(SETTLED, timeout=60_000)
    seen.update(buttons=page.evaluate(BUTTONS), notes=main.get_by_text(NOTE).count(),
                sidebar=page.locator("[data-testid='stSidebar']").inner_text(),
                exceptions=page.locator("[data-testid='stException']").count())
    page.screenshot(path=str(shots / f"{role}_{name}.png"))
    if name == "train":  # and the run itself, further down
        page.get_by_text("Run status: running").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / f"{role}_{name}_run.png"))
    return seen


def press_on_train_page(page, url: str, button: str, status: str) -> None:
    """The presenter's `button` (Pause, Stop) on the Train page, until the run's status reads `status`."""
    open_page(page, url, "train")
    # The page's own button: Streamlit's header shows a "Stop" of its own while a script runs.
    page.get_by_test_id("stMainBlockContainer").get_by_role("button", name=button, exact=True).click()
    page.get_by_text(f"Run status: {status}").wait_for(timeout=60_000)


def pause_run(page, url: str) -> None:
    """The presenter's Pause: the run stays live (its thread waits, its lanes keep their models) and stops using the
    CPU while the browsers tour the other pages."""
    press_on_train_page(page, url, "Pause", "paused")


def stop_run(page, url: str) -> None:
    """The presenter's Stop: the control works from this machine (and the run ends)."""
    press_on_train_page(page, url, "Stop", "stopped")
