"""The workshop's "Find the layer, keep it, pay for it": a 16-mixed lane with one planted fp16 overflow among
large-but-safe layers fails; when the run has ended the layer bisect searches the smallest set of modules to keep in
fp32, and its price race (the failing lane, the fixed lane and 32-true from the same snapshot, interleaved) says what
the fix costs on this device. The checks read the run's step records and its `bisected` event as they are."""

from __future__ import annotations

import math

import pandas as pd

from amp_core.config import RunConfig, ScalerConfig
from amp_core.workshop.evidence import Evidence, Waiting, diverged, first_nonfinite
from amp_core.workshop.planted import PLANTED_MODULE, WorkshopPlantedDigits

FAILING_LANE = "16-mixed"
MODES = ("32-true", FAILING_LANE)
WORKLOAD = WorkshopPlantedDigits.name
PRICE_STEPS = 20
"""Steps of the bisect's price race: enough for the fixed lane to show it trains, a second or two here."""
LOSS_MATCH = 0.10
"""The fixed lane trains like fp32 when its last loss in the price race is within this share of 32-true's."""


def register_workload() -> None:
    """The scenario's workload is a plugin of the workshop's own (amp_core.workshop.planted), loaded before its runs
    are built; a process that reads the runs back needs only their records."""
    from amp_core.workshop.planted import register

    register()


def runs(device: str) -> tuple[RunConfig, ...]:
    """One race: 32-true and the failing 16-mixed lane, snapshots kept for the bisect, a GradScaler that starts low
    enough for the fixed lane to skip nothing in its warm-up (the planted overflow is in the forward, whatever the
    scale)."""
    register_workload()
    return (RunConfig(workload=WORKLOAD, device=device, name="workshop: find the layer, keep it, pay for it",
                      modes=MODES, steps=30, gradstats_every=0, snapshot_every=10,
                      scaler=ScalerConfig(init_scale=256.0)),)


def bisect_the_failure(manager, run_id: str) -> None:
    """After the run (on the launch's thread, never the training thread): the bisect of the failing lane, through the
    bisect button's own code, recorded in the run as a `bisected` event (what the checks read)."""
    from amp_core.diagnostics.bisect import BisectConfig, bisect_run

    bisect_run(manager, run_id, FAILING_LANE, check=BisectConfig(price_steps=PRICE_STEPS), record=True)


def _report(evidence: Evidence):
    from amp_core.diagnostics.bisect import recorded_bisects

    part = evidence.part(0)
    if evidence.reader is None:
        raise Waiting("the run's events")
    reports = recorded_bisects(evidence.reader.events(part.run_id), part.lane_index(FAILING_LANE))
    if not reports:
        raise Waiting("the bisect, made when the run has ended")
    return reports[-1]


def _rows(report) -> dict:
    return {row.recipe: row for row in report.price}


def lane_fails(evidence: Evidence) -> tuple[bool, str, str]:
    """The 16-mixed lane's loss turns inf/NaN while 32-true's stays finite: the failure is the format's."""
    part = evidence.part(0)
    mixed = part.lane(FAILING_LANE, at_least=part.config.steps)
    base = part.lane("32-true", at_least=part.config.steps)
    failed, fp32_failed = diverged(part, mixed, FAILING_LANE), diverged(part, base, "32-true")
    bad = first_nonfinite(mixed)
    figure = (f"{FAILING_LANE}'s loss became {bad[1]} at step {bad[0]}" if bad else
              f"{FAILING_LANE} {'diverged' if failed else 'stayed finite'}") + \
        f"; 32-true {'diverged too' if fp32_failed else f'finite for its {len(base)} steps'}"
    held = failed and not fp32_failed
    why = (f"{PLANTED_MODULE} multiplies its input by 10^6 and divides again: exact in fp32, inf in fp16 (largest "
           "65504) the moment autocast hands it a 16-bit tensor; the inf reaches the loss in the same forward.")
    if not held:
        why = ("32-true failed too: the failure is not the format's (see the Overflow debugger's replay)"
               if fp32_failed else f"{FAILING_LANE} did not fail here, so there is nothing to find: the planted gain "
               "did not overflow this device's fp16.")
    return held, figure, why


