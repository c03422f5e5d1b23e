"""The app frame under AppTest: every page of the navigation renders on a fresh store with no exception."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
TITLES = {"pages/train.py": "Train", "pages/workshop.py": "Workshop", "pages/compare.py": "Compare",
          "pages/op_inspector.py": "Op inspector",
          "pages/layer_numerics.py": "Layer numerics", "pages/overflow_debugger.py": "Overflow debugger",
          "pages/formats.py": "Formats", "pages/advise.py": "Advise"}
PAGES = list(TITLES)


def test_the_navigation_that_runs_has_these_pages():
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not at.exception
    # The sidebar links every page handed to st.navigation, in its order.
    assert [link.proto.label for link in at.get("page_link")] == list(TITLES.values())
    for page in PAGES:
        at.switch_page(page)  # with st.navigation running, a file it did not register is refused ...
    with pytest.raises(ValueError, match="Could not find a navigation page") as refused:
        at.switch_page("pages/common.py")  # ... like this one, a file in pages/ that is not a page
    # ... and the refusal names every page st.navigation registered (Streamlit 1.67's message): exactly these.
    known = re.search(r"Known pages: \[(.*)\]", str(refused.value)).group(1)
    assert [Path(path.strip(" '")).relative_to(ROOT).as_posix() for path in known.split(",")] == PAGES


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_a_fresh_store(page):
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not at.exception
    frame = " ".join(block.value for block in at.get("markdown"))
    assert "Precision modes here" in frame and "32-true" in frame
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


@pytest.mark.parametrize(("value", "note", "mixed"), [
    ("bf16,fp16", "AMP_LAB_CPU_NATIVE=bf16,fp16 overrides what torch detects here (",
     "AMP_LAB_CPU_NATIVE=bf16,fp16 says this CPU has native bf16 math"),
    ("none", "AMP_LAB_CPU_NATIVE=none overrides what torch detects here (", "expect it to be slower than fp32"),
    ("avx", "AMP_LAB_CPU_NATIVE: unknown value 'avx'; choose from none, bf16, fp16, bf16,fp16",
     "✗ `16-mixed`, `bf16-mixed`, `16-true`, `bf16-true` — AMP_LAB_CPU_NATIVE: unknown value 'avx'"),
])
def test_the_device_panel_says_when_the_cpu_override_decides(monkeypatch, value, note, mixed):
    from pages import common

    monkeypatch.setenv("AMP_LAB_CPU_NATIVE", value)
    common.warm_up.clear()  # the device facts are read once per server: this one starts with the override set
    try:
        at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
        assert not at.exception
        shown = at.error if value == "avx" else at.caption  # a value it does not take is an error, not a note
        assert any(block.value.startswith(note) for block in shown), [block.value for block in shown]
        (modes,) = [block.value for block in at.markdown if block.value.startswith("**Precision modes here**")]
        assert mixed in modes
    finally:
        common.warm_up.clear()  # the next test's server detects again


# Characters that need an emoji font: pictographs, and symbols whose default presentation is an emoji (or that have
# no glyph in the common text fonts: DejaVu, Liberation, Streamlit's Source Sans). Debian's Chromium with no emoji font
# draws each as an empty box; Streamlit's own icon font (`:material/name:`) draws everywhere.
EMOJI = re.compile("[\U0001f000-\U0001faff\u231a\u231b\u23e9-\u23fa\u2614\u2615\u2648-\u2653\u267f\u2693\u26a1"
                   "\u26aa\u26ab\u26bd\u26be\u26c4\u26c5\u26ce\u26d4\u26ea\u26f2-\u26f5\u26fa\u26fd\u2705\u270a\u270b"
                   "\u2728\u274c\u274e\u2753-\u2755\u2757\u2795-\u2797\u27b0\u27bf\u2b1b\u2b1c\u2b50\u2b55\ufe0f]")


def test_what_the_pages_draw_needs_no_emoji_font():
    sources = [ROOT / "app.py", *(path for folder in ("pages", "amp_core/views", "amp_core/workshop")
                                  for path in sorted((ROOT / folder).glob("*.py")))]
    found = [f"{path.relative_to(ROOT)}:{number}: {match.group()!r}" for path in sources
             for number, line in enumerate(path.read_text().splitlines(), start=1) for match in EMOJI.finditer(line)]
    assert not found, found


def test_the_warm_up_imports_once_the_first_page_waits_for_it(monkeypatch):
    """The server's imports start when a page first waits for them (its light paint is drawn), not before: torch's
    import would otherwise take the interpreter from the first paint. A page that never asks still gets them."""
    from pages import common

    monkeypatch.setattr(common, "PAINT_SETTLE_S", 0.0)
    warm = common.WarmUp()
    try:
        assert not warm.core.wait(0.3)  # nobody asked yet (PAINT_WAIT_S is longer)
        facts = warm.device_facts()  # a page waits: the imports start now
        assert facts.runnable and warm.painted.is_set() and warm.core.is_set()
    finally:
        warm.done.wait()
    monkeypatch.setattr(common, "PAINT_WAIT_S", 0.2)
    unasked = common.WarmUp()
    assert unasked.done.wait(60) and unasked.facts is not None
