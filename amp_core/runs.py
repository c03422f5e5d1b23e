"""Runs as typed sources: RunInfo / LaneInfo (what a page or the CLI knows of a run, read the same whether the run
trains in this process or its records come from the store), typed through: what writes it (SourceKind: a race, a
Monitor, a trainer's callback, the cost probe), its writer in words, whether this process can control it, and the one
`is_live` every page and the CLI ask.

A run is live while it can still move: it trains in this process, or the store says another process (a CLI run, a
Monitor script, a torchrun job) is writing it — its status is pending, running or paused. The store marks a run whose
writer is gone `interrupted` (its heartbeat went stale or its process ended: RunStore.check_liveness), so a stored
status stays live only while its writer is.

RunReader reads runs alike whether they train in this process (RunManager, in runner.py, holds those) or are in the
store; views take a RunReader, never the RunManager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import pandas as pd

from amp_core.config import RUN_DEFAULTS
from amp_core.records import empty_steps_frame
from amp_core.records.query import MAX_POINTS, LaneSeries, read_lane
from amp_core.records.schema import GradStats
from amp_core.records.store import LIVE_STATUSES, TRAINING_STATUSES, RunStore, StoredTrack


class SourceKind(enum.StrEnum):
    """What writes a run (its saved config says which: `source_kind`)."""

    RACE = "race"
    """A Run racing its lanes: the dashboard's, `amp-lab run`, a torchrun job, a workshop scenario."""
    MONITOR = "monitor"
    """A Monitor in the user's own training loop (the "source" a Monitor saves in its config)."""
    INTEGRATION = "integration"
    """The AMP Lab callback of a trainer (Hugging Face Trainer, Lightning), built on a Monitor."""
    PROBE = "probe"
    """The cost probe's short race (its run id starts with PROBE_RUN_PREFIX; stored only as the advisor's evidence)."""


PROBE_RUN_PREFIX = "probe-"
"""The run id of a cost probe's race starts with this."""


@dataclass(frozen=True, slots=True)
class StoredConfig:
    """A run's saved config read back typed (`read`): the one reader of what a run stored of its settings. A race saves
    RunConfig.to_dict(); a Monitor its own (attach.saved.attached_run_config), with keys a race has not and without
    the race's own. A race setting a run did not save reads as RunConfig's default (RUN_DEFAULTS: the one source of
    defaults); an attached-only one as a race has it (not watched, no budget, one rank, no trainer)."""

    name: str = RUN_DEFAULTS.name
    workload: str = RUN_DEFAULTS.workload
    size: str = RUN_DEFAULTS.size
    modes: tuple[str, ...] = RUN_DEFAULTS.modes
    steps: int = RUN_DEFAULTS.steps
    """The steps it was asked for (a Monitor's loop that did not say: 0)."""
    seeds: int = RUN_DEFAULTS.seeds
    device: str = RUN_DEFAULTS.device
    scheduler: str = RUN_DEFAULTS.scheduler
    faults: tuple[dict[str, Any], ...] = ()
    """The planned faults as saved (FaultSpec fields), read fault by fault where they are used
    (views.debugger.lane_faults): a run whose modes this machine cannot run still shows them."""
    gradstats_every: int = RUN_DEFAULTS.gradstats_every
    amax_every: int = RUN_DEFAULTS.amax_every
    source: str = ""
    """"monitor" for a Monitor's run (attach.saved.SOURCE), "" for a race."""
    integration: str = ""
    """The trainer whose callback drives the Monitor ("" when none)."""
    script: str = ""
    """The script a Monitor runs in."""
    world_size: int = 1
    layers_every: int = 0
    """A Monitor's layer watch (MonitorConfig.layers_every); a race has none."""
    probe_budget: float = 0.0
    replay: dict[str, Any] = dataclasses.field(default_factory=dict)
    """A Monitor's replay setting (AttachedReplay.describe), {} when it saved none."""

    @classmethod
    def read(cls, data: dict[str, Any]) -> StoredConfig:
        """`data` (a run's saved config) typed: its known settings, each absent or null one at its default; keys
        that no reader asks for (a Monitor's host and pid, the scaler's settings) are left in RunInfo.config."""
        known = {field.name for field in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known and value is not None}
        for key in ("modes", "faults"):
            if key in values:
                values[key] = tuple(values[key])
        if "replay" in values:
            values["replay"] = dict(values["replay"])
        return cls(**values)


def source_kind(run_id: str, config: dict) -> SourceKind:
    """The kind of a run from its id and saved config: a Monitor saves "source" (and "integration" when a trainer's
    callback drives it); a race saves its RunConfig."""
    settings = StoredConfig.read(config)
    if settings.source == SourceKind.MONITOR:
        return SourceKind.INTEGRATION if settings.integration else SourceKind.MONITOR
    return SourceKind.PROBE if run_id.startswith(PROBE_RUN_PREFIX) else SourceKind.RACE


