"""One AppTest session that renders every page of app.py's navigation with threads going, then ends the process.

Run as a script (tests/test_exit.py starts it in fresh subprocesses): the app frame (the Train page, its cost probe
racing), a long run launched there, then every page. The script then returns with the run inside torch, as a
server's session or a test session ends: only the exit handlers (amp_core.background.stop_all) stand between its
thread and an interpreter shutting down under it.
Prints `PAGES=<count>` and the threads going at the end. Exit 0 unless a page raised.

    AMP_LAB_STORE=/tmp/x/runs.sqlite3 python3 tests/render_every_page.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
RUN_STEPS = 1_000_000
"""Steps asked of the Train page's run: it is still going when the script ends."""


def navigation_pages() -> list[str]:
    """The page files app.py hands to st.navigation, in its order (each one that exists in this checkout)."""
    return re.findall(r'st\.Page\("([^"]+)"', (ROOT / "app.py").read_text())


def main() -> int:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    failures = [e.value for e in at.exception]
    pages = navigation_pages()
    # The first page is the Train page: its cost probe is racing; a long run launched beside it.
    at.number_input(key="train_steps").set_value(RUN_STEPS)
    at.button(key="train_launch").click().run()
    failures += [f"launch on the Train page: {e.value}" for e in [*at.exception, *at.error]]
    for page in pages:
        at.switch_page(page).run()
        failures += [f"{page}: {e.value}" for e in at.exception]
    from amp_core import background

    print(f"PAGES={len(pages)}")
    print("THREADS_AT_END=" + ",".join(sorted(thread.name for thread in background.running())))
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
