"""Acting on a forecast: the fix it names (keep the layer in fp32; for an fp16 limit, also the bf16 recipe, whose range
has the headroom there) and a race of those fixes against the lane as it is, from the lane's weights at the step the
forecast was told, on copies and off the training thread, that says whether the break the forecast saw coming is
avoided.

Where the weights come from (said in the report's `source`), as a replay's: the run's snapshot at or before that step
when this process holds the run (then the lane's own recipe re-trains to it), else the lane re-trained from its seed.
Every raced recipe starts from that one state (weights cast, optimizer state carried, the lane's loss scale, its
scheduler's position) and sees the same batches in the run's order, interleaved step by step. A recipe breaks at its
first non-finite loss, the failure a forecast of an overflow predicts (a step the GradScaler skips for a gradient
overflow is its routine, as the forecaster treats it); a broken recipe stops there, as a run's lane does.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from amp_core.config import ConfigError, RunConfig
from amp_core.diagnostics.jobs import start_job
from amp_core.diagnostics.replay import (
    _fork,
    _from_snapshot,
    _run_threads,
    _step_once,
    resolve_lane,
    start_from_seed,
)
from amp_core.diagnostics.replay_modes import set_rng
from amp_core.precision import BASELINE_MODE, KEEP_PREFIX, get_precision, resolve_device
from amp_core.precision.switches import pin_intra_op_threads
from amp_core.probes.headroom import FORECAST_EVENT, first_warning
from amp_core.race.snapshots import ReplayError
from amp_core.runs import SourceKind
from amp_core.workloads import WORKLOADS

FIX_RACED_EVENT = "forecast_fix"
"""Event kind: a race of a forecast's fixes (data: {"race": FixRace.to_data()})."""
MARGIN_SHARE = 0.25
"""The race runs past the forecast interval's end by this share of the steps from its start to that end (at least
MARGIN_MIN): a break a little later than forecast is still seen."""
MARGIN_MIN = 20
MAX_STEPS = 5000
"""A race never runs longer than this (a forecast that far ahead is beyond the forecaster's horizon anyway)."""
BF16_OF = {"16-mixed": "bf16-mixed", "16-true": "bf16-true"}
"""A mode whose format is fp16 -> the same recipe in bf16: fp32's range, the headroom an fp16 limit lacks."""


def forecast_fixes(recipe: str, forecast: dict) -> list[tuple[str, str]]:
    """The fixes a forecast (a `forecast` event's data) names for a lane of `recipe`, first the one to try first:
    (recipe, why). Keeping the layer in fp32 removes the format from that layer alone; the bf16 recipe (for an fp16
    limit) moves every layer to a format with fp32's range at fp16's size."""
    module, limit = forecast["module"], forecast["limit"]
    which = "largest value" if limit == "max" else "smallest normal"
    fixes = [(f"{recipe}+{KEEP_PREFIX}{module}",
              f"the layer computes in fp32 and never meets {forecast['format']}'s {which}")]
    base, *options = recipe.split("+")
    if forecast["format"] == "fp16" and base in BF16_OF:
        fixes.append(("+".join([BF16_OF[base], *options]),
                      "bf16 has fp32's range: " + ("some 2^112 times fp16's largest value" if limit == "max" else
                                                   "its smallest normal is 2^-126, fp16's 2^-14")))
    return fixes


@dataclass(frozen=True, slots=True)
class FixLane:
    """One raced recipe."""

    recipe: str
    why: str
    """What it changes ('' for the lane as it is and the fp32 reference)."""
    broke_at: int | None
    """Its first step with a non-finite loss, or None."""
    steps: int
    """Steps it trained in the race (up to and including the break)."""
    last_loss: float
    """Its last finite loss (NaN when it had none)."""
    skipped: int
    """Steps its GradScaler skipped."""


