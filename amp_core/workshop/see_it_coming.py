"""The workshop's "See it coming": a 16-mixed lane whose one layer's output grows a little every step races 32-true
with every layer sampled; the forecast names the layer and the step fp16 overflows long before it does, the lane then
breaks where it said, and (once the run has ended) a race from the lane's weights at the forecast's first warning shows
that keeping that layer in fp32 would have avoided it. The checks read the run's step records and its `forecast` and
`forecast_fix` events as they are."""

from __future__ import annotations

import pandas as pd

from amp_core.config import RunConfig
from amp_core.probes.headroom import FORECAST_EVENT
from amp_core.workshop.evidence import Evidence, Waiting, first_nonfinite
from amp_core.workshop.planted import GROWING_MODULE, GrowingPlantedDigits

LANE = "16-mixed"
MODES = (LANE, "32-true")
EVERY = 10
"""Steps between two layer samples (the race's --amax-every)."""
LEAD_MIN = 100
"""The forecast must come at least this many steps before the break."""
ERROR_MAX = 0.3
"""|predicted − actual| within this share of the warning's lead."""
STEPS = 300
"""fp16 overflows after some 240 steps at the small size's rate (0.04 bits a step): the run ends after it."""


def runs(device: str) -> tuple[RunConfig, ...]:
    """One race: the growing layer in 16-mixed beside 32-true, layers sampled every EVERY steps."""
    from amp_core.workshop.planted import register

    register()
    return (RunConfig(workload=GrowingPlantedDigits.name, size="small", device=device, modes=MODES, steps=STEPS,
                      amax_every=EVERY, gradstats_every=0, name="workshop: see it coming"),)


def race_the_fix(manager, run_id: str) -> None:
    """After the run (on the launch's thread, never the training thread): the fix the forecast names, raced from the
    lane's weights at its first warning through the button's own code, recorded as a `forecast_fix` event."""
    from amp_core.diagnostics.forecast_fix import race_fix

    race_fix(manager, run_id, LANE, record=True)


def _lane_and_break(evidence: Evidence):
    part = evidence.part(0)
    lane = part.lane(LANE, at_least=part.config.steps)
    return part, lane, first_nonfinite(lane)


def _first_forecast(evidence: Evidence, part, before: int | None) -> tuple[int, dict] | None:
    """The first forecast the lane told (before `before`, when it broke)."""
    if evidence.reader is None:
        raise Waiting("the run's events")
    events = evidence.reader.events(part.run_id)
    told = events[(events["kind"] == FORECAST_EVENT) & (events["lane"] == part.lane_index(LANE))]
    told = told.sort_values("step", kind="stable")
    if before is not None:
        told = told[told["step"] < before]
    return (int(told.iloc[0]["step"]), told.iloc[0]["data"]) if len(told) else None


def forecast_came_first(evidence: Evidence) -> tuple[bool, str, str]:
    """A forecast naming the growing layer and fp16's max was told LEAD_MIN steps or more before the lane broke."""
    part, _, broke = _lane_and_break(evidence)
    first = _first_forecast(evidence, part, broke[0] if broke else None)
    if broke is None:
        return False, f"{LANE} did not break in {part.config.steps} steps", (
            "The growing layer did not overflow fp16 here, so there was nothing to see coming.")
    if first is None:
        return False, f"{LANE} broke at step {broke[0]} with no forecast before it", (
            "No layer's trend was clear enough to forecast: the samples' scatter hid the growth.")
    told, data = first
    lead = broke[0] - told
    figure = (f"told at step {told}: {data['module']} reaches {data['format']}'s {data['limit']} at step "
              f"{data['predicted_step']} ({data['lo_step']}–{data['hi_step']}); the lane broke at step {broke[0]}, "
              f"{lead} steps later")
    if data["module"] != GROWING_MODULE:
        return False, figure, f"The forecast named {data['module']}, not the growing layer {GROWING_MODULE}."
    if lead < LEAD_MIN:
        return False, figure, f"The warning came {lead} steps ahead, fewer than {LEAD_MIN}."
    return True, figure, (f"The growing layer's abs max climbed {-data['slope_bits_per_step']:.3f} bits a step; a "
                          f"robust trend over its last samples reached fp16's largest value {lead} steps before the "
                          "loss turned inf.")