def finds_the_layer(evidence: Evidence) -> tuple[bool, str, str]:
    """The bisect names exactly the planted module, and no smaller set exists (1-minimal)."""
    report = _report(evidence)
    if report.verdict != "fixed":
        return False, f"no set: {report.verdict}", report.why
    trials = len(report.trials)
    figure = (f"keep {', '.join(report.kept)} ({len(report.kept)} of {report.candidates} modules), found in {trials} "
              f"trials, {report.seconds:.1f} s")
    held = report.kept == [PLANTED_MODULE] and report.minimal
    if held:
        return True, figure, (f"The search replays the failing step from the lane's snapshot with modules kept in "
                              f"fp32: the first trial named {PLANTED_MODULE} as the first inf/NaN module, keeping it "
                              "passed, and the large-but-safe gains (x300) stayed out.")
    planted = "the planted module is not in it" if PLANTED_MODULE not in report.kept else "more than the planted module"
    return False, figure, (f"The set differs from the planted {PLANTED_MODULE}: {planted}"
                           + ("; the trial budget ran out before the set was minimal" if not report.minimal else "")
                           + ". See the bisect's trials on the Overflow debugger.")


def fixed_lane_trains(evidence: Evidence) -> tuple[bool, str, str]:
    """In the price race the fixed lane skips nothing and ends with a finite loss within LOSS_MATCH of 32-true's,
    while the original lane's loss is not finite."""
    report = _report(evidence)
    if report.verdict != "fixed":
        return False, f"no fixed lane: the bisect found no set ({report.verdict})", report.why
    rows = _rows(report)
    fixed, own, base = rows.get(report.fixed_recipe), rows.get(report.recipe), rows.get("32-true")
    if fixed is None or own is None or base is None:
        return False, "the bisect recorded no price race", "The price race did not run: see the run's events."
    gap = abs(fixed.loss - base.loss) / abs(base.loss) if math.isfinite(fixed.loss) and base.loss else math.inf
    figure = (f"{report.fixed_recipe}: loss {fixed.loss:.4g} at the end of the price race, {fixed.skipped} skipped "
              f"(32-true {base.loss:.4g}; {report.recipe} {own.loss:.4g})")
    held = fixed.skipped == 0 and math.isfinite(fixed.loss) and gap <= LOSS_MATCH and not math.isfinite(own.loss)
    if held:
        return True, figure, (f"From the same snapshot and batches, the lane with {', '.join(report.kept)} in fp32 "
                              f"trains: no skipped step, its loss within {gap:.1%} of 32-true's, while the original "
                              "lane's is not finite.")
    why = []
    if fixed.skipped:
        why.append(f"the fixed lane skipped {fixed.skipped} steps: another layer may overflow later")
    if not math.isfinite(fixed.loss):
        why.append("the fixed lane's loss is not finite")
    elif gap > LOSS_MATCH:
        why.append(f"its loss is {gap:.0%} away from 32-true's (more than {LOSS_MATCH:.0%})")
    if math.isfinite(own.loss):
        why.append("the original lane did not fail in the race, so the race does not show the fix")
    return False, figure, "; ".join(why).capitalize() + "."


def keeping_costs(evidence: Evidence) -> tuple[bool, str, str]:
    """16-mixed already holds fp32 weights, gradients and optimizer state: keeping a module computes it in fp32 and
    holds no more of them than 32-true does; the time it costs is measured (either way, it is this device's answer)."""
    report = _report(evidence)
    if report.verdict != "fixed":
        return False, f"no price: the bisect found no set ({report.verdict})", report.why
    rows = _rows(report)
    fixed, base = rows.get(report.fixed_recipe), rows.get("32-true")
    if fixed is None or base is None:
        return False, "the bisect recorded no price race", "The price race did not run: see the run's events."
    figure = report.price_line()
    extra = fixed.memory_bytes - base.memory_bytes
    if extra == 0:
        return True, figure, (f"{report.recipe} keeps fp32 master weights, gradients and Adam's state already: the "
                              f"fixed lane holds what 32-true holds ({fixed.memory_bytes / 2**20:.2f} MiB), so the "
                              "kept module costs no weight memory; what it costs is its fp32 compute and activations "
                              "(the ms/step above, measured in the same interleaved steps as the other lanes).")
    return False, figure, (f"The fixed lane holds {extra / 2**20:+.2f} MiB of weights, gradients and optimizer state "
                           f"against 32-true: a mixed mode's should be the same (a true mode keeps the module's "
                           "weights in fp32 beside 16-bit ones, which does cost memory).")


def price_table(evidence: Evidence) -> pd.DataFrame:
    """The price race, one row per lane: ms/step, held memory, last loss, skipped steps (as text: a scenario table's
    floats are shares)."""
    report = _report(evidence)
    if not report.price:
        raise Waiting("the price race")
    own = _rows(report).get(report.recipe)
    return pd.DataFrame([{
        "lane": row.recipe,
        "ms/step": f"{row.ms_per_step:.2f}",
        "vs original": f"{row.ms_per_step / own.ms_per_step:.2f}x" if own is not None and own.ms_per_step else "",
        "held MiB": f"{row.memory_bytes / 2**20:.3f}",
        "last loss": row.loss_text,
        "skipped": row.skipped,
    } for row in report.price])
