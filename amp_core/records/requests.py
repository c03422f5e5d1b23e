"""Requests from a dashboard page to a live attached process (a Monitor, a trainer callback), through the store: the
page writes a request row, the process reads it at its next flush, performs it at its next step and writes the answer
in the same row; the page shows it when it arrives. No server, no port: whatever store both already share.

Kinds: "trace" (every op of the process's next step, probes.optrace's records) and "layers" (every module's ranges at
the next step, probes.layerwatch's figures). A request on a run that has ended is refused at once; one whose process
goes away before answering says so when the page looks.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from dataclasses import dataclass
from typing import Any

from amp_core.records.store import LIVE_STATUSES, RunStore, StoreError

TRACE = "trace"
LAYERS = "layers"
KINDS = {TRACE: "trace the next step", LAYERS: "layer numerics at the next step"}
"""What each kind asks, in words."""


class RequestRefused(ValueError):
    """A request that cannot be made (the run has ended, is unknown, or is not an attached run); says why."""


@dataclass(frozen=True, slots=True)
class RequestState:
    """Where a request stands, as a page shows it."""

    request_id: int
    kind: str
    status: str
    """open (not read yet), taken (the process performs it), answered, refused, or gone (the process ended first)."""
    message: str
    answer: dict[str, Any] | None
    """The answer's data (answered only)."""


def pack(answer: dict[str, Any]) -> bytes:
    return zlib.compress(json.dumps(answer, default=str).encode(), 6)


def unpack(data: bytes | None) -> dict[str, Any] | None:
    return None if data is None else json.loads(zlib.decompress(data))


def ask(store: RunStore, run_id: str, kind: str) -> int:
    """A request for run `run_id`'s process; its id. RequestRefused when the run has ended, is unknown or is not
    written by an attached process (a run of this dashboard is probed directly, not through the store)."""
    if kind not in KINDS:
        raise RequestRefused(f"unknown request {kind!r}; choose from {', '.join(KINDS)}")
    store.mark_interrupted()
    run = store.run(run_id)
    if run is None:
        raise RequestRefused(f"no run {run_id!r} in the store")
    if run["config"].get("source") != "monitor":
        raise RequestRefused("only an attached run (a Monitor or a trainer callback) answers requests")
    if run["status"] not in LIVE_STATUSES:
        raise RequestRefused(f"the run has ended ({run['status']}): no process is left to {KINDS[kind]}")
    return store.add_request(run_id, kind)


def state(store: RunStore, request_id: int) -> RequestState | None:
    """The request as it stands (None if unknown). An open or taken request whose run is no longer live was never
    answered: its status is then 'gone', and the store says so from then on."""
    row = store.request(request_id)
    if row is None:
        return None
    status, message = row["status"], row["message"]
    if status in ("open", "taken"):
        store.mark_interrupted()  # is the process still there? (a psutil look per live run, while a page waits)
        run = store.run(row["run_id"])
        if run is None or run["status"] not in LIVE_STATUSES:
            ended = run["status"] if run is not None else "gone from the store"
            status, message = "gone", f"the process ended ({ended}) before it answered"
            store.answer_request(request_id, status, message)
    return RequestState(request_id, row["kind"], status, message, unpack(row["answer"]))


class Desk:
    """A process's side of its run's requests (rank 0's Monitor; None store: none come)."""

    def __init__(self, store: RunStore | None, run_id: str):
        self.store, self.run_id = store, run_id

    def take(self) -> list[tuple[int, str]]:
        """The run's new requests as (id, kind), now taken; [] when the store cannot be read (the run goes on)."""
        if self.store is None:
            return []
        try:
            return self.store.take_requests(self.run_id)
        except StoreError:
            return []

    def answer(self, request_id: int, message: str, answer: dict[str, Any] | None = None,
               status: str = "answered") -> None:
        if self.store is None:
            return
        with contextlib.suppress(StoreError):  # unanswered: the page says so once the run ends
            self.store.answer_request(request_id, status, message, pack(answer) if answer is not None else None)
