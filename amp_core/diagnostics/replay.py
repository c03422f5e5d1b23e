"""Replay: was it the precision or the data? Rolling snapshots of each lane's state kept as a run trains, and the
replay of one step from the nearest of them in every mode of the run and in fp32 (and float64), on copies and off
the training thread, with a verdict and the figures that decided it.

Where the weights before step S come from (said in every report's `source`):
- In the process that runs (or ran) the race: its SnapshotRing, the newest snapshot at or before S; the lane's own
  mode then re-trains from it to S with the run's batches (a function of the seed and the step: the snapshot keeps
  the data generator's state) and its faults.
- A stored run from another process (the CLI on a run the dashboard made, or the reverse): nothing of its state
  survives in the store, so the lane is re-trained from its seed, alone, from step 0 to S. Both are bit-exact on a
  CPU with the run's intra-op threads (each report says whether the recorded loss of S came back exactly) for models
  that draw no random numbers in their step (every built-in); a model with dropout gets the RNG state of the
  snapshot, which other lanes' interleaved draws moved in the run, and the report says so when its loss differs.

A compiled lane (`+compile...`) re-trains and replays compiled, with its compile options (amp_core.race.compiled): the
program the run ran. Every compiled recipe is replayed twice, compiled and as `<recipe> (eager)`, and the report's notes
say whether compiling changed the loss, whether the step breaks, and the verdict (judged on the compiled rows). Where
inf/NaN first appears is probed on an eager copy (layer numerics hooks each module; a compiled graph has no modules).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import torch

from amp_core.config import RunConfig
from amp_core.diagnostics.replay_modes import (
    EAGER_TWIN,
    REPLAYED_EVENT,
    Fork,
    ReplayReport,
    ReplaySubject,
    as_run,
    compile_notes,
    judge,
    named_first,
    replay_modes,
    replay_targets,
    report_data,
    set_rng,
)
from amp_core.precision import (
    Precision,
    availability,
    compile_option,
    resolve_device,
)
from amp_core.precision.switches import pin_intra_op_threads
from amp_core.probes.faults import FaultPlan
from amp_core.probes.numerics import probe_step
from amp_core.probes.spikes import SpikeRule, loss_band
from amp_core.race.compiled import compile_in_place
from amp_core.race.snapshots import ReplayError, StateSnapshot, copy_tree, load_scaler
from amp_core.race.step import LaneState, build_lane_state, build_optimizer, train_step
from amp_core.runs import RunInfo
from amp_core.telemetry import SamplingSchedule, resolve_step
from amp_core.workloads import WORKLOADS, Data, Workload

PLANTED_IN_EVERY_MODE = ("loss_scale", "grad_inf", "grad_nan", "lr_scale", "batch_outlier")
"""Fault kinds a replay plants on step S in every mode, as the run planted them in the lane."""


@dataclass(slots=True)
class _Start:
    """Where the lane's own mode starts re-training: its state, RNG, data order and batch at `step`."""

    state: LaneState
    step: int
    batch: tuple[torch.Tensor, torch.Tensor]
    data_order: torch.Generator
    rng: list[torch.Tensor] | None
    source: str


