"""A workshop check and its verdict: held, failed, or "cannot tell here" (the records cannot decide it on this
device, and the reason says why), and what a scenario's verdicts add up to (a headline, the CLI's exit code)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from amp_core.workshop.evidence import Evidence, Waiting


class Verdict(enum.Enum):
    """What a check's records say about its expectation."""

    HELD = "✓"
    FAILED = "✗"
    CANNOT_TELL = "?"
    """The records cannot decide it here (the figure is within the run's own noise, or the device's facts are not
    known on this machine): neither a pass nor a fail."""


EXIT_HELD = 0
"""`workshop run` exits 0 when every check held."""
EXIT_FAILED = 1
"""... 1 when a check failed (or the runs ended without the records a check needs)."""
EXIT_CANNOT_TELL = 3
"""... 3 when none failed but one or more could not be told here (2 is bad input)."""


class CannotTell(Exception):
    """A check's records are there but cannot decide it on this device: `figure` is what was measured, `reason`
    why that does not decide it."""

    def __init__(self, figure: str, reason: str):
        super().__init__(reason)
        self.figure = figure
        self.reason = reason


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check of a scenario, measured from a run's records."""

    title: str
    """What is checked, in a few words."""
    verdict: Verdict
    """What the records read say of the expectation."""
    figure: str
    """What was measured, as text ("3 of 3 spike steps skipped")."""
    expectation: str
    """What the check expects here, and why."""
    explanation: str = ""
    """Why it did not hold, why it cannot be told here, or what the figure does not mean: words that do not
    mislead."""
    final: bool = True
    """The runs have ended: the figure no longer changes (False: measured so far)."""
    waiting: bool = False
    """The records it needs were not there (yet)."""

    @property
    def held(self) -> bool:
        return self.verdict is Verdict.HELD

    @property
    def mark(self) -> str:
        return self.verdict.value

    @property
    def label(self) -> str:
        """What the explanation is, as its line starts: 'why not', 'cannot tell here' or 'note'."""
        return {Verdict.HELD: "note", Verdict.FAILED: "why not", Verdict.CANNOT_TELL: "cannot tell here"}[
            self.verdict]


Measure = Callable[[Evidence], tuple[bool, str, str]]
"""evidence -> (held, figure, explanation); raises Waiting when the records are not there yet, CannotTell when they
cannot decide it here."""


@dataclass(frozen=True, slots=True)
class Check:
    """A check of a scenario: a title, the expectation, and how to measure it."""

    title: str
    expectation: str | Callable[[str], str]
    """What the check expects and why: the text, or device -> the text where the expectation follows the device."""
    measure: Measure

    def expectation_on(self, device: str) -> str:
        return self.expectation(device) if callable(self.expectation) else self.expectation

    def evaluate(self, evidence: Evidence) -> CheckResult:
        expectation = self.expectation_on(evidence.device)
        try:
            held, figure, explanation = self.measure(evidence)
        except Waiting as waiting:
            why = f"the run ended before {waiting}" if evidence.ended else f"waiting for {waiting}"
            return CheckResult(self.title, Verdict.FAILED, why, expectation, why if evidence.ended else "",
                               final=evidence.ended, waiting=True)
        except CannotTell as cannot:
            return CheckResult(self.title, Verdict.CANNOT_TELL, cannot.figure, expectation, cannot.reason,
                               final=evidence.ended)
        return CheckResult(self.title, Verdict.HELD if held else Verdict.FAILED, figure, expectation, explanation,
                           final=evidence.ended)


def evaluate(scenario, evidence: Evidence) -> list[CheckResult]:
    """Every check of the scenario (anything with `checks`) against the evidence."""
    return [check.evaluate(evidence) for check in scenario.checks]


def headline(results: list[CheckResult]) -> str:
    """'3 of 3 checks held' once the runs have ended, 'so far …' while they go; checks that cannot be told here are
    counted apart ('2 of 3 checks held, 1 cannot be told here')."""
    held = sum(result.held for result in results)
    untold = sum(result.verdict is Verdict.CANNOT_TELL for result in results)
    final = all(result.final for result in results)
    line = f"{held} of {len(results)} checks held" if final else f"so far {held} of {len(results)} checks hold"
    return line + (f", {untold} cannot be told here" if untold else "")


def exit_code(results: list[CheckResult]) -> int:
    """EXIT_HELD when every check held, EXIT_FAILED when one failed, else EXIT_CANNOT_TELL."""
    if all(result.held for result in results):
        return EXIT_HELD
    if any(result.verdict is Verdict.FAILED for result in results):
        return EXIT_FAILED
    return EXIT_CANNOT_TELL
