"""How a lane step is timed and weighed on each device: perf_counter on a CPU; on CUDA, events on the lane's stream,
figures copied to pinned host memory behind the step (no host sync), and the allocator's peak above the allocation
at the start of the lane's own step. Also: bytes held by tensors, bytes saved for backward."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def plain_tensors(tensor: torch.Tensor):
    """The plain tensors that hold `tensor`'s data: itself, or, for a wrapper subclass (torchao's 8-bit / 4-bit / FP8
    optimizer states, float8 tensors), its inner tensors (codes, scales, lookup tables), recursively."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        yield from plain_tensors(getattr(tensor, name))


def tensor_bytes(tensors) -> int:
    """Bytes held by the distinct storages behind `tensors` (views are counted once; a tensor subclass by the
    storages of its inner tensors: what it really holds, not its apparent dtype times its shape)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in (plain for tensor in tensors if isinstance(tensor, torch.Tensor) for plain in plain_tensors(tensor)):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def held_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state): bytes a lane holds now, read from tensor metadata (no sync)."""
    return (tensor_bytes(params), tensor_bytes(p.grad for p in params if p.grad is not None),
            tensor_bytes(optimizer_state_tensors(optimizer)))


class SavedTensorsProbe:
    """Counts the bytes autograd saves for backward during a forward (activations, autocast's cast copies).

    Parameters themselves are not counted (they are held anyway). The hooks cost a Python call per saved tensor, so
    the probe runs on a forward of its own (see step.saved_tensor_bytes), never inside a timed step.
    """

    def __init__(self, exclude: list[torch.Tensor]):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for plain in plain_tensors(tensor):  # a float8 tensor saved for backward: its data and its scale
            ptr = plain.untyped_storage().data_ptr()
            if ptr not in self._exclude and ptr not in self._seen:
                self._seen.add(ptr)
                self.bytes += plain.untyped_storage().nbytes()
        # Detached, not the tensor itself: an op that saves its own output (ReLU, exp, softmax) would hold that
        # output, whose grad_fn holds this saved copy: a cycle through C++ that Python's GC cannot see, so a graph
        # that is dropped without a backward (the probe's) would never be freed. The storage stays alive (its
        # address is not reused while the forward runs, so `_seen` counts each storage once).
        return tensor.detach()

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedTensorsProbe:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@dataclass(slots=True)
class InFlight:
    """One CUDA step's figures on their way to the host: its timing events, and pinned buffers the device fills
    behind the step. Readable once `done` has completed (event.query(): no sync)."""

    start: torch.cuda.Event
    end: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    values: torch.Tensor | None = None
    """Pinned: the values `send` queued (after the step)."""
    scale_before: torch.Tensor | None = None
    """Pinned, one element: the GradScaler scale as the step began (copied before the window: update() changes it
    in place)."""


class HostMeter:
    """A CPU lane's meter: perf_counter around the step; every figure is on the host when the step returns."""

    immediate = True

    @staticmethod
    def start() -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed_ms(started: float) -> float:
        return (time.perf_counter() - started) * 1e3