@dataclass(slots=True)
class FixRace:
    """A race of a forecast's fixes from the lane's state at `start_step`."""

    run_id: str
    lane: int
    recipe: str
    forecast: dict
    """The `forecast` event's data the race acts on (module, format, limit, predicted_step, lo_step, hi_step, ...)."""
    told_step: int
    start_step: int
    last_step: int
    """The race trained steps start_step..last_step."""
    source: str
    lanes: list[FixLane]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def lane_of(self, recipe: str) -> FixLane | None:
        return next((lane for lane in self.lanes if lane.recipe == recipe), None)

    @property
    def original(self) -> FixLane:
        return self.lanes[0]

    @property
    def verdict(self) -> str:
        """avoided (the lane broke and a fix did not) | not-avoided (every fix broke too) | did-not-break (the lane
        as it is trained through the race: nothing to avoid here)."""
        if self.original.broke_at is None:
            return "did-not-break"
        fixes = self.lanes[1:-1] if self.lanes[-1].recipe == BASELINE_MODE else self.lanes[1:]
        return "avoided" if any(lane.broke_at is None for lane in fixes) else "not-avoided"

    def line(self) -> str:
        """One line: did the break come, and which fix avoided it."""
        f = self.forecast
        span = f"steps {self.start_step}-{self.last_step}"
        predicted = f"forecast step {f['predicted_step']} ({f['lo_step']}–{f['hi_step']})"
        if self.verdict == "did-not-break":
            return (f"{self.recipe} did not break in the race ({span}; {predicted}): the forecast did not come true "
                    "from these weights, nothing to avoid")
        broke = f"{self.recipe} breaks at step {self.original.broke_at} ({predicted})"
        held = [lane.recipe for lane in self.lanes[1:] if lane.broke_at is None and lane.recipe != BASELINE_MODE]
        if held:
            return f"{broke}; {' and '.join(held)} trained through step {self.last_step}: the break is avoided"
        return f"{broke}; every fix broke too: the break is not avoided by them"

    def to_data(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in FixRace.__slots__ if name != "lanes"}
        data["lanes"] = [asdict(lane) for lane in self.lanes]
        return data

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> FixRace:
        fields = {key: value for key, value in data.items() if key in cls.__slots__}
        fields["lanes"] = [FixLane(**{**lane, "last_loss": math.nan if lane.get("last_loss") is None
                                      else lane["last_loss"]}) for lane in data.get("lanes", [])]
        return cls(**fields)


def acted_forecast(events, lane: int, told_at: int | None = None) -> tuple[int, dict] | None:
    """(the step it was told at, its data) of the forecast to act on, or None when the lane has none: the one told
    at `told_at`, else the first warning of the lane's latest forecast (the earliest told forecast of the same layer,
    tensor, format and limit since another was told): the weights a user would have acted on, the most warning."""
    if events.empty:
        return None
    told = events[(events["kind"] == FORECAST_EVENT) & (events["lane"] == lane)].sort_values("step", kind="stable")
    if told.empty:
        return None
    if told_at is not None:
        at = told[told["step"] == told_at]
        if at.empty:
            raise ConfigError("told_at", f"lane {lane} told no forecast at step {told_at}; it told forecasts at steps "
                                         f"{', '.join(str(int(s)) for s in told['step'])}")
        return told_at, at.iloc[-1]["data"]
    return first_warning(list(zip(told["step"], told["data"], strict=True)))


def race_fix(manager: Any, run_id: str, lane: str | int, *, told_at: int | None = None, steps: int | None = None,
             record: bool = False) -> FixRace:
    """Race the fixes (forecast_fixes) of a forecast of lane `lane` (acted_forecast: the one told at `told_at`, else
    the first warning of its latest) against the lane as it is and 32-true, from its state just after the step the
    forecast was told, for `steps` steps (default: past the forecast's interval by
    MARGIN_SHARE). ReplayError / ConfigError naming the field for a run, lane or forecast it cannot race; `record`:
    the report becomes a `forecast_fix` event of the run."""
    info = manager.run_info(run_id)
    if info is None:
        raise ReplayError("run", f"no run {run_id!r} in this process or the store")
    index = resolve_lane(info, lane)
    entry = info.lane_info(index)
    if info.kind in (SourceKind.MONITOR, SourceKind.INTEGRATION):
        raise ReplayError("run", f"run {run_id} is an attached run: its weights live in the process that wrote it. "
                                 "Race the fix there: keep the forecast's layer with "
                                 "amp_core.fixes.keep_in_fp32(model, [name])")
    found = acted_forecast(manager.events(run_id), index, told_at)
    if found is None:
        raise ReplayError("lane", f"lane {index} ({entry.mode}) of run {run_id} has no forecast: nothing to act on "
                                  "(`amp-lab forecast` says why per layer)")
    told_step, forecast = found
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError("steps", f"must be a whole number >= 1, got {steps!r}")
    config = RunConfig.from_dict(info.config)
    if config.workload not in WORKLOADS:
        raise ReplayError("run", f"workload {config.workload!r} is not registered in this process (load its plugin "
                                 "module to race the fix)")
    workload = WORKLOADS[config.workload]
    start_step = told_step + 1  # the forecast was told after its step: the race starts from the weights it saw
    if steps is None:
        end = max(forecast["hi_step"], forecast["predicted_step"])
        steps = min(end - start_step + max(MARGIN_MIN, math.ceil(MARGIN_SHARE * (end - start_step))), MAX_STEPS)
    run = manager.get(run_id)
    device = resolve_device(config.device)
    mode, seed = entry.mode, entry.meta.get("seed", config.seed)
    start = None
    notes: list[str] = []
    if run is not None:
        device, data = run.device, run.data
        if data is None:
            raise ReplayError("run", f"run {run_id} has not loaded its data yet")
        try:
            with run.snapshots.lease(index, start_step) as snapshot:
                start = _from_snapshot(config, index, mode, snapshot, workload, data, device)
        except ReplayError as error:  # evicted from the ring (or snapshots off): the seed gives the same weights
            notes.append(f"no snapshot at or before step {start_step} ({error.why}): re-trained from the seed")
    if start is None:
        data, start = start_from_seed(config, index, mode, seed, workload, device)
    fixes = forecast_fixes(entry.mode, forecast)
    recipes = [(entry.mode, ""), *fixes, (BASELINE_MODE, "")]
    threads = _run_threads(manager.events(run_id))
    report = _race(config, start, data, recipes, start_step, steps, threads)
    report.run_id, report.lane, report.forecast, report.told_step = run_id, index, dict(forecast), told_step
    report.notes = notes + report.notes
    if record:
        manager.record_event(run_id, FIX_RACED_EVENT, report.line(), index, told_step, race=report.to_data())
    return report


