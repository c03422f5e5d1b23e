"""Meters: how a step is timed, how its figures reach the host and how its memory peak is read, per device.

One interface (Meter), two implementations that each implement all of it, so no caller asks which device it is on:
- HostMeter (a CPU): perf_counter around the step; figures are read when sent (a CPU tensor has nothing to wait for),
  so every window is `ready` at once; a CPU has no allocator statistics, so there is no memory window.
- CudaMeter: events on the device's current stream around the step, figures copied to pinned host memory behind it
  (no host sync), read once an event says they landed; the allocator's peak above the allocation at the start of the
  step's own memory window.

A window's life: `open` (before the step) -> `close` (after its training work) -> `send` (its figures, as device
scalars or host floats) -> `ready` (a query, never a wait) -> `receive` (step ms, the scale as the step began, the
values sent). `wait` + `peek` read a window early (a host sync: sampled probes only).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Window:
    """One step's measurement on its way to the host."""

    start: float | torch.cuda.Event
    end: float | torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    """CUDA: recorded after the copies of the values; the window is readable once it has completed."""
    values: list | torch.Tensor | None = None
    """The values `send` queued (CUDA: a pinned float32 buffer)."""
    scale_before: float | torch.Tensor | None = None
    """The GradScaler scale as the step began (CUDA: a pinned one-element buffer, copied before the window: update()
    changes the scale in place)."""
    excluded_s: float = 0.0
    """Host seconds inside the window that were a probe's, not the step's (a Monitor's layer hooks): a host-timed step
    leaves them out of its step_ms (the caller adds them to probe_ms)."""


class Meter(ABC):
    """How a step is timed and weighed on one device (see the module's docstring)."""

    device: torch.device
    at_once: bool = False
    """A step's figures are on the host as they are sent (`on_host` never answers None)."""

    @abstractmethod
    def open(self, scale: torch.Tensor | float | None = None) -> Window:
        """Open a step's timed window; `scale` (the scaler's scale as the step begins: a device tensor, or a float
        known on the host) is taken first, outside the window."""

    @abstractmethod
    def close(self, window: Window) -> None:
        """Close the timed window."""

    @abstractmethod
    def send(self, window: Window, values: list[torch.Tensor | float]) -> None:
        """Queue the step's figures (0-d or 1-d tensors, or floats) for the host, behind the step."""

    @abstractmethod
    def ready(self, window: Window) -> bool:
        """The step and its figures are on the host (a query, never a wait)."""

    @abstractmethod
    def wait(self, window: Window) -> None:
        """Wait until the window is `ready`: a host sync on CUDA, for sampled probes and the end of a run only."""

    @abstractmethod
    def peek(self, window: Window) -> tuple[float | None, list[float]]:
        """(scale as the step began, values sent) of a `ready` window, which stays readable by `receive`."""

    @abstractmethod
    def on_host(self, window: Window) -> tuple[float | None, list[float]] | None:
        """`peek` where the figures are on the host as soon as they are sent (asking nothing of the device), else
        None (they are read when `ready`)."""

    @abstractmethod
    def receive(self, window: Window) -> tuple[float, float | None, list[float]]:
        """(step ms, scale as the step began or None, values sent) of a `ready` window; it is used up."""

    @abstractmethod
    def open_memory_window(self) -> int | None:
        """Start a step's memory window (the allocator's peak restarts); returns what closing it needs (None: the
        device has no allocator statistics)."""

    @abstractmethod
    def close_memory_window(self, opened: int | None) -> int | None:
        """The allocator's peak since `open_memory_window` above the allocation then, in bytes (None: none)."""

    @abstractmethod
    def lane_peak_bytes(self, held_bytes: int, peak_bytes: int | None) -> int | None:
        """A lane's own peak: on a device with allocator statistics the measured `peak_bytes` (held at the step's
        start + its peak above it), else the bytes it holds (`held_bytes`: tensor storage sizes)."""


class HostMeter(Meter):
    """A CPU step's meter: perf_counter around the step; its figures are read as they are sent (nothing to wait for).
    """

    device = torch.device("cpu")
    at_once = True
    clock = staticmethod(time.perf_counter)
    """What a window's start and end are read from (StepDriver.host_plain reads it inline)."""

    def open(self, scale: torch.Tensor | float | None = None) -> Window:
        return Window(self.clock(), scale_before=None if scale is None else float(scale))

    def close(self, window: Window) -> None:
        window.end = self.clock()

    def send(self, window: Window, values: list[torch.Tensor | float]) -> None:
        if len(values) == 1:  # the loss alone (most steps)
            value = values[0]
            window.values = [value.item() if isinstance(value, torch.Tensor) else float(value)]
        else:
            flat = []
            for value in values:
                if not isinstance(value, torch.Tensor):
                    flat.append(float(value))
                elif value.dim() == 0:
                    flat.append(value.item())
                else:
                    flat += value.tolist()
            window.values = flat

    def ready(self, window: Window) -> bool:
        return True

    def wait(self, window: Window) -> None:
        pass

    def peek(self, window: Window) -> tuple[float | None, list[float]]:
        return window.scale_before, window.values

    def on_host(self, window: Window) -> tuple[float | None, list[float]]:
        return window.scale_before, window.values

    def receive(self, window: Window) -> tuple[float, float | None, list[float]]:
        return (window.end - window.start - window.excluded_s) * 1e3, window.scale_before, window.values

    def open_memory_window(self) -> None:
        return None

    def close_memory_window(self, opened: int | None) -> None:
        return None

    def lane_peak_bytes(self, held_bytes: int, peak_bytes: int | None) -> int:
        return held_bytes


