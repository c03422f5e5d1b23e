"""Process-global torch switches a lane step depends on (TF32 flags, intra-op threads), set so that no run leaks a
setting into another run or into the user's own threads, and the user's own setting survives."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

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
