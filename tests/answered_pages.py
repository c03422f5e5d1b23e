"""A page under AppTest drawn again until its probes are in: pages ask their probes of the answer board
(pages.answered) and draw a one-line note meanwhile; AppTest runs no fragment timer, so the note's own poll never
reruns the page here. The board's worker is waited for (a join, no sleep), then one run draws what it made."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from pages.answered import answer_board

WAIT_S = 120.0
NOTE_MARK = ":material/hourglass_top:"
"""How pages.answered.awaiting's note begins."""


def awaiting_notes(app: AppTest) -> list[str]:
    """The notes the page draws while a probe of it is being made."""
    return [caption.value for caption in app.caption if caption.value.startswith(NOTE_MARK)]


def answered(app: AppTest, rounds: int = 4) -> AppTest:
    """`app` drawn again until it shows no note (a probe drawn after another, as Layer numerics' block-scaled one
    after its plain one, takes a round each)."""
    for _ in range(rounds):
        if not awaiting_notes(app):
            return app
        assert answer_board().wait(WAIT_S), f"no answer in {WAIT_S:g} s for {awaiting_notes(app)}"
        app.run()
    raise AssertionError(f"the page kept awaiting probes: {awaiting_notes(app)}")