def _fresh_base(workload: Workload, config: RunConfig, data: Data, seed: int | None) -> torch.nn.Module:
    """A model of the run's architecture built without moving the process's RNG (seeded as the run's, if `seed`)."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return workload.build_model(config.size, data)


def _from_snapshot(config: RunConfig, lane: int, mode: str, snapshot: StateSnapshot, workload: Workload, data: Data,
                   device: str) -> _Start:
    if snapshot.copied is not None:
        snapshot.copied.synchronize()  # the snapshot's device-to-host copies (replay thread only)
    state = build_lane_state(config, lane, mode, _fresh_base(workload, config, data, None), workload, device)
    state.model.load_state_dict(snapshot.model)
    # load_state_dict may keep the tensors it is given as the optimizer's own: it must get copies, or the replay's
    # steps would write into the snapshot (copied as the snapshot was: a low-bit state has no deepcopy).
    state.optimizer.load_state_dict(copy_tree(snapshot.optimizer))
    if snapshot.scheduler is not None:
        state.scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
    load_scaler(state.scaler, snapshot.scaler)
    order = torch.Generator()
    order.set_state(snapshot.data_order)
    return _Start(state, snapshot.step, snapshot.batch, order, snapshot.rng,
                  f"snapshot of step {snapshot.step} in this process, then {mode} re-trained to the step")


def start_from_seed(config: RunConfig, lane: int, mode: str, seed: int, workload: Workload,
                    device: str) -> tuple[Data, _Start]:
    """(the data, the lane's start) re-trained from its seed in this process, for a run not held here (ReplayError if
    `mode` cannot run on `device`)."""
    ok, reason = availability(mode, device)
    if not ok:
        raise ReplayError("device", f"{mode} cannot run here: {reason}")
    data = workload.load_data(config)
    return data, _from_seed(config, lane, mode, seed, workload, data, device)


def _from_seed(config: RunConfig, lane: int, mode: str, seed: int, workload: Workload, data: Data,
               device: str) -> _Start:
    state = build_lane_state(config, lane, mode, _fresh_base(workload, config, data, seed), workload, device)
    order = torch.Generator().manual_seed(seed)
    batch = data.sample(order, config.batch_size)
    return _Start(state, 0, batch, order, None,
                  f"no snapshot in this process (a stored run): lane {lane} re-trained alone from its seed, step 0")


def _fork(config: RunConfig, pre: LaneState, precision: Precision, scale: float | None) -> LaneState:
    """A copy of the lane's state before S in another precision: weights cast, optimizer state loaded (and cast),
    the given loss scale, the lane's faults; no scheduler (it acts only after the step replayed)."""
    model = precision.prepare_module(copy.deepcopy(pre.model))
    optimizer = build_optimizer(config, model, precision)
    carry_optimizer_state(optimizer, pre.optimizer)
    s = config.scaler
    scaler = precision.make_scaler(scale if scale is not None else s.init_scale, s.growth_factor, s.backoff_factor,
                                   s.growth_interval)
    return LaneState(index=pre.index, precision=precision, workload=pre.workload, model=model, optimizer=optimizer,
                     scaler=scaler, grad_clip=pre.grad_clip, faults=FaultPlan(pre.faults.faults),
                     schedule=SamplingSchedule(grad_norm_every=1))


def _plain_value(value: Any) -> Any:
    """An optimizer state's value as plain values: a tensor subclass (torchao's 8-bit / 4-bit / FP8 moments) as the
    fp32 values it stands for."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    value = value.detach()
    if type(value).dequantize is not torch.Tensor.dequantize:  # a subclass with a format of its own
        return value.dequantize()
    return value.clone()


MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
"""Adam(W)'s moments, by their names in torch's and torchao's optimizer states."""


def carry_optimizer_state(target: torch.optim.Optimizer, source: torch.optim.Optimizer) -> None:
    """Load `source`'s state into `target`, a fresh optimizer of another recipe over a copy of the same parameters:
    every moment by its values (a low-bit moment dequantized), then kept in the target's own format (torchao's
    Adam(W) quantize what is copied into their buffers; torch's casts it to the parameter's dtype); each LR in the
    type the target keeps it in (torchao: a tensor, torch: a float)."""
    saved = source.state_dict()
    lr_tensors = [isinstance(group["lr"], torch.Tensor) for group in target.param_groups]
    target.load_state_dict({
        "state": {key: {name: _plain_value(value) for name, value in state.items()}
                  for key, state in saved["state"].items()},
        "param_groups": [{name: _plain_value(value) for name, value in group.items()}
                         for group in saved["param_groups"]]})
    for group, tensor in zip(target.param_groups, lr_tensors, strict=True):
        lr = float(group["lr"])
        group["lr"] = torch.tensor(lr, dtype=torch.float32) if tensor else lr
    new_buffer = getattr(target, "_new_buffer", None)  # torchao's Adam(W): a moment's buffer in its format
    if new_buffer is None:
        return
    for group in target.param_groups:
        for param in group["params"]:
            state = target.state.get(param, {})
            for name in MOMENTS:
                if name in state:
                    buffer = new_buffer(param, name == "exp_avg")
                    buffer.copy_(state[name])
                    state[name] = buffer


def _step_once(state: LaneState, batch: tuple[torch.Tensor, torch.Tensor], step: int):
    result = train_step(state, batch, step)
    return resolve_step(state.meter, result, wait=True)  # a host sync on CUDA: the replay's thread, not the run's