def it_came_true(evidence: Evidence) -> tuple[bool, str, str]:
    """The break came where the first forecast said: within its interval, or within ERROR_MAX of its lead."""
    part, _, broke = _lane_and_break(evidence)
    first = _first_forecast(evidence, part, broke[0] if broke else None)
    if broke is None or first is None:
        return False, "no forecast and break to compare", "See the check above."
    told, data = first
    error = abs(data["predicted_step"] - broke[0]) / max(broke[0] - told, 1)
    inside = data["lo_step"] <= broke[0] <= data["hi_step"]
    figure = (f"predicted step {data['predicted_step']} ({data['lo_step']}–{data['hi_step']}), broke at step "
              f"{broke[0]}: off by {error:.0%} of the lead")
    if inside or error <= ERROR_MAX:
        return True, figure, ("The layer's growth kept its pace, so the line fitted to the samples crossed the limit "
                              "where the values did" + (", inside the forecast's interval." if inside else "."))
    return False, figure, (f"The break came outside the interval and more than {ERROR_MAX:.0%} of the lead away: the "
                           "growth changed pace after the forecast.")


def _race(evidence: Evidence):
    from amp_core.diagnostics.forecast_fix import recorded_fix_races

    part = evidence.part(0)
    if evidence.reader is None:
        raise Waiting("the run's events")
    races = recorded_fix_races(evidence.reader.events(part.run_id), part.lane_index(LANE))
    if not races:
        raise Waiting("the fix race, made when the run has ended")
    return races[-1]


def keeping_avoids_it(evidence: Evidence) -> tuple[bool, str, str]:
    """From the weights at the first warning, the lane as it is breaks again and the lane with the layer kept in fp32
    trains through the race."""
    race = _race(evidence)
    kept = race.lane_of(f"{race.recipe}+keep:{GROWING_MODULE}")
    figure = race.line()
    if kept is None:
        return False, figure, f"The forecast's fix did not keep {GROWING_MODULE}: it named {race.forecast['module']}."
    if race.original.broke_at is None:
        return False, figure, "The lane as it is did not break in the race, so the race shows nothing avoided."
    if kept.broke_at is not None:
        return False, figure, f"Keeping {GROWING_MODULE} in fp32 broke too, at step {kept.broke_at}."
    return True, figure, (f"{GROWING_MODULE} computing in fp32 hands the LayerNorm after it an fp32 tensor, which "
                          "undoes the growth; the same weights and batches without it overflow again.")


def forecast_table(evidence: Evidence) -> pd.DataFrame:
    """The forecasts the lane told, then its break: step, what was said (as text: a scenario table's floats are
    shares)."""
    part, _, broke = _lane_and_break(evidence)
    if evidence.reader is None:
        raise Waiting("the run's events")
    events = evidence.reader.events(part.run_id)
    told = events[(events["kind"] == FORECAST_EVENT) & (events["lane"] == part.lane_index(LANE))]
    rows = [{"step": str(int(step)), "what": f"forecast: {data['module']} reaches {data['format']}'s {data['limit']}",
             "predicted": f"{data['predicted_step']} ({data['lo_step']}–{data['hi_step']})",
             "headroom": f"{data['headroom_bits']:.1f} bits"}
            for step, data in zip(told["step"], told["data"], strict=True)]
    if broke is not None:
        rows.append({"step": str(broke[0]), "what": f"broke: loss {broke[1]}", "predicted": "", "headroom": "none"})
    if not rows:
        raise Waiting("a forecast")
    return pd.DataFrame(rows)
