"""Rolling snapshots of each lane's state, taken on the training thread between two steps (the engine's: the runner
keeps them through SnapshotHook; replays in amp_core.diagnostics read them), and a lane's copy for the op inspector
(LaneSnapshot)."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from amp_core.config import ConfigError
from amp_core.precision import Precision
from amp_core.race.step import LaneState
from amp_core.torch_private import scaler_tensors
from amp_core.workloads import Workload


class ReplayError(ConfigError):
    """A replay that cannot be made (an unknown lane, a step out of reach); `field` names the input."""


# --- snapshots (taken on the training thread, between two steps) --------------------------------------------------

@dataclass(slots=True)
class StateSnapshot:
    """One lane's state on the host before one step: enough to train on from there exactly as the run did."""

    lane: int
    step: int
    """The state is the lane's as it was before this step."""
    model: dict[str, torch.Tensor]
    """The model's state_dict (parameters and buffers)."""
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    scaler: dict[str, torch.Tensor] | None
    """The GradScaler's scale and growth tracker (None: the mode has no scaler)."""
    rng: list[torch.Tensor]
    """The process's random state before the lane's step: the CPU's, and the GPU's on CUDA."""
    batch: tuple[torch.Tensor, torch.Tensor]
    """This step's batch, as the run drew it (before any fault)."""
    data_order: torch.Tensor
    """The state of the lane's data generator after this step's batch was drawn: the next batches come from it."""
    nbytes: int
    copied: Any = None
    """CUDA: an event that completes when the device-to-host copies have landed (a replay waits on it)."""


class PinnedCopies:
    """Device-to-host copies of one device's lane states without a host sync: into pinned buffers reused from one
    snapshot to the next (allocating pinned memory synchronises the device), on a side stream that first waits, on
    the device, for an event recorded on the lane's stream (the state as of the snapshot), so the copies stay off the
    lane's stream; `done` is recorded behind them. The lane's stream waits for `done` before it next writes the state
    (step.LaneState.copies_pending: before the optimizer step), again on the device."""

    def __init__(self, device: torch.device, sets: int):
        """`sets`: how many snapshots' buffers to allocate the first time a tensor is copied (the ring's size and
        one: all of them at the first snapshot, so the pinned allocations' syncs come once, at the start)."""
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.sets = sets
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._first: dict[tuple, int] | None = {}
        """Buffers of each (shape, dtype) the first snapshot used (None once the others were allocated)."""

    def begin(self) -> None:
        """Order the side stream's next copies after what the lane's stream has queued so far (an event, waited for
        on the device): `done` then also covers the copies made on the lane's stream before."""
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(queued)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (on the device) into a pinned host buffer, on the side stream (call inside `torch.cuda.stream`)."""
        key = (tuple(tensor.shape), tensor.dtype)
        pool = self._free.get(key)
        if self._first is not None:
            self._first[key] = self._first.get(key, 0) + 1
        # Empty: the first snapshot, or a replay still reads the snapshot that left the ring.
        out = pool.pop() if pool else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return out.copy_(tensor, non_blocking=True)

    def done(self) -> torch.cuda.Event:
        """The event behind this snapshot's copies. After the first snapshot, the buffers of the others are allocated
        at once (`sets`), so that no later snapshot allocates pinned memory."""
        event = torch.cuda.Event()
        event.record(self.stream)
        if self._first is not None:
            for (shape, dtype), count in self._first.items():
                self._free.setdefault((shape, dtype), []).extend(
                    torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(count * (self.sets - 1)))
            self._first = None
        return event

    def give_back(self, tree: Any) -> None:
        """The pinned buffers of a snapshot no one reads any more, for the next snapshot's copies (which the side
        stream orders after this snapshot's own)."""
        for tensor in _tensors(tree):
            if tensor.is_pinned() and type(tensor) is torch.Tensor:
                self._free.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)


def _tensors(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)