def writer_words(kind: SourceKind, config: dict, in_process: bool) -> str:
    """Who writes a run, in words: "a Monitor in `train.py`", "the AMP Lab callback of a Hugging Face Trainer in
    `finetune.py`", "this process" (a race held here), "another AMP Lab process" (e.g. `amp-lab run`)."""
    if kind in (SourceKind.MONITOR, SourceKind.INTEGRATION):
        settings = StoredConfig.read(config)
        script = f"`{settings.script}`" if settings.script else "a script"
        return (f"the AMP Lab callback of a {settings.integration} in {script}" if kind is SourceKind.INTEGRATION
                else f"a Monitor in {script}")
    return "this process" if in_process else "another AMP Lab process"


@dataclass(frozen=True, kw_only=True, slots=True)
class LaneInfo:
    """One lane of a run."""

    lane: int
    """The lane's index in its run."""
    mode: str
    """Its precision mode (or recipe)."""
    status: str
    """pending | running | finished | stopped | diverged | failed | interrupted."""
    error: str = ""
    """Why it failed or diverged ("" otherwise)."""
    steps_done: int = 0
    """Steps recorded so far (a torchrun lane: its rank-0 track's)."""
    meta: dict = dataclasses.field(default_factory=dict)
    """What its writer saved with it (e.g. {"seed": 3}; a Monitor: {"source": "monitor", "ranks": 2})."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunInfo:
    """One run, as every page and the CLI read it."""

    run_id: str
    config: dict
    """The config its writer saved (RunConfig.to_dict(), or a Monitor's; "source" says which)."""
    status: str
    """pending | running | paused | finished | stopped | failed | interrupted."""
    in_process: bool = False
    """Its thread runs in this process (it can be paused and stopped from here)."""
    lanes: tuple[LaneInfo, ...] = ()
    problems: list[str] = dataclasses.field(default_factory=list)
    """What of its stored records could not be read so far (a damaged chunk), as messages."""
    kind: SourceKind = SourceKind.RACE
    """What writes it (`source_kind`)."""
    writer: str = ""
    """Who writes it, in words (`writer_words`)."""
    host: str = ""
    """The host its writer runs on ("" for a run held in this process)."""
    pid: int | None = None
    """Its writer's process id on `host` (None for a run held in this process)."""

    @property
    def settings(self) -> StoredConfig:
        """Its saved config, typed (StoredConfig): what every reader asks of it."""
        return StoredConfig.read(self.config)

    @property
    def attached(self) -> bool:
        """Written by a Monitor in the user's own process (alone or under a trainer's callback)."""
        return self.kind in (SourceKind.MONITOR, SourceKind.INTEGRATION)

    @property
    def controllable(self) -> bool:
        """This process can pause and stop it: a race whose thread runs here (any other run's writer decides)."""
        return self.in_process and self.kind is SourceKind.RACE

    def lane_info(self, index: int) -> LaneInfo | None:
        return next((lane for lane in self.lanes if lane.lane == index), None)


def is_live(run: RunInfo | None) -> bool:
    """Whether a run can still move: in this process, or written by another whose status the store holds live."""
    return run is not None and (run.in_process or run.status in LIVE_STATUSES)


class RunReader:
    """Every run read the same, live or stored: a run this process trains (`get`: none here; RunManager holds them)
    is read from memory, any other from the store. Thread-safe for readers."""

    def __init__(self, store: RunStore | None = None):
        self.store = store
        self._problems: dict[str, list[str]] = {}
        """Per run: what readers of its stored records could not read (a damaged chunk), said once each."""

    def get(self, run_id: str):
        """The run training in this process (None: read it from the store)."""
        return None

    def runs(self) -> list:
        """The runs held in this process."""
        return []

    def training_here(self) -> list[str]:
        """The runs training on this machine now, sharing its cores with anything measured here: those this process
        starts or trains, and those another process on this host writes (the CLI, a Monitor script) with their status
        pending or running. A run paused, or written from another host (a shared PostgreSQL store), is not counted."""
        held = self.runs()
        here = [run.run_id for run in held if run.status in TRAINING_STATUSES]
        if self.store is None:
            return here
        self.store.check_liveness()
        ours = {run.run_id for run in held}  # this process's runs: their status in memory is the newest
        return here + [run_id for run_id in self.store.running_here() if run_id not in ours]

    def list_runs(self) -> pd.DataFrame:
        """Runs in the store and in memory, newest first: run_id, name, workload, modes, status, created_at."""
        columns = ["run_id", "name", "workload", "modes", "status", "created_at"]
        if self.store is not None:
            self.store.check_liveness()
        stored = self.store.runs()[columns] if self.store is not None else pd.DataFrame(columns=columns)
        live = {r.run_id: r for r in self.runs()}
        stored = stored[~stored["run_id"].isin(live)]
        memory = pd.DataFrame([{"run_id": r.run_id, "name": r.config.name, "workload": r.config.workload,
                                "modes": list(r.config.modes), "status": r.status, "created_at": r.created_at}
                               for r in live.values()], columns=columns)
        frames = [f for f in (memory, stored) if not f.empty]
        if not frames:
            return pd.DataFrame(columns=columns)
        return pd.concat(frames, ignore_index=True).sort_values("created_at", ascending=False, ignore_index=True)

    def track_sources(self, run_id: str, reuse: list | None = None) -> list:
        """The run's tracks as sources for `amp_core.records.query`: in memory while the run is held here, else in
        the store (StoredTrack, for one reader at a time; those in `reuse` keep what they cached)."""
        run = self.get(run_id)
        if run is not None:
            return list(run.sink.records.tracks())
        if self.store is None:
            return []
        return self.store.track_sources(run_id, reuse, self._problems.setdefault(run_id, []))

    def lane_series(self, run_id: str, start: int | None = None, stop: int | None = None,
                    max_points: int = MAX_POINTS, sources: list | None = None) -> list[LaneSeries]:
        """Each track of a run read for charts and headlines: steps [start, stop) (default: all) in about
        `max_points` points per figure, exact (see amp_core.records.query). `sources`: from `track_sources`."""
        sources = self.track_sources(run_id) if sources is None else sources
        stored = self.store is not None and any(isinstance(source, StoredTrack) for source in sources)
        with self.store.snapshot() if stored else contextlib.nullcontext():  # one consistent view of the store
            series = [read_lane(source, start, stop, max_points) for source in sources]
        return [s for s in series if s.stats.records]

    def steps(self, run_id: str, start: int = 0, stop: int | None = None) -> pd.DataFrame:
        """A run's step records of steps [start, stop), every one (memory while the run is held here, else the
        store; a damaged chunk's records are left out and said in `run_info(run_id).problems`)."""
        run = self.get(run_id)
        if run is not None:
            frame = run.frame(start)
            return frame if stop is None else frame[frame["step"] < stop].reset_index(drop=True)
        if self.store is None:
            return empty_steps_frame()
        return self.store.steps(run_id, start, stop, strict=False, problems=self._problems.setdefault(run_id, []))

    def events(self, run_id: str) -> pd.DataFrame:
        """A run's events as a DataFrame (run_id, lane, step, kind, message, t_wall_s, data)."""
        run = self.get(run_id)
        if run is not None:
            return pd.DataFrame([dataclasses.asdict(e) for e in run.events()],
                                columns=["run_id", "kind", "message", "lane", "step", "t_wall_s", "data"])
        if self.store is not None:
            return self.store.events(run_id)
        return pd.DataFrame(columns=["run_id", "kind", "message", "lane", "step", "t_wall_s", "data"])

    def run_info(self, run_id: str, count_steps: bool = True) -> RunInfo | None:
        """The run as a RunInfo (config, status, lanes, problems: what of its stored records could not be read so
        far); None if neither this process nor the store knows it. `count_steps=False`: a stored run's lanes say 0
        steps done (cheaper: counting reads every track)."""
        run = self.get(run_id)
        if run is not None:
            config = run.config.to_dict()
            kind = source_kind(run_id, config)
            return RunInfo(run_id=run_id, config=config, status=run.status, in_process=run.alive, kind=kind,
                           writer=writer_words(kind, config, in_process=True),
                           lanes=tuple(LaneInfo(lane=lane.index, mode=lane.mode, status=lane.status, error=lane.error,
                                                steps_done=lane.steps_done, meta={"seed": lane.seed})
                                       for lane in run.lanes))
        if self.store is None:
            return None
        self.store.check_liveness()
        row = self.store.run(run_id)
        if row is None:
            return None
        counts: dict[int, int] = {}
        # Steps per lane: its rank-0 track's (ranks step together).
        for track in self.store.tracks(run_id) if count_steps else ():
            counts[track["lane"]] = max(counts.get(track["lane"], 0), track["records"])
        kind = source_kind(run_id, row["config"])
        return RunInfo(run_id=run_id, config=row["config"], status=row["status"], kind=kind,
                       writer=writer_words(kind, row["config"], in_process=False), host=row["host"], pid=row["pid"],
                       lanes=tuple(LaneInfo(lane=lane["lane"], mode=lane["mode"], status=lane["status"],
                                            error=lane["error"], steps_done=int(counts.get(lane["lane"], 0)),
                                            meta=lane["meta"] or {})
                                   for lane in row["lanes"]),
                       problems=list(self._problems.get(run_id, [])))

    def grad_stats(self, run_id: str, lane: int, step: int | None = None) -> list[GradStats]:
        """Gradient statistics of a lane (one step, or every sampled step)."""
        run = self.get(run_id)
        if run is not None:
            return run.sink.grad_stats.get(lane, step)
        return self.store.grad_stats(run_id, lane, step) if self.store is not None else []

    def grad_stat_steps(self, run_id: str, lane: int) -> list[int]:
        run = self.get(run_id)
        if run is not None:
            return run.sink.grad_stats.steps(lane)
        return self.store.grad_stat_steps(run_id, lane) if self.store is not None else []
