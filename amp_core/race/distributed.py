"""AMP Lab's own lane race under torchrun: one process per rank, each lane's model in DDP (or, with `--fsdp`, sharded
with FSDP2's `fully_shard` under the MixedPrecisionPolicy its recipe maps to), every rank stepping its lanes
interleaved (A B C A B C) on its own shard of the batches. Each rank measures itself; records are gathered to rank 0
over the job's process group (records/ranks.py), and only rank 0 opens the store.

`amp-lab run ... --nproc N` starts the job itself (`torchrun_command`: python -m torch.distributed.run), and a worker
of any torchrun job running `amp-lab run` takes part (`job_rank` reads torchrun's environment).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
from dataclasses import dataclass, replace
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from amp_core.config import ConfigError, RunConfig
from amp_core.precision import Precision, get_precision, resolve_device
from amp_core.precision.switches import process_intra_op_threads
from amp_core.probes.optrace import dtype_name
from amp_core.race.runner import Lane, Run, RunHooks
from amp_core.race.step import build_lane_state
from amp_core.records.ranks import RankSink
from amp_core.records.sink import new_run_id
from amp_core.records.store import RunStore

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


def finish_job(code: int) -> NoReturn:
    """End a torchrun worker whose run is over and said: its output flushed, then `os._exit(code)`, without the
    interpreter's teardown. There the objects DDP and gloo leave behind are destroyed in no set order, and now and
    then one still takes the process down after `leave_job` ("terminate called without an active exception",
    SIGABRT: seen once in this project's suite, rank 1 of a DDP race that had finished its steps), and torchrun then
    calls the whole job failed. Nothing is left to do by then: the run's records are written (the store commits each
    write) and its status set."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class LaneDDP(DistributedDataParallel):
    """DDP that names parameters as the model itself does (no `module.` prefix): faults, events and gradient
    statistics name a parameter the same with and without --nproc."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)


def check_job(config: RunConfig) -> None:
    """What a torchrun race does not offer, refused (ConfigError) before the job starts: said once, by the command,
    not by every rank."""
    if config.amax_every:
        raise ConfigError("amax_every", "layer amax sampling is not offered with --nproc (it samples a shadow copy "
                                        "of one process's model)")
    if config.seeds > 1:
        raise ConfigError("seeds", "seed replicates are not offered with --nproc (each rank already trains on "
                                   "batches of its own)")


class DistributedRun(Run):
    """A Run on one rank of a torchrun job (the process group already initialised: `init_job`), built from a Run by
    its hooks (RunHooks) and a RankSink.

    Every rank runs the same lanes in the same order, so their collectives line up: DDP's gradient all-reduce in
    every lane step, and the record flush (RankSink), at the same lane step on every rank. What would make one rank
    leave a lane before the others is decided together: a lane that diverges on any rank is stopped on every rank
    at the next flush; a lane that fails (an exception, e.g. out of memory) ends the job (torchrun then stops every
    rank; the run shows as interrupted, with what rank 0 had written).
    """

    offers_fsdp = True

    def __init__(self, config: RunConfig, store: RunStore | None = None, run_id: str | None = None):
        check_job(config)
        if config.fsdp and not config.intra_op_threads:
            # The thread count is measured on a copy of a lane's model; a sharded copy would all-gather on one rank
            # alone. torchrun gives each worker one thread unless OMP_NUM_THREADS says otherwise: that is kept.
            config = replace(config, intra_op_threads=process_intra_op_threads())
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        sink = RankSink(run_id or new_run_id(), store if self.rank == 0 else None, check_skips=True,
                        on_agreed=self._stop_agreed)
        hooks = RunHooks(setup_done=[self._rank_batches], after_lane_step=[self._end_job_if_failed],
                         on_divergence=self._propose_stop)
        if config.fsdp:
            hooks.build_lane = functools.partial(build_lane_state, shard=shard_with_fsdp2)
            hooks.lane_meta.append(_fsdp_lane_meta)
            hooks.describe.append(_describe_fsdp)
            hooks.lane_setup.append(self._watch_first_forward)
            hooks.after_lane_step.append(self._say_what_ran)
        else:
            hooks.lane_setup.append(_wrap_in_ddp)
        super().__init__(config, sink=sink, hooks=hooks)
        self._proposed: set[int] = set()
        self._first_forwards: dict[int, FirstForward] = {}

    def _watch_first_forward(self, run: Run, lane: Lane) -> None:
        self._first_forwards[lane.index] = FirstForward(lane.state.model)

    def _say_what_ran(self, run: Run, lane: Lane, step: int) -> None:
        """After a sharded lane's first step, rank 0 says what its layers computed with (measured, not assumed)."""
        watch = self._first_forwards.pop(lane.index, None)
        if watch is None:
            return
        watch.remove()
        if self.rank == 0 and lane.state is not None:
            self.sink.event(WHAT_RAN_EVENT, watch.message(lane.state.precision), lane.index, step,
                            layers=watch.seen, shards=lane.state.precision.fsdp_dtypes()["shards"],
                            autocast=dtype_name(lane.state.precision.autocast_dtype)
                            if lane.state.precision.autocast_dtype else None)

    def _rank_batches(self, run: Run) -> None:
        """This rank's own batches; rank 0 says what the job is."""
        self.generators = [torch.Generator().manual_seed(self.config.seed + self.rank * RANK_SEED_STRIDE)]
        if self.rank == 0:
            how = "sharded with FSDP2" if self.config.fsdp else "in DDP"
            self.sink.event("job", f"torchrun job of {self.world_size} ranks: each lane's model {how} "
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


def fsdp_blocks(model: torch.nn.Module) -> list[str]:
    """The modules FSDP2 shards before the root, as torchtitan wraps a transformer (each block, then the root): each
    child of the model that holds parameters, or, for a container child (Sequential, ModuleList, ModuleDict), each
    of its children that does. Each becomes one all-gather in the forward and one reduce-scatter in the backward."""
    containers = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    blocks = []
    for name, child in model.named_children():
        if isinstance(child, containers):
            blocks += [f"{name}.{inner}" for inner, grandchild in child.named_children()
                       if any(True for _ in grandchild.parameters())]
        elif any(True for _ in child.parameters()):
            blocks.append(name)
    return blocks


def shard_with_fsdp2(model: torch.nn.Module, precision: Precision) -> None:
    """Shard a lane's prepared model in place: each of `fsdp_blocks`, then the root, with the recipe's
    MixedPrecisionPolicy (precision.fsdp_policy). Every parameter becomes this rank's dim-0 shard (a DTensor).

    Lanes are built one after another on every rank, so their collectives line up. Each lane's model is a root of
    its own: its blocks reshard after their forward (the root keeps its few parameters until the backward, FSDP2's
    default), and after the backward every parameter is sharded again, so no lane holds gathered weights while
    another steps, and FSDP2 prefetches only within a lane's own model."""
    from torch.distributed.fsdp import fully_shard

    policy = precision.fsdp_policy()
    for name in fsdp_blocks(model):
        fully_shard(model.get_submodule(name), mp_policy=policy)
    fully_shard(model, mp_policy=policy)


WHAT_RAN_EVENT = "fsdp_what_ran"
"""Event kind: what a sharded lane's weighted layers really computed with in its first forward (rank 0's)."""


class FirstForward:
    """What a model's weighted layers (a weight of 2 or more dims) really computed with in their first forward under
    grad: the dtype of the weight the layer saw (under FSDP2 the parameter it gathered), of its input and of its
    output. Forward hooks that read metadata only (no sync), each removed once its layer has been seen: the first
    forward of a lane is the saved-tensor probe's, outside the timed step, so the timed steps run without them."""

    def __init__(self, model: torch.nn.Module):
        self.seen: dict[str, dict[str, str]] = {}
        self._handles = {name: module.register_forward_hook(functools.partial(self._see, name))
                         for name, module in model.named_modules()
                         if not any(True for _ in module.children())
                         and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() >= 2}

    def _see(self, name: str, module: torch.nn.Module, args: tuple, output) -> None:
        if not torch.is_grad_enabled() or name in self.seen:
            return
        first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        self.seen[name] = {"weight": dtype_name(module.weight.dtype),
                           "input": dtype_name(first.dtype) if first is not None else "",
                           "output": dtype_name(output.dtype) if isinstance(output, torch.Tensor) else ""}
        self._handles.pop(name).remove()

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

    def message(self, precision: Precision) -> str:
        """One line: each distinct (weight, input, output) combination and the layers that ran it."""
        groups: dict[tuple[str, ...], list[str]] = {}
        for name, dtypes in self.seen.items():
            groups.setdefault((dtypes["weight"], dtypes["input"], dtypes["output"]), []).append(name)
        ran = "; ".join(f"{', '.join(names)}: {weight} weights gathered by FSDP2, {inputs} in, {output} out"
                        for (weight, inputs, output), names in groups.items()) or "no weighted layer ran"
        autocast = f"autocast {dtype_name(precision.autocast_dtype)} on" if precision.autocast_dtype else "no autocast"
        return (f"{precision.recipe}, what ran in the first forward (rank 0): {ran}; {autocast}; the optimizer steps "
                f"{precision.fsdp_dtypes()['shards']} shards")


def _fsdp_lane_meta(run: Run, lane: Lane) -> dict:
    """The FSDP2 policy a lane trains under, stored with the lane (Compare names it)."""
    return {"policy": get_precision(lane.mode, run.device).fsdp_label()}


def _describe_fsdp(run: Run) -> tuple[str, dict]:
    """The started event's words on FSDP2: what is sharded, over how many ranks, and each recipe's policy in full."""
    first = run.lanes[0].state.model
    blocks = fsdp_blocks(first)
    policies = {lane.mode: lane.state.precision.fsdp_dtypes() for lane in run.lanes if lane.state is not None}
    world = dist.get_world_size()
    words = "; ".join(f"{recipe}: param_dtype {d['param_dtype']}, reduce_dtype {d['reduce_dtype']}, output_dtype "
                      f"{d['output_dtype']}, shards {d['shards']}" for recipe, d in policies.items())
    clause = (f"FSDP2 over {world} ranks ({dist.get_backend()}): each lane's {', '.join(blocks) or 'model'}, then the "
              f"root, sharded on dim 0 (each rank holds 1/{world} of every parameter, gradient and optimizer state); "
              f"{words}")
    return clause, {"fsdp": {"world_size": world, "backend": dist.get_backend(), "sharded": [*blocks, "(root)"],
                             "placement": "Shard(0)", "policies": policies}}
