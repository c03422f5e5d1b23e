"""Records of a torchrun job: every rank measures itself; at each flush the ranks' new records and events are gathered
to rank 0 over the job's own process group (torch.distributed: gloo on a CPU, NCCL on GPUs), and rank 0 writes them
to the store, each track with its `rank`. Non-zero ranks never touch the store (no shared file system needed).

A flush is a collective, so the ranks must agree on when it comes without asking each other every step: each rank
counts its calls to `flush_if_due` (one per step of the same loop on every rank), and at each flush rank 0 says after
how many more calls the next one comes (about `flush_every_s` at the pace it measured). The same exchange carries
what the owner wants every rank to act on together (`propose`: e.g. a lane to stop), and rank 0 checks that the ranks
skipped the same optimizer steps (under DDP they hold the same all-reduced gradients, so they must).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import numpy as np
import torch.distributed as dist

from amp_core.records.schema import Event, GradStats, StepRecord
from amp_core.records.sink import FLUSH_EVERY_S, RecordSink
from amp_core.records.store import RunStore
from amp_core.records.tracks import TrackRecords

SAME_ON_EVERY_RANK = frozenset({"skipped_step", "scale_backoff", "scale_growth", "diverged", "started", "finished",
                                "stopped", "interrupted"})
"""Events every rank of a DDP job records alike (the scaler sees the same all-reduced gradients; the ranks start, stop
a lane and end together): written once, from rank 0, when rank 0 has the same one; the skip check says when ranks
differ."""
SKIP_MISMATCH_EVENT = "rank_skip_mismatch"
MAX_CALLS_PER_FLUSH = 100_000


def root_rank(group=None) -> int:
    """The global rank of the group's rank 0 (collectives name their source and destination by global rank)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def broadcast_from_rank0(value, group=None):
    """`value` as the group's rank 0 holds it, on every rank (a collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=root_rank(group), group=group)
    return box[0]


class RankSink:
    """A RecordSink for one rank of a torchrun job, with the interface the runner and a Monitor write through
    (open, step, extend_steps, event, add_grad_stats, flush_if_due, flush, close; records, events, grad_stats,
    store_error, write_seconds).

    Every rank holds its own records in memory; rank 0's sink also holds every other rank's (tracks of their rank)
    and writes to the store. Creating one is a collective (the ranks learn rank 0's run id), and so is every flush:
    every rank must call `flush_if_due` equally often, and `flush`/`close` together.
    """

    counts_calls = True
    """`flush_if_due` counts its calls (the ranks flush at the same call): every step makes one (RecordSink's)."""

    def __init__(self, run_id: str, store: RunStore | None, *, group=None, flush_every_s: float = FLUSH_EVERY_S,
                 check_skips: bool = True, on_agreed: Callable[[set], None] | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.run_id = broadcast_from_rank0(run_id, group)
        self.local = RecordSink(self.run_id, store if self.rank == 0 else None, flush_every_s)
        self.flush_every_s = flush_every_s
        self.check_skips = check_skips
        """Say when ranks skipped different steps (true for a DDP job; independent models may differ)."""
        self.on_agreed = on_agreed
        """Called on every rank, at the same point of its loop, with the union of what any rank proposed."""
        self._proposals: set[Hashable] = set()
        self._calls = 0
        self._next_flush = 1  # the first call flushes: rank 0 then knows the pace
        self._paced_at = (time.monotonic(), 0)
        self._sent: dict[tuple[int, int], int] = {}
        """Non-zero ranks: (lane, rank) -> the last step sent to rank 0."""
        self._events_sent = 0
        self._own_events: set[tuple[str, int | None, int | None]] = set()
        self._own_scanned = 0
        self._skips_checked: dict[int, int] = {}
        """Rank 0: lane -> the last step whose skips every rank's records were compared at."""

    # --- what the owner writes (its own thread) ----------------------------------------------------------------
    @property
    def records(self):
        return self.local.records

    @property
    def events(self) -> list[Event]:
        return self.local.events

    @property
    def grad_stats(self):
        return self.local.grad_stats

    @property
    def store_error(self) -> str:
        return self.local.store_error

    @property
    def write_seconds(self) -> float:
        return self.local.write_seconds

    def open(self, config: dict, device: str, torch_version: str, lane_meta: list[dict] | None = None,
             lane_modes: list[str] | None = None) -> None:
        """Rank 0 registers the run (StoreError if the store cannot take it); other ranks have nothing to open."""
        if self.rank == 0:
            self.local.open(config, device, torch_version, lane_meta, lane_modes)

    def step(self, record: StepRecord) -> None:
        record.rank = self.rank
        self.local.step(record)

    def track(self, lane: int, mode: str) -> TrackRecords:
        """This rank's in-memory records of lane `lane`, to append rows to."""
        return self.local.records.track(lane, mode, self.rank)

    def extend_steps(self, lane: int, mode: str, columns: dict[str, np.ndarray], rank: int | None = None) -> None:
        self.local.extend_steps(lane, mode, columns, self.rank if rank is None else rank)

    def event(self, kind: str, message: str, lane: int | None = None, step: int | None = None, **data) -> Event:
        return self.local.event(kind, message, lane, step, **data)

    def add_grad_stats(self, lane: int, step: int, stats: list[GradStats]) -> None:
        """Kept on rank 0 only: the store keys gradient statistics by lane and step (under DDP every rank's
        gradients are the same all-reduced ones)."""
        if self.rank == 0:
            self.local.add_grad_stats(lane, step, stats)

    def propose(self, item: Hashable) -> None:
        """Something every rank should act on at the next flush (see `on_agreed`)."""
        self._proposals.add(item)

    # --- flushing: collectives ---------------------------------------------------------------------------------
    def flush_if_due(self) -> None:
        """Count a call; flush when rank 0 said this call would (the same call on every rank)."""
        self._calls += 1
        if self._calls >= self._next_flush:
            self.flush()

    def flush(self, final: bool = False) -> None:
        """Gather every rank's new records and events to rank 0, which writes them; every rank calls it together."""
        self._exchange(lambda: self.local.flush(final))

    def close(self, status: str, lanes: list[tuple[int, str, str]]) -> None:
        """The last flush; rank 0 then writes the run's and its lanes' final status."""
        self._exchange(lambda: self.local.close(status, lanes))

    def flush_own(self) -> None:
        """Rank 0 writes what it holds, without the other ranks (a process exiting without closing: the others may
        be gone, so no collective)."""
        if self.rank == 0:
            self.local.flush()

    def _exchange(self, write: Callable[[], None]) -> None:
        payload = self._payload()
        gathered = [None] * self.world_size if self.rank == 0 else None
        # Object collectives pickle on the host; on NCCL they also copy through the current CUDA device and wait
        # for it: a host sync, once per flush (about every flush_every_s), which gathering cannot avoid.
        dist.gather_object(payload, gathered, dst=root_rank(self.group), group=self.group)
        decision = None
        if self.rank == 0:
            self._merge(gathered)
            write()
            decision = {"every": self._pace(), "agreed": set().union(*(p["proposals"] for p in gathered))}
        decision = broadcast_from_rank0(decision, self.group)
        self._next_flush = self._calls + decision["every"]
        self._proposals.clear()
        if self.on_agreed is not None and decision["agreed"]:
            self.on_agreed(decision["agreed"])

    def _payload(self) -> dict:
        """This rank's part of a flush: its records and events since the last one (none from rank 0, which holds
        its own), and its proposals."""
        payload = {"proposals": set(self._proposals), "tracks": [], "events": []}
        if self.rank == 0:
            return payload
        for track in self.local.records.tracks():
            key = (track.lane, track.rank)
            _, _, last = track.extent()
            sent = self._sent.get(key, -1)
            if last > sent:
                payload["tracks"].append((track.lane, track.mode, track.raw_rows(sent + 1, last + 1)))
                self._sent[key] = last
        events = self.local.events[self._events_sent:]
        self._events_sent += len(events)
        payload["events"] = [(e.kind, e.message, e.lane, e.step, e.t_wall_s, e.data) for e in events]
        return payload

    def _merge(self, gathered: list[dict]) -> None:
        """Rank 0: the other ranks' records into tracks of their rank, their events (once, for events every DDP
        rank makes alike), then the skip check."""
        events = self.local.events
        for event in events[self._own_scanned:]:
            self._own_events.add((event.kind, event.lane, event.step))
        for rank, payload in enumerate(gathered):
            for lane, mode, columns in payload["tracks"]:
                self.local.extend_steps(lane, mode, columns, rank)
            for kind, message, lane, step, t_wall_s, data in payload["events"]:
                if kind in SAME_ON_EVERY_RANK and (kind, lane, step) in self._own_events:
                    continue
                events.append(Event(self.run_id, kind, f"rank {rank}: {message}", lane, step, t_wall_s,
                                    {**data, "rank": rank}))
        self._own_scanned = len(events)
        if self.check_skips:
            self._check_skips()

    def _check_skips(self) -> None:
        """Compare the skipped steps of every rank, lane by lane, over the steps all ranks have recorded since the
        last check; an event names the steps where they differ."""
        by_lane: dict[int, dict[int, object]] = {}
        for track in self.local.records.tracks():
            by_lane.setdefault(track.lane, {})[track.rank] = track
        for lane, tracks in by_lane.items():
            if len(tracks) < self.world_size:
                continue
            start = self._skips_checked.get(lane, -1) + 1
            stop = min(track.extent()[2] for track in tracks.values()) + 1
            if stop <= start:
                continue
            skipped = {}
            for rank, track in tracks.items():
                marks = track.marks(start, stop)
                skipped[rank] = set(np.asarray(marks["step"])[np.asarray(marks["skipped"], dtype=bool)].tolist())
            self._skips_checked[lane] = stop - 1
            everywhere = set.intersection(*skipped.values())
            differ = sorted(set.union(*skipped.values()) - everywhere)
            if differ:
                by_rank = {rank: sorted(steps - everywhere) for rank, steps in skipped.items()}
                shown = ", ".join(map(str, differ[:10])) + (" …" if len(differ) > 10 else "")
                who = "; ".join(f"rank {rank} skipped {', '.join(map(str, steps[:10]))}"
                                for rank, steps in by_rank.items() if steps)
                self.local.event(SKIP_MISMATCH_EVENT, f"the ranks skipped different optimizer steps at step(s) "
                                 f"{shown} ({who}); under DDP every rank holds the same all-reduced gradients, so "
                                 "they should skip together", lane, differ[0], steps=differ, by_rank=by_rank)

    def _pace(self) -> int:
        """Calls until the next flush: about flush_every_s at the pace since the last flush."""
        now = time.monotonic()
        then, calls_then = self._paced_at
        self._paced_at = (now, self._calls)
        calls = self._calls - calls_then
        if calls <= 0 or now <= then:
            return 1
        return int(min(MAX_CALLS_PER_FLUSH, max(1, round(self.flush_every_s / ((now - then) / calls)))))