class CudaMeter(Meter):
    """A CUDA step's meter. Nothing here waits for the device except `wait`.

    - time: two timing events recorded on the device's current stream (where the step's kernels and copies go) around
      the step; their elapsed time is the device's time for the step's work. Where the host is the bottleneck (a model
      too small to keep the GPU busy) that is not what the mode costs alone: behind a slower lane the host runs ahead,
      this lane's kernels wait queued and run back to back, and the events see the device's compute only (H100,
      tiny_transformer large: bf16-mixed 5.2 ms by events in a race, 11.2 ms alone). Taking the host's issue time as
      well does not mend it: in a race the host also waits on a full launch queue behind the other lanes (at GPT-2-
      small size that made bf16-mixed read 1.4x where it is 4.8x). At sizes that keep the GPU busy the race agrees
      with lone runs (tiny_transformer xl: within 4% for tf32 and bf16-mixed);
    - figures: device scalars concatenated into one float32 vector and copied with non_blocking=True into pinned
      memory (pageable memory would make the copy synchronous), followed by an event; a float (a Monitor's loss given
      as a number) is filled in on the device, since a copy from pageable host memory would wait for the step;
    - memory: the allocator's peak during the step's own window above the allocation at its start (a lane step holds
      switches.STEP_LOCK, so no other step allocates in between).

    Events and pinned buffers are reused once read, so a long run allocates none of either per step.
    """

    def __init__(self, device: str | torch.device):
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

    def open(self, scale: torch.Tensor | float | None = None) -> Window:
        if self._stream is None:  # the step's thread's stream; asked once (a few microseconds a call)
            self._stream = torch.cuda.current_stream(self.device)
        window = Window(self._event(True))
        if isinstance(scale, torch.Tensor):
            window.scale_before = self._buffer(1)
            window.scale_before.copy_(scale.reshape(1), non_blocking=True)
        elif scale is not None:
            window.scale_before = float(scale)
        window.start.record(self._stream)
        return window

    def close(self, window: Window) -> None:
        window.end = self._event(True)
        window.end.record(self._stream)

    def send(self, window: Window, values: list[torch.Tensor | float]) -> None:
        tensors = [v if isinstance(v, torch.Tensor) else torch.full((), float(v), device=self.device) for v in values]
        if len(tensors) == 1:  # the loss alone (most steps): no concatenation kernel
            flat = tensors[0].detach().reshape(-1)
        else:
            try:
                flat = torch.cat([v.detach().reshape(-1).float() for v in tensors])
            except RuntimeError:  # a value on another device (a user's loss on the CPU): brought here, then joined
                flat = torch.cat([v.detach().reshape(-1).float().to(self.device) for v in tensors])
        window.values = self._buffer(flat.numel())
        window.values.copy_(flat, non_blocking=True)  # converted to float32 on the way, if it is not already
        window.done = self._event(False)
        window.done.record(self._stream)

    def ready(self, window: Window) -> bool:
        return window.done.query()

    def wait(self, window: Window) -> None:
        window.done.synchronize()

    def peek(self, window: Window) -> tuple[float | None, list[float]]:
        if not window.done.query():
            raise RuntimeError("the step's figures are not on the host yet")
        scale = window.scale_before
        return (float(scale[0]) if isinstance(scale, torch.Tensor) else scale), window.values.tolist()

    def on_host(self, window: Window) -> None:
        return None

    def receive(self, window: Window) -> tuple[float, float | None, list[float]]:
        scale, values = self.peek(window)
        ms = window.start.elapsed_time(window.end)
        if isinstance(window.scale_before, torch.Tensor):
            self._buffers.setdefault(1, []).append(window.scale_before)
        self._timing_events += (window.start, window.end)
        self._plain_events.append(window.done)
        self._buffers.setdefault(len(values), []).append(window.values)
        return ms, scale, values

    def open_memory_window(self) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def close_memory_window(self, opened: int | None) -> int | None:
        if opened is None:
            return None
        return torch.cuda.max_memory_allocated(self.device) - opened

    def lane_peak_bytes(self, held_bytes: int, peak_bytes: int | None) -> int | None:
        return peak_bytes


def meter_for(device: str | torch.device) -> Meter:
    """The meter of a step on `device`."""
    return CudaMeter(device) if torch.device(device).type == "cuda" else HostMeter()