def _with_scheduler(config: RunConfig, state, pre) -> None:
    """The fork gets the lane's LR schedule where it stands (a long race crosses much of it)."""
    if not pre.has_scheduler:
        return
    state.scheduler = torch.optim.lr_scheduler.OneCycleLR(state.optimizer, max_lr=config.lr, total_steps=config.steps,
                                                          cycle_momentum=config.optimizer == "sgd")
    state.scheduler.load_state_dict(pre.scheduler.state_dict())


def _race(config: RunConfig, start, data, recipes: list[tuple[str, str]], start_step: int, steps: int,
          threads: int | None) -> FixRace:
    began = time.perf_counter()
    own_threads = torch.get_num_threads()
    device = start.state.precision.device
    devices = [torch.device(device)] if start.state.precision.device_type == "cuda" else []
    if threads:
        pin_intra_op_threads(threads)
    try:
        with torch.random.fork_rng(devices=devices):  # the race's draws leave the process's RNG as it was
            set_rng(start.rng, device)
            state, batch = start.state, start.batch
            for s in range(start.step, start_step):  # the lane's own recipe, to the step the forecast was told
                _step_once(state, batch, s)
                batch = data.sample(start.data_order, config.batch_size)
            scale = state.scaler.get_scale() if state.scaler.is_enabled() else None
            forks = []
            for recipe, _ in recipes:
                precision = get_precision(recipe, device)
                fork = _fork(config, state, precision, scale if precision.uses_scaler else None)
                _with_scheduler(config, fork, state)
                forks.append(fork)
            rng = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
            broke: list[int | None] = [None] * len(recipes)
            trained, skipped = [0] * len(recipes), [0] * len(recipes)
            last = [math.nan] * len(recipes)
            for offset in range(steps):
                step = start_step + offset
                for index, fork in enumerate(forks):
                    if broke[index] is not None:
                        continue
                    set_rng(rng, device)
                    result = _step_once(fork, batch, step)  # resolved: on CUDA a sync per step, the race's thread
                    trained[index] += 1
                    skipped[index] += bool(result.skipped)
                    if math.isfinite(result.loss):
                        last[index] = float(result.loss)
                    else:
                        broke[index] = step
                batch = data.sample(start.data_order, config.batch_size)
                rng = [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]
    finally:
        if threads:
            pin_intra_op_threads(own_threads)
    lanes = [FixLane(recipe=recipe, why=why, broke_at=broke[i], steps=trained[i], last_loss=last[i],
                     skipped=skipped[i]) for i, (recipe, why) in enumerate(recipes)]
    return FixRace(run_id="", lane=-1, recipe=recipes[0][0], forecast={}, told_step=start_step - 1,
                   start_step=start_step, last_step=start_step + steps - 1, source=start.source, lanes=lanes,
                   seconds=time.perf_counter() - began)


def recorded_fix_races(events, lane: int | None = None) -> list[FixRace]:
    """The fix races recorded in a run's events (of `lane`, or every lane), oldest first."""
    if events.empty:
        return []
    rows = events[events["kind"] == FIX_RACED_EVENT]
    if lane is not None:
        rows = rows[rows["lane"] == lane]
    return [FixRace.from_data(data["race"]) for data in rows["data"]]



@dataclass(eq=False)
class FixRaceJob:
    """A fix race on a thread of its own (a page starts it and polls `done`; neither the training thread nor the
    page's script waits): `race` when it ended with one, else `error` in words."""

    run_id: str
    lane: int
    race: FixRace | None = None
    error: str = ""
    done: bool = False


def start_fix_race(manager: Any, run_id: str, lane: int, *, told_at: int | None = None) -> FixRaceJob:
    """`race_fix(..., record=True)` on a background thread (amp_core.background: stopped at exit)."""
    return start_job(FixRaceJob(run_id, lane), "race",
                     lambda: race_fix(manager, run_id, lane, told_at=told_at, record=True),
                     f"amp-fix-race-{run_id}-{lane}")