def _host_copy(tensor: torch.Tensor, pinned: PinnedCopies | None = None) -> torch.Tensor:
    """A host copy. From a GPU into pinned memory without waiting (non_blocking): the snapshot adds no host sync; with
    `pinned`, into its reused buffers on its side stream."""
    tensor = tensor.detach()
    if hasattr(tensor, "to_local"):
        # A DTensor (FSDP2's sharded parameters and states): its _to_copy copies this rank's shard. (Its flattened
        # attributes hold its device mesh, not only the shard.)
        return tensor.to("cpu", copy=True)
    if type(tensor) is not torch.Tensor:
        # A tensor subclass (torchao's 8-bit / 4-bit / FP8 optimizer states: codes and scales) implements no
        # aten.clone, and its _to_copy to the device it is on hands back its own inner tensors (a "copy" the next
        # step writes into): it is rebuilt from copies of its inner tensors.
        names, context = tensor.__tensor_flatten__()
        inner = {name: _host_copy(getattr(tensor, name), pinned) for name in names}
        return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())
    if tensor.device.type == "cpu":
        return tensor.clone()
    if pinned is not None:
        return pinned.copy(tensor)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return out.copy_(tensor, non_blocking=True)


def copy_tree(value: Any, pinned: PinnedCopies | None = None) -> Any:
    if isinstance(value, torch.Tensor):
        return _host_copy(value, pinned)
    if isinstance(value, dict):
        return {key: copy_tree(item, pinned) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tree(item, pinned) for item in value)
    return copy.deepcopy(value)


def _tree_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tree_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tree_bytes(item) for item in value)
    return 0


def _scaler_tensors(scaler: torch.amp.GradScaler, pinned: PinnedCopies | None) -> dict[str, torch.Tensor] | None:
    if not scaler.is_enabled():
        return None
    # Copied without a wait (torch_private.scaler_tensors).
    return {name: _host_copy(tensor, pinned) for name, tensor in scaler_tensors(scaler).items()}


def load_scaler(scaler: torch.amp.GradScaler, tensors: dict[str, torch.Tensor] | None) -> None:
    if tensors is None or not scaler.is_enabled():
        return
    state = scaler.state_dict()
    state["scale"] = float(tensors["scale"].reshape(-1)[0])
    state["_growth_tracker"] = int(tensors["growth_tracker"].reshape(-1)[0])
    scaler.load_state_dict(state)


