"""A run's headroom and forecasts shaped for reading: per lane, its layers by headroom with each one's forecast (the
`amp-lab forecast` table) and the one line a page shows ("<layer> reaches fp16's max in ~N steps (lo–hi)")."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from amp_core.probes.headroom import (
    FORECAST_EVENT,
    FORMAT_LIMITS,
    Forecast,
    LaneHeadroom,
    first_warning,
    formats_of_mode,
)
from amp_core.probes.numerics import LAYER_AMAX_EVENT

COULD_USE = ("fp16", "bf16")
"""The formats a lane that casts to none (fp32, tf32) is shown against: what it could switch to."""


def lane_headrooms(events: pd.DataFrame) -> dict[int, LaneHeadroom]:
    """Each lane's sampled layers (its `layer_amax` events, in step order) as a LaneHeadroom."""
    lanes: dict[int, LaneHeadroom] = {}
    if events.empty:
        return lanes
    samples = events[events["kind"] == LAYER_AMAX_EVENT]
    for row in samples.sort_values(["lane", "step"], kind="stable").itertuples():
        lanes.setdefault(int(row.lane), LaneHeadroom()).add(int(row.step), row.data)
    return lanes


def shown_formats(mode: str) -> tuple[str, ...]:
    return formats_of_mode(mode) or COULD_USE


def forecast_line(forecast: Forecast | None, mode: str) -> str:
    """A lane's one line: its earliest forecast, or that its trends are clear of every limit."""
    if forecast is None:
        return f"{mode}: no layer is heading for a limit of {', '.join(shown_formats(mode))} (no clear trend)"
    what = forecast.module if forecast.tensor == "output" else f"{forecast.module}'s gradient"
    which = "max" if forecast.limit == "max" else "smallest normal"
    return (f"{mode}: {what} reaches {forecast.format}'s {which} in ~{forecast.steps_ahead} steps "
            f"({forecast.lo_step - forecast.sample_step}–{forecast.hi_step - forecast.sample_step}), at step "
            f"{forecast.predicted_step}")


def told_forecasts(events: pd.DataFrame) -> pd.DataFrame:
    """The `forecast` events the run recorded (as the race or the Monitor told them, live)."""
    if events.empty:
        return events
    return events[events["kind"] == FORECAST_EVENT]


def forecast_table(headroom: LaneHeadroom, formats: Iterable[str], rows: int = 20) -> list[str]:
    """Text lines: the layers with the least headroom (every one with a forecast, then the rest up to `rows`)."""
    formats = [name for name in formats if name in FORMAT_LIMITS]
    table = headroom.rows(formats)
    picked = [row for row in table if row.forecast is not None]
    picked += [row for row in table if row.forecast is None][:max(rows - len(picked), 0)]
    picked.sort(key=lambda row: (row.headroom_bits is None, row.headroom_bits or 0.0))
    width = max([len("layer"), *(len(row.module) for row in picked)])
    lines = [f"{'layer':<{width}}  tensor  {'format':<10} {'limit':<15} {'headroom':>10}  forecast"]
    for row in picked:
        bits = "—" if row.headroom_bits is None else f"{row.headroom_bits:.1f} bits"
        if row.forecast is not None:
            f = row.forecast
            told = (f"step {f.predicted_step} (~{f.steps_ahead} steps, {f.lo_step}–{f.hi_step}), "
                    f"{-f.slope_bits_per_step:.3g} bits/step")
        else:
            told = row.why_none
        lines.append(f"{row.module:<{width}}  {row.tensor:<6}  {row.format:<10} {row.limit:<15} {bits:>10}  {told}")
    return lines


def told_line(mode: str, data: dict) -> str:
    """A told forecast (its event's data) as the Train page's line for its lane: absolute steps, since the page
    shows it while the run moves on."""
    what = data["module"] if data["tensor"] == "output" else f"{data['module']}'s gradient"
    which = "max" if data["limit"] == "max" else "smallest normal"
    ahead = data["predicted_step"] - data["sample_step"]
    return (f"{mode}: {what} reaches {data['format']}'s {which} in ~{ahead} steps "
            f"({data['lo_step'] - data['sample_step']}–{data['hi_step'] - data['sample_step']}) from step "
            f"{data['sample_step']}: at step {data['predicted_step']} ({data['lo_step']}–{data['hi_step']})")


def lane_forecast_lines(events: pd.DataFrame, modes: dict[int, str]) -> list[str]:
    """Per lane (`modes`: lane -> mode), the line of its latest forecast as first told (its first warning: the most
    notice it gave), and where the latest told puts the step when that moved; lanes with none are left out."""
    told = told_forecasts(events)
    lines = []
    for lane, mode in modes.items():
        mine = told[told["lane"] == lane].sort_values("step", kind="stable") if not told.empty else told
        if mine.empty:
            continue
        step, data = first_warning(list(zip(mine["step"], mine["data"], strict=True)))
        line = told_line(mode, data)
        latest = mine.iloc[-1]
        if int(latest["step"]) != step:
            line += f" · latest, told at step {int(latest['step'])}: at step {latest['data']['predicted_step']}"
        lines.append(line)
    return lines