def replay_step(*, config: RunConfig, run_id: str, lane: int, mode: str, seed: int, step: int, start: _Start,
                data: Data, history: list[float], recorded_loss: float | None, scales: dict[str, float],
                rule: SpikeRule, threads: int | None = None) -> ReplayReport:
    """Re-train the lane's own mode from `start` to `step`, then run `step` once in every mode of the run and in the
    references, each on its own copy of the weights before it. `history`: the lane's recorded losses before `step`
    (for the band); `scales`: per mode with a scaler, the scale the run's lane of that mode used at `step`."""
    began = time.perf_counter()
    device = start.state.precision.device
    own_threads = torch.get_num_threads()
    notes: list[str] = []
    if threads:
        pin_intra_op_threads(threads)  # the run's intra-op threads: reductions then sum in the same order
    devices = [torch.device(device)] if start.state.precision.device_type == "cuda" else []
    compiled = compile_option(start.state.precision)
    if compiled is not None:  # a compiled lane re-trains and replays compiled, as it ran (its eager row: a copy)
        compile_in_place(start.state.model, compiled.compile_mode)
    try:
        with torch.random.fork_rng(devices=devices):  # the replay's draws leave the process's RNG as it was
            set_rng(start.rng, device)
            state, batch = start.state, start.batch
            for s in range(start.step, step):
                _step_once(state, batch, s)
                batch = data.sample(start.data_order, config.batch_size)
            state.faults.take_fired()
            fired = [fault.describe() for fault in state.faults.faults if fault.kind in PLANTED_IN_EVERY_MODE
                     and fault.active(step)]
            subject = _LaneSubject(config, state, batch, step, scales)
            rows = replay_modes(subject, replay_targets(config.modes, device, notes), loss_band(history, rule),
                                devices)
    finally:
        if threads:
            pin_intra_op_threads(own_threads)
    band = loss_band(history, rule)
    verdict = judge(as_run(rows), band, rule, fired)  # the programs the run ran: a compiled recipe's compiled row
    notes += compile_notes(rows, band, rule, fired, verdict)
    report = ReplayReport(run_id=run_id, lane=lane, mode=mode, step=step, source=start.source,
                          start_step=start.step, rows=rows, recorded_loss=recorded_loss, band=band, rule=rule,
                          faults=fired, verdict=verdict, notes=notes, replay_s=time.perf_counter() - began)
    if report.reproduced is False and start.rng is not None:
        notes.append("a model that draws random numbers in its step (dropout) saw other lanes' draws in the run: its "
                     "replay is not bit-exact")
    if report.reproduced is False and threads is None:
        notes.append("the run's intra-op threads are unknown here: a sum in another order may differ in its last bits")
    return report


class _LaneSubject(ReplaySubject):
    """A lane of the race before step S: its forks run the run's own train_step, its faults included."""

    def __init__(self, config: RunConfig, pre: LaneState, batch: tuple[torch.Tensor, torch.Tensor], step: int,
                 scales: dict[str, float]):
        self.config, self.pre, self.batch, self.step, self.scales = config, pre, batch, step, scales
        self.device, self.own_mode = pre.precision.device, pre.precision.recipe
        self.fp32_weights = copy.deepcopy(pre.model).float()  # the layer probe's starting point (an exact upcast)
        self.outlier = FaultPlan(pre.faults.faults).perturb_batch(step, batch)

    def fork(self, name: str, precision: Precision) -> Fork:
        """The own recipe steps the lane's own state (compiled when the lane is); any other, and a compiled recipe's
        `(eager)` row, a copy (a copy of a compiled module is eager), compiled again for a compiled recipe's own
        row with the recipe's compile options."""
        option = compile_option(precision)
        eager_twin = name.endswith(EAGER_TWIN)
        if name == self.own_mode:
            state, source = self.pre, "the lane's own scaler" if precision.uses_scaler else ""
        else:
            recipe = name.removesuffix(EAGER_TWIN)
            scale = self.scales.get(recipe) if precision.uses_scaler else None
            source = ("" if not precision.uses_scaler else
                      "the run's lane of this mode at this step" if scale is not None else "the initial scale")
            state = _fork(self.config, self.pre, precision, scale)
            if option is not None and not eager_twin:
                compile_in_place(state.model, option.compile_mode)

        def step() -> tuple[float, bool, float | None, float | None]:
            result = _step_once(state, self.batch, self.step)
            return result.loss, bool(result.skipped), result.scale, result.scale_after

        return Fork(state.model, state.params, step, source, compiled=option is not None and not eager_twin)

    def first_nonfinite(self, precision: Precision, scale: float | None) -> tuple[str, str]:
        return named_first(probe_step(self.fp32_weights, precision, self.pre.workload.loss, self.outlier,
                                 scale=scale).first_nonfinite)


# --- entry points: a run of this process, or a stored one -------------------------------------------------------

def _lane_records(steps_frame, lane: int, step: int) -> tuple[list[float], float | None]:
    mine = steps_frame[steps_frame["lane"] == lane].sort_values("step")
    before = mine[mine["step"] < step]["loss"].astype(float).tolist()
    at = mine[mine["step"] == step]["loss"]
    return before, (float(at.iloc[0]) if len(at) else None)


