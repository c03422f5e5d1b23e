"""AMP Lab's own lane race under torchrun: one process per rank, each lane's model in DDP, every rank stepping its
lanes interleaved (A B C A B C) on its own shard of the batches. Each rank measures itself; records are gathered to
rank 0 over the job's process group (records/ranks.py), and only rank 0 opens the store.

`amp-lab run ... --nproc N` starts the job itself (`torchrun_command`: python -m torch.distributed.run), and a worker
of any torchrun job running `amp-lab run` takes part (`job_rank` reads torchrun's environment).
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from amp_core.config import ConfigError, RunConfig
from amp_core.precision import resolve_device
from amp_core.records.ranks import RankSink
from amp_core.records.sink import new_run_id
from amp_core.records.store import RunStore
from amp_core.runner import Lane, Run, RunHooks

RANK_SEED_STRIDE = 1_000_003
"""Rank r samples its batches with seed + r * this: rank 0 sees exactly the batches of a one-process run."""


@dataclass(frozen=True, slots=True)
class JobRank:
    """This process's place in a torchrun job (from the environment torchrun sets)."""

    rank: int
    world_size: int
    local_rank: int


def job_rank(environ: dict[str, str] | None = None) -> JobRank | None:
    """This process's rank when it is a worker of a torchrun job of more than one process, else None."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1 or "RANK" not in env:
            return None
        return JobRank(int(env["RANK"]), world, int(env.get("LOCAL_RANK", env["RANK"])))
    except ValueError:
        return None


def torchrun_command(argv: list[str], nproc: int) -> list[str]:
    """The command that runs `python -m amp_core <argv>` in `nproc` processes on this machine under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "amp_core", *argv]


def init_job(config: RunConfig, job: JobRank) -> None:
    """Join the job's process group: NCCL with one GPU per rank (cuda:local_rank) for a CUDA run, else gloo."""
    if dist.is_initialized():
        return
    if resolve_device(config.device).startswith("cuda"):
        torch.cuda.set_device(job.local_rank)  # "cuda" then means this rank's GPU, for every tensor and meter
        dist.init_process_group("nccl", device_id=torch.device("cuda", job.local_rank))
    else:
        dist.init_process_group("gloo")


def leave_job() -> None:
    """Leave the process group once the run is over. DDP's reducer sits in reference cycles that keep tensors gloo
    still points at; collected only as the interpreter shuts down, they abort it now and then ("terminate called
    without an active exception", a torch issue), so they are collected first."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


class LaneDDP(DistributedDataParallel):
    """DDP that names parameters as the model itself does (no `module.` prefix): faults, events and gradient
    statistics name a parameter the same with and without --nproc."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)


class DistributedRun(Run):
    """A Run on one rank of a torchrun job (the process group already initialised: `init_job`), built from a Run by
    its hooks (RunHooks) and a RankSink.

    Every rank runs the same lanes in the same order, so their collectives line up: DDP's gradient all-reduce in
    every lane step, and the record flush (RankSink), at the same lane step on every rank. What would make one rank
    leave a lane before the others is decided together: a lane that diverges on any rank is stopped on every rank
    at the next flush; a lane that fails (an exception, e.g. out of memory) ends the job (torchrun then stops every
    rank; the run shows as interrupted, with what rank 0 had written).
    """

    def __init__(self, config: RunConfig, store: RunStore | None = None, run_id: str | None = None):
        if config.amax_every:
            raise ConfigError("amax_every", "layer amax sampling is not offered with --nproc (it samples a shadow "
                                            "copy of one process's model)")
        if config.seeds > 1:
            raise ConfigError("seeds", "seed replicates are not offered with --nproc (each rank already trains on "
                                       "batches of its own)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        sink = RankSink(run_id or new_run_id(), store if self.rank == 0 else None, check_skips=True,
                        on_agreed=self._stop_agreed)
        hooks = RunHooks(lane_setup=[_wrap_in_ddp], setup_done=[self._rank_batches],
                         after_lane_step=[self._end_job_if_failed], on_divergence=self._propose_stop)
        super().__init__(config, sink=sink, hooks=hooks)
        self._proposed: set[int] = set()

    def _rank_batches(self, run: Run) -> None:
        """This rank's own batches; rank 0 says what the job is."""
        self.generators = [torch.Generator().manual_seed(self.config.seed + self.rank * RANK_SEED_STRIDE)]
        if self.rank == 0:
            self.sink.event("job", f"torchrun job of {self.world_size} ranks: each lane's model in DDP "
                            f"({dist.get_backend()}), each rank its own batches", ranks=self.world_size)

    def _end_job_if_failed(self, run: Run, lane: Lane, step: int) -> None:
        if lane.status == "failed":  # the other ranks wait in this lane's all-reduce: only ending the job frees them
            print(f"amp-lab rank {self.rank}: lane {lane.mode} failed at step {step}: {lane.error}; ending the job",
                  file=sys.stderr, flush=True)
            self.sink.flush_own()
            os._exit(1)

    def _propose_stop(self, run: Run, lane: Lane, why: str, step: int) -> None:
        """Propose the stop: every rank stops the lane at the next flush (see `_stop_agreed`)."""
        if lane.index not in self._proposed:
            self._proposed.add(lane.index)
            self.sink.propose(("diverged", lane.index, f"{why} on rank {self.rank}", step))

    def _stop_agreed(self, agreed: set) -> None:
        first: dict[int, tuple[int, str]] = {}
        for kind, index, why, step in sorted(agreed, key=lambda item: item[3]):
            if kind == "diverged":
                first.setdefault(index, (step, why))
        for index, (step, why) in first.items():
            lane = self.lanes[index]
            if lane.status == "running":
                self.stop_lane(lane, why, step)


def _wrap_in_ddp(run: Run, lane: Lane) -> None:
    """The lane's model in DDP (the same order on every rank: DDP's construction is a collective)."""
    device_ids = [torch.cuda.current_device()] if run.device.startswith("cuda") else None
    lane.state.bind_model(LaneDDP(lane.state.model, device_ids=device_ids))