class CudaMeter:
    """A CUDA lane's meter. Nothing here waits for the device except `wait`.

    - time: two timing events recorded on the lane device's current stream (where the step's kernels and copies
      go) around the step; their elapsed time is the device's time for the step's work. Where the host is the
      bottleneck (a model too small to keep the GPU busy) that is not what the mode costs alone: behind a slower lane
      the host runs ahead, this lane's kernels wait queued and run back to back, and the events see the device's
      compute only (H100, tiny_transformer large: bf16-mixed 5.2 ms by events in a race, 11.2 ms alone). Taking the
      host's issue time as well does not mend it: in a race the host also waits on a full launch queue behind the
      other lanes (at GPT-2-small size that made bf16-mixed read 1.4x where it is 4.8x). At sizes that keep the GPU
      busy the race agrees with lone runs (tiny_transformer xl: within 4% for tf32 and bf16-mixed);
    - figures: device scalars concatenated into one float32 vector and copied with non_blocking=True into pinned
      memory (pageable memory would make the copy synchronous), followed by an event;
    - memory: the allocator's peak during the lane's own step above the allocation at its start (the step holds
      switches.STEP_LOCK, so no other step allocates in between).

    Events and pinned buffers are reused once read, so a long run allocates none of either per step.
    """

    immediate = False

    def __init__(self, device: str):
        self.device = torch.device(device)
        self._stream: torch.cuda.Stream | None = None
        self._timing_events: list[torch.cuda.Event] = []
        self._plain_events: list[torch.cuda.Event] = []
        self._buffers: dict[int, list[torch.Tensor]] = {}

    def _event(self, timing: bool) -> torch.cuda.Event:
        pool = self._timing_events if timing else self._plain_events
        return pool.pop() if pool else torch.cuda.Event(enable_timing=timing)

    def _buffer(self, size: int) -> torch.Tensor:
        pool = self._buffers.get(size)
        return pool.pop() if pool else torch.empty(size, dtype=torch.float32, pin_memory=True)

    def start(self, scale: torch.Tensor | None = None) -> InFlight:
        """Open the timed window; `scale` (a device scalar) is copied to the host first, outside the window."""
        if self._stream is None:  # the lane's thread's stream; asked once (a few microseconds a call)
            self._stream = torch.cuda.current_stream(self.device)
        flight = InFlight(self._event(True))
        if scale is not None:
            flight.scale_before = self._buffer(1)
            flight.scale_before.copy_(scale.reshape(1), non_blocking=True)
        flight.start.record(self._stream)
        return flight

    def stop(self, flight: InFlight) -> None:
        """Close the timed window."""
        flight.end = self._event(True)
        flight.end.record(self._stream)

    def send(self, flight: InFlight, values: list[torch.Tensor]) -> None:
        """Queue the copy of `values` (0-d or 1-d tensors) to pinned host memory, then the event that says it landed."""
        if len(values) == 1:  # the loss alone (most steps): no concatenation kernel
            flat = values[0].detach().reshape(-1)
        else:
            flat = torch.cat([v.detach().reshape(-1).float() for v in values])
        flight.values = self._buffer(flat.numel())
        flight.values.copy_(flat, non_blocking=True)  # converted to float32 on the way, if it is not already
        flight.done = self._event(False)
        flight.done.record(self._stream)

    @staticmethod
    def ready(flight: InFlight) -> bool:
        """The step and its copies are done (a query, never a wait)."""
        return flight.done.query()

    @staticmethod
    def wait(flight: InFlight) -> None:
        """Wait for the step's figures: a host sync. For sampled probes and forensics after the window, the end of a
        run, a cost probe; never on an ordinary step."""
        flight.done.synchronize()

    def receive(self, flight: InFlight) -> tuple[float, float | None, list[float]]:
        """(step ms, scale before the step or None, the values sent) of a flight that is `ready`; its events and
        buffers go back to the pools."""
        if not flight.done.query():
            raise RuntimeError("the step's figures are not on the host yet")
        ms = flight.start.elapsed_time(flight.end)
        values = flight.values.tolist()
        scale = None
        if flight.scale_before is not None:
            scale = float(flight.scale_before[0])
            self._buffers.setdefault(1, []).append(flight.scale_before)
        self._timing_events += (flight.start, flight.end)
        self._plain_events.append(flight.done)
        self._buffers.setdefault(len(values), []).append(flight.values)
        return ms, scale, values

    def open_memory_window(self) -> int:
        """Start a lane's memory window: the peak restarts from the allocation now, which is returned."""
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def close_memory_window(self, allocated_at_start: int) -> int:
        """The allocator's peak since the window opened, above the allocation at its start (bytes)."""
        return torch.cuda.max_memory_allocated(self.device) - allocated_at_start


def meter_for(device: str) -> HostMeter | CudaMeter:
    return CudaMeter(device) if torch.device(device).type == "cuda" else HostMeter()
