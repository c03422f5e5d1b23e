"""What an emulated block-scaled GEMM is doing now, for the op inspector: the emulation (formats.linear) names each
stage it runs (quantise + dequantise an operand in a format and layout, a GEMM of quantised operands) and the op
tracer reads the name as it records each aten op, so a block-scaled lane's trace says which ops quantised which
operand, in which format and blocks, and which multiplied them.

Naming costs nothing unless a tracer listens (`listen`): a global count checked once per stage; the names themselves
are per thread, so a lane training on another thread while a trace runs never takes the trace's names."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

_listeners = 0
_lock = threading.Lock()
_local = threading.local()
T = TypeVar("T")


def listeners(change: int) -> None:
    """One more (+1) or one fewer (-1) listener: while there is any (an op trace), the emulation names its stages."""
    global _listeners
    with _lock:
        _listeners += change


@contextlib.contextmanager
def listen() -> Iterator[None]:
    listeners(1)
    try:
        yield
    finally:
        listeners(-1)


def current() -> str:
    """The stage this thread's emulation is in ("" outside any)."""
    return getattr(_local, "stage", "")


def run(name: Callable[[], str], work: Callable[[], T]) -> T:
    """`work()`, named `name()` while a tracer listens (the name is built only then)."""
    if not _listeners:
        return work()
    outer = current()
    _local.stage = name()
    try:
        return work()
    finally:
        _local.stage = outer
