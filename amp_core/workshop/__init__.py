"""Workshop scenarios: prepared races that make one point each, launched through the RunManager, and checks that read
the run's own records to say whether the point showed on this device.

A check states its expectation, measures it from the records (step records, lane statuses, gradient statistics;
for the op policy one traced step of the run's lane) and says held, failed (and why, in words that do not mislead),
or "cannot tell here" (and why: the figure is within the run's noise, or the device's facts are unknown on this
machine). Nothing here hard-codes an outcome: where the answer depends on the device (is mixed precision faster?) the
expectation is derived from what the device has (native 16-bit math or not), and the figure is whatever the run
measured.

The package by role: `evidence` (what the runs recorded), `verdicts` (a check, its verdict, what they add up to),
`checks` and `speed` (the measures), `catalogue` (the scenarios), `launch` (running one).

May import: diagnostics, race, probes, workloads, runs, config, precision and the utilities at amp_core's top;
never attach/ or views/ (the views read the workshop).
"""

from amp_core.workshop.catalogue import SCENARIOS, Scenario, unknown_scenario
from amp_core.workshop.evidence import Evidence, Part, Waiting, gather
from amp_core.workshop.launch import ScenarioLaunch
from amp_core.workshop.speed import DeviceMath, device_math
from amp_core.workshop.verdicts import (
    EXIT_CANNOT_TELL,
    EXIT_FAILED,
    EXIT_HELD,
    CannotTell,
    Check,
    CheckResult,
    Verdict,
    evaluate,
    exit_code,
    headline,
)

__all__ = ["EXIT_CANNOT_TELL", "EXIT_FAILED", "EXIT_HELD", "SCENARIOS", "CannotTell", "Check", "CheckResult",
           "DeviceMath", "Evidence", "Part", "Scenario", "ScenarioLaunch", "Verdict", "Waiting", "device_math",
           "evaluate", "exit_code", "gather", "headline", "unknown_scenario"]