def _scales_at(steps_frame, info: RunInfo, lane: int, step: int) -> dict[str, float]:
    """Per mode, the scale the run's lane of that mode (the same seed as `lane`) used at `step`, from the records."""
    seed = info.lanes[lane].meta.get("seed")
    scales = {}
    for other in info.lanes:
        if other.meta.get("seed") != seed:
            continue
        row = steps_frame[(steps_frame["lane"] == other.lane) & (steps_frame["step"] == step)]
        if len(row) and row["scale"].notna().iloc[0]:
            scales[other.mode] = float(row["scale"].iloc[0])
    return scales


def resolve_lane(info: RunInfo, lane: str | int) -> int:
    """A lane by number, or by mode name (its first seed's lane); ReplayError naming the choices."""
    lanes = info.lanes
    text = str(lane).strip()
    if text.isdigit():
        index = int(text)
        if info.lane_info(index) is None:
            raise ReplayError("lane", f"run {info.run_id} has lanes 0-{len(lanes) - 1}, not {index}")
        return index
    for entry in lanes:
        if entry.mode == text:
            return entry.lane
    raise ReplayError("lane", f"run {info.run_id} has no lane {text!r}; its lanes: "
                              f"{', '.join(f'{e.lane} ({e.mode})' for e in lanes)}")


def replay_run(manager: Any, run_id: str, lane: str | int, step: int, rule: SpikeRule | None = None, *,
               record: bool = False) -> ReplayReport:
    """Replay step `step` of lane `lane` (a number or a mode name) of run `run_id` through a RunManager: from the
    run's snapshots when this process holds the run, else by re-training the lane from its seed. `record`: the
    report also becomes a `replayed` event of the run (`record_replay`). ReplayError (a ConfigError) naming the field
    for an unknown run, lane or step, or a step out of the snapshots' reach."""
    rule = rule or SpikeRule()
    info = manager.run_info(run_id)
    if info is None:
        raise ReplayError("run", f"no run {run_id!r} in this process or the store")
    index = resolve_lane(info, lane)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ReplayError("step", f"must be a whole number >= 0, got {step!r}")
    if info.attached:
        raise ReplayError("run", f"run {run_id} is an attached run: its model and data live in the process that "
                                 "wrote it, so AMP Lab cannot re-run its steps (its first inf/NaN events name where it "
                                 "broke)")
    config = RunConfig.from_dict(info.config)
    entry = info.lane_info(index)
    done = entry.steps_done
    if step >= done:
        raise ReplayError("step", f"lane {index} ({entry.mode}) has recorded steps 0-{done - 1}, not {step}"
                          if done else f"lane {index} ({entry.mode}) has recorded no step yet")
    if config.workload not in WORKLOADS:
        raise ReplayError("run", f"workload {config.workload!r} is not registered in this process (load its plugin "
                                 "module to replay it)")
    workload = WORKLOADS[config.workload]
    steps_frame = manager.steps(run_id, 0, step + 1)
    history, recorded = _lane_records(steps_frame, index, step)
    scales = _scales_at(steps_frame, info, index, step)
    events = manager.events(run_id)
    if (events["kind"] == "job").any():
        raise ReplayError("run", f"run {run_id} is a torchrun job: each of its steps all-reduces several ranks' "
                                 "batches, which one process cannot replay")
    threads = _run_threads(events)
    mode, seed = entry.mode, entry.meta.get("seed", config.seed)
    run = manager.get(run_id)
    device = resolve_device(config.device)
    if run is not None:
        device = run.device
        data = run.data
        if data is None:
            raise ReplayError("run", f"run {run_id} has not loaded its data yet")
        with run.snapshots.lease(index, step) as snapshot:
            start = _from_snapshot(config, index, mode, snapshot, workload, data, device)
    else:
        data, start = start_from_seed(config, index, mode, seed, workload, device)
    report = replay_step(config=config, run_id=run_id, lane=index, mode=mode, seed=seed, step=step, start=start,
                         data=data, history=history, recorded_loss=recorded, scales=scales, rule=rule,
                         threads=threads)
    if record:
        record_replay(manager, report)
    return report


def record_replay(manager: Any, report: ReplayReport) -> None:
    """The report as a `replayed` event of its run (RunManager.record_event): the pages and a workshop scenario's
    checks read it from the records."""
    manager.record_event(report.run_id, REPLAYED_EVENT, f"step {report.step} replayed in every mode: "
                                                        f"{report.verdict.line()}", report.lane, report.step,
                         report=report_data(report))


def _run_threads(events) -> int | None:
    """The run's intra-op threads, from its `started` event."""
    started = events[events["kind"] == "started"]
    for data in started["data"]:
        if isinstance(data, dict) and data.get("intra_op_threads"):
            return int(data["intra_op_threads"])
    return None
