"""A clock the live-room tests move by hand (amp_core.views.shared.LiveRoom's ticks)."""

from __future__ import annotations


class Clock:
    """A clock the test moves: a tick ends when the test says so, not when the machine is slow."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
