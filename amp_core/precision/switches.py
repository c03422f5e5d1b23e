"""Process-global torch switches a lane step depends on (TF32 flags, oneDNN for a CPU's float8 matmuls, intra-op
threads), set so that no run leaks a setting into another run or into the user's own threads, and the user's own
setting survives; and the choice of a run's intra-op threads (choose_threads)."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

TEAM_MARGIN = 0.5
"""choose_threads keeps a team of intra-op threads only when one thread is this much slower (relative) on a step: a
team gains at most that when the cores are free and loses several times over when one is taken (bench/viewers.py:
a CLI run that chose 2 threads kept 0.36-0.67 of its speed with two browser sessions watching, 0.82-0.86 with 1)."""
MEASURE_ROUNDS = 3
"""choose_threads times one thread and the team alternately this many times and keeps the best of each."""
COMPARISONS = 2
"""How many such comparisons, each from fresh bests, a team must win to be kept (team_is_faster)."""

STEP_LOCK = threading.RLock()
"""One lock for the whole process. A CUDA lane step holds it from its first launch to its last: the TF32 flags it
sets are read by every matmul and convolution any thread launches meanwhile, and the allocator peak it reads is the
device's, so no other step may run inside that window. Changing the intra-op thread default also takes it."""

_FP32_PRECISION_KNOBS: tuple = ()
if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
    # torch >= 2.9: once anything sets fp32_precision, reading the legacy allow_tf32 flags raises; so only the new
    # knobs are read and written, and each is put back to the exact string it held (that also restores the legacy
    # view for code that reads allow_tf32 later).
    _FP32_PRECISION_KNOBS = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)


def _read_tf32() -> tuple:
    if _FP32_PRECISION_KNOBS:
        return tuple(knob.fp32_precision for knob in _FP32_PRECISION_KNOBS)
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _write_tf32(values: tuple) -> None:
    if _FP32_PRECISION_KNOBS:
        for knob, value in zip(_FP32_PRECISION_KNOBS, values, strict=True):
            knob.fp32_precision = value
    else:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = values


def _wanted_tf32(enabled: bool) -> tuple:
    if _FP32_PRECISION_KNOBS:
        return ("tf32" if enabled else "ieee",) * len(_FP32_PRECISION_KNOBS)
    return enabled, enabled


def tf32_enabled() -> bool:
    """Whether fp32 matmuls run on TF32 tensor cores right now (what a forward launched now would get)."""
    if _FP32_PRECISION_KNOBS:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


@contextlib.contextmanager
def lane_step_switches(tf32: bool) -> Iterator[None]:
    """STEP_LOCK held, TF32 on or off for matmuls, convolutions and RNNs while the block runs; afterwards the flags go
    back to exactly what they were (the user's own setting), before the lock is let go."""
    with STEP_LOCK:
        saved = _read_tf32()
        _write_tf32(_wanted_tf32(tf32))
        try:
            yield
        finally:
            _write_tf32(saved)


_ONEDNN_OFF_LOCK = threading.Lock()
_onednn_off_depth = 0
_onednn_saved = True


@contextlib.contextmanager
def onednn_off() -> Iterator[None]:
    """oneDNN off (torch.backends.mkldnn.enabled) while the block runs, then back to what it was: the switch is
    process-wide, so blocks on several threads count themselves in and the last one out puts it back;
    float8_matmuls_need_onednn_off says why an FP8 step takes it. Everything in the block runs without oneDNN, and
    so does a run on another thread meanwhile: fp32 matmuls go to MKL (as fast), but a bf16 matmul goes to ATen's
    own kernel, hundreds of times slower on an AMX Xeon (1024x1024: 2.6 s against 3-5 ms). An FP8 lane's float8
    matmuls gain far more than its unconverted bf16 ones lose on a small model (tiny_transformer: 98 ms a step against
    14 s); a TorchDispatchMode that switches around each `_scaled_mm` alone measured 145 ms there and leaves the rest
    of the step (and other threads, but for the products themselves) with oneDNN, the narrower way to go."""
    global _onednn_off_depth, _onednn_saved
    with _ONEDNN_OFF_LOCK:
        if _onednn_off_depth == 0:
            _onednn_saved = torch.backends.mkldnn.enabled
            torch.backends.mkldnn.enabled = False
        _onednn_off_depth += 1
    try:
        yield
    finally:
        with _ONEDNN_OFF_LOCK:
            _onednn_off_depth -= 1
            if _onednn_off_depth == 0:
                torch.backends.mkldnn.enabled = _onednn_saved


@functools.cache
def float8_matmuls_need_onednn_off() -> bool:
    """Whether a CPU's float8 matmuls (aten._scaled_mm) must run with oneDNN off to take ATen's own emulation: where
    ATen would send them to oneDNN, which is where the CPU has AMX-int8 (`_scaled_mm_out_cpu`, torch 2.13).

    The oneDNN inside torch 2.13 has only its reference kernel for float8 on such a CPU (an AMX Xeon: `ONEDNN_VERBOSE=1`
    prints `matmul,ref:any`; a 64x64 product 8 ms against 0.03 ms emulated, 256x256 400-500 ms against 0.7-0.9 ms),
    which made an FP8 lane of tiny_transformer take 14 s a step against bf16-mixed's 53 ms. The emulation computes the
    same products (dequantised, an fp32 matmul, scaled: equal bit for bit in tests/test_recipes.py), and FP8 on a CPU
    buys no speed either way. Read from torch's own CPU capabilities, not timed: a timing taken while other processes
    share the cores stalled the emulation's OpenMP regions for milliseconds too, and read the reference kernel as no
    slower."""
    return bool(torch.backends.mkldnn.is_available() and torch.cpu.get_capabilities().get("amx_int8"))


