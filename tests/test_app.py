"""The app frame under AppTest: every page of the navigation renders on a fresh store with no exception."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["pages/train.py", "pages/compare.py", "pages/op_inspector.py", "pages/layer_numerics.py",
         "pages/overflow_debugger.py", "pages/formats.py"]


def test_the_navigation_lists_these_pages():
    source = (ROOT / "app.py").read_text()
    files = [f"pages/{path.name}" for path in (ROOT / "pages").glob("*.py")]
    listed = [name for name in files if f'"{name}"' in source]
    assert sorted(listed) == sorted(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_a_fresh_store(page):
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not at.exception
    frame = " ".join(block.value for block in at.get("markdown"))
    assert "Precision modes here" in frame and "32-true" in frame
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
