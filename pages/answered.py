"""A page's probe off its script thread: asked of the server's answer board (amp_core.diagnostics.answers), a one-line
note with the seconds waited while it is made, then the page drawn once more with it.

The page is usable at once (its controls, its other sections); a reopened page, or another session asking the same,
finds the answer made.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import streamlit as st

from amp_core.diagnostics import Answer, AnswerBoard

ANSWER_POLL_S = 0.5  # how often the note looks whether its answer is made (only while one is awaited)


@st.cache_resource(show_spinner=False)
def answer_board() -> AnswerBoard:
    """The server's one board: every page's probes run one after another on its worker."""
    return AnswerBoard()


def answer_for(state_key: str, key: Hashable, compute: Callable[[], Any]) -> Answer:
    """The answer for `key`, held in the session under `state_key`: the rerun that a finished answer asks for draws
    that very answer, a failure included (the board computes a failed key again when asked anew). A failure is shown
    once from the hold, then the next draw asks again, as st.cache_data recomputes after an exception."""
    held = st.session_state.get(state_key)
    if isinstance(held, Answer) and held.key == key:
        if held.done.is_set() and held.error is not None:
            del st.session_state[state_key]
        return held
    answer = st.session_state[state_key] = answer_board().ask(key, compute)
    return answer


def awaiting(answer: Answer, doing: str) -> None:
    """While `answer` is made: `doing` and the seconds waited, redrawn every ANSWER_POLL_S (a fragment: the rest of
    the page stays); once it is made, the page is drawn again with it, with no timer left behind."""

    @st.fragment(run_every=ANSWER_POLL_S)
    def note() -> None:
        if answer.done.is_set():
            st.rerun()
        ahead = answer_board().ahead(answer)
        queued = f"; {ahead} other probe{'s' if ahead > 1 else ''} first" if ahead else ""
        st.caption(f":material/hourglass_top: {doing} ({answer.waited_s():.0f} s{queued})")

    note()