def _on_a_fresh_thread(function: Callable, *args):
    out = []
    thread = threading.Thread(target=lambda: out.append(function(*args)), name="amp-threads-default", daemon=True)
    thread.start()
    thread.join()
    return out[0]


def process_intra_op_threads() -> int:
    """The intra-op threads a newly started thread gets: the process's setting (the user's own, if they set one).

    Asked on a fresh thread, because a thread that already ran torch keeps its own OpenMP setting.
    """
    return _on_a_fresh_thread(torch.get_num_threads)


def pin_intra_op_threads(threads: int) -> int:
    """Give the calling thread, and no other, `threads` intra-op threads; returns the process's setting.

    torch.set_num_threads sets two things: the calling thread's own OpenMP/MKL thread count (per thread), and the
    count every thread started later begins with (process-wide). The second is put back at once, from a fresh
    thread, under STEP_LOCK, so a thread started while a run goes (a Streamlit script run, the user's own) starts
    with the process's setting. Between the two calls (microseconds, once per run) a thread starting its first
    parallel op could still see `threads`; no lock can cover threads that never take it.
    """
    with STEP_LOCK:
        default = process_intra_op_threads()
        # Reading first makes torch create the caller's own setting (it does so lazily, from the process's) now,
        # not at its next parallel op, when it would take the process's setting over ours.
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            _on_a_fresh_thread(torch.set_num_threads, default)
    return default


def choose_threads(state: Any, batch: tuple[torch.Tensor, torch.Tensor], requested: int = 0) -> str:
    """Set the calling thread's own intra-op threads (no other thread's): `requested`, else measured on `state` (a
    lane's step.LaneState: its precision, model and workload) with `batch`: the process's setting when this model's
    step is long or one thread is clearly slower (TEAM_MARGIN), else 1. Says what it chose.

    On a machine with few cores, an OpenMP team started from a second thread (a run's, a probe's) wakes its
    workers through the kernel for every parallel op (libgomp throttles spinning once it manages more threads
    than there are cores), about 25 us each: for a small model that is most of a step. Big ops amortise it, so
    only quick steps are measured, on a copy of the lane's model, with a batch the caller does not train on.
    A team wins little on a quick step and loses much when a core is taken: while a browser, a dashboard or another
    run uses one of two cores, every parallel op waits for the team's descheduled thread (a CLI run followed by two
    browser sessions ran 10-100x slower with 2 threads, chosen for 0.24 ms against 0.25 ms with 1).
    """
    if requested:
        pin_intra_op_threads(requested)
        return f"{requested} intra-op thread(s), as configured"
    default = pin_intra_op_threads(process_intra_op_threads())
    if default <= 1 or state.precision.device_type != "cpu":
        return f"{default} intra-op thread(s)"
    model = copy.deepcopy(state.model)
    inputs, targets = (state.precision.prepare_input(t) for t in batch)

    def forward_backward_s() -> float:
        best = math.inf
        for _ in range(4):
            start = time.perf_counter()
            with state.precision.cpu_context():
                with state.precision.forward_context():
                    loss = state.workload.loss(model(inputs), targets)
                loss.backward()
            best = min(best, time.perf_counter() - start)
        return best

    def time_step(threads: int) -> float:
        pin_intra_op_threads(threads)
        return forward_backward_s()

    # One thread first: its time does not depend on what else the machine runs (a team's does).
    if time_step(1) > 0.05:
        pin_intra_op_threads(default)
        return f"{default} intra-op threads"
    faster, multi, single = team_is_faster(time_step, default)
    if faster:
        pin_intra_op_threads(default)
        return f"{default} intra-op threads (measured {multi * 1e3:.2f} ms vs {single * 1e3:.2f} ms with 1)"
    pin_intra_op_threads(1)
    return f"1 intra-op thread (measured {single * 1e3:.2f} ms vs {multi * 1e3:.2f} ms with {default})"


def team_is_faster(time_step: Callable[[int], float], team: int) -> tuple[bool, float, float]:
    """Whether a team of `team` intra-op threads is clearly faster than one thread on a step that `time_step(threads)`
    times (seconds): the team and one thread timed in turn MEASURE_ROUNDS times, best of each, one thread TEAM_MARGIN
    slower than the team; and that again from fresh bests, COMPARISONS times in all. A moment of load must not decide
    it (a page drawing as the run starts): one comparison alone once chose 2 threads for a 0.6 ms step on this 2-core
    VM, where 30 quiet starts chose 1 (bench.overhead then read 1.32). Returns (whether, the team's best, one thread's
    best) of the last comparison made."""
    multi = single = math.inf
    for _ in range(COMPARISONS):
        multi = single = math.inf
        for _ in range(MEASURE_ROUNDS):
            multi = min(multi, time_step(team))
            single = min(single, time_step(1))
        if single <= multi * (1 + TEAM_MARGIN):
            return False, multi, single
    return True, multi, single