class SnapshotRing:
    """The rolling snapshots of a run's lanes: one every `every` steps per lane, the newest `keep` of each.

    The training thread takes them between steps (`take`, outside the timed window); replays read them from other
    threads (`lease`). One lock guards the rings; it is held for an append or a look-up, never for a copy. On CUDA
    the copies are PinnedCopies' (a side stream, reused pinned buffers: no host sync); a snapshot that leaves the
    ring gives its buffers back unless a replay is reading it.
    """

    def __init__(self, every: int, keep: int):
        self.every = every
        self.keep = keep
        self._lanes: dict[int, deque[StateSnapshot]] = {}
        self._lock = threading.Lock()
        self._pinned: dict[torch.device, PinnedCopies] = {}
        self._readers: dict[int, int] = {}
        """id(snapshot) -> replays reading it now."""

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def take(self, state: LaneState, step: int, batch: tuple[torch.Tensor, torch.Tensor],
             data_order: torch.Generator) -> float:
        """Snapshot `state` before `step` (whose batch is `batch`; `data_order` has drawn it). Returns its host
        seconds, which the runner reports as probe time."""
        started = time.perf_counter()
        device = torch.device(state.precision.device)
        devices = [device] if device.type == "cuda" else []
        rng = [torch.get_rng_state(), *(torch.cuda.get_rng_state(device) for device in devices)]
        pinned = None
        if devices:
            pinned = self._pinned.get(device) or self._pinned.setdefault(device, PinnedCopies(device, self.keep + 1))
        weights = state.model.state_dict()
        # Buffers (BatchNorm's running statistics: small) change in the next forward, before the lane's stream waits
        # for the side stream's copies (its optimizer step): they are copied on the lane's stream, behind its work.
        buffers = {name for name, _ in state.model.named_buffers()} if pinned is not None else set()
        model = {name: _host_copy(weights[name], pinned) for name in weights if name in buffers}
        if pinned is not None:
            pinned.begin()  # the side stream after everything queued so far, the buffers' copies included
        with torch.cuda.stream(pinned.stream) if pinned is not None else contextlib.nullcontext():
            model |= {name: _host_copy(value, pinned) for name, value in weights.items() if name not in buffers}
            optimizer = copy_tree(state.optimizer.state_dict(), pinned)
            scheduler = copy_tree(state.scheduler.state_dict()) if state.has_scheduler else None
            scaler = _scaler_tensors(state.scaler, pinned)
        copied = None
        if pinned is not None:
            copied = state.copies_pending = pinned.done()
        snapshot = StateSnapshot(
            lane=state.index, step=step, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
            rng=rng, batch=tuple(t.detach().clone() for t in batch), data_order=data_order.get_state(),
            nbytes=_tree_bytes(model) + _tree_bytes(optimizer), copied=copied)
        with self._lock:
            ring = self._lanes.setdefault(state.index, deque(maxlen=self.keep))
            leaving = ring[0] if len(ring) == ring.maxlen else None
            ring.append(snapshot)
            reusable = leaving is not None and not self._readers.get(id(leaving))
        if pinned is not None and reusable:
            pinned.give_back((leaving.model, leaving.optimizer, leaving.scaler))
        return time.perf_counter() - started

    @contextlib.contextmanager
    def lease(self, lane: int, step: int) -> Iterator[StateSnapshot]:
        """`nearest(lane, step)`, held for reading: its buffers are not reused for a later snapshot meanwhile."""
        snapshot = self.nearest(lane, step)
        with self._lock:
            self._readers[id(snapshot)] = self._readers.get(id(snapshot), 0) + 1
        try:
            yield snapshot
        finally:
            with self._lock:
                left = self._readers.pop(id(snapshot)) - 1
                if left:
                    self._readers[id(snapshot)] = left

    def steps(self, lane: int) -> list[int]:
        """The steps lane `lane` holds snapshots of, oldest first."""
        with self._lock:
            return [snapshot.step for snapshot in self._lanes.get(lane, ())]

    def nbytes(self) -> int:
        """Host bytes the snapshots hold (weights, buffers and optimizer state)."""
        with self._lock:
            return sum(snapshot.nbytes for ring in self._lanes.values() for snapshot in ring)

    def nearest(self, lane: int, step: int) -> StateSnapshot:
        """The newest snapshot of `lane` at or before `step`; ReplayError saying why there is none."""
        with self._lock:
            ring = list(self._lanes.get(lane, ()))
        if self.every <= 0:
            raise ReplayError("step", "this run keeps no snapshots (snapshot_every is 0), so its steps cannot be "
                                      "replayed in its process")
        if not ring:
            raise ReplayError("step", f"lane {lane} has no snapshot yet")
        usable = [snapshot for snapshot in ring if snapshot.step <= step]
        if not usable:
            raise ReplayError("step", f"step {step} is older than lane {lane}'s oldest snapshot (step {ring[0].step}): "
                                      f"the run keeps its newest {self.keep} snapshots, one every {self.every} steps "
                                      "(RunConfig.snapshot_keep, snapshot_every); launch with a larger "
                                      "snapshot_keep to replay that far back")
        return usable[-1]


class SnapshotHook:
    """A run's first before_lane_step hook (RunHooks) when RunConfig.snapshot_every is set: the lane's rolling state
    snapshot when one is due; returns its host seconds (probe time). Its `run` and `lane` are a runner.Run and its
    lanes.Lane (not imported: views that read snapshots must not reach the runner)."""

    def __init__(self, ring: SnapshotRing):
        self.ring = ring
        self.every = ring.every
        """Steps between two snapshots: the steps in between may be plain ones (RunHooks.plain_steps)."""

    def __call__(self, run: Any, lane: Any, step: int) -> float | None:
        if not self.ring.due(step):
            return None
        return self.ring.take(lane.state, step, run.batch_of(lane), run.generators[lane.replicate])


@dataclass(slots=True)
class LaneSnapshot:
    """A copy of a lane taken between two steps (for the op inspector): changing it changes nothing live."""

    mode: str
    step: int
    model: torch.nn.Module
    precision: Precision
    workload: Workload
    batch: tuple[torch.Tensor, torch.Tensor]
    scale: float | None = None
    """The lane's GradScaler scale at the snapshot (None: the mode has no scaler)."""


def copy_lane(mode: str, state: LaneState, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> LaneSnapshot:
    """A LaneSnapshot of `state` (its current weights) with `batch`, made between two of its steps (the caller holds
    the run's step lock); the copy holds no gradients."""
    model = copy.deepcopy(state.model)
    batch = tuple(t.clone() for t in batch)
    scaler = state.scaler
    scale = scaler.get_scale() if scaler.is_enabled() else None  # a device sync, between two steps
    for p in model.parameters():
        p.grad = None
    return LaneSnapshot(mode, step, model, state.precision, state.workload, batch, scale)
