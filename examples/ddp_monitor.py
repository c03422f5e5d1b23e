"""A DDP training loop under torchrun, every rank watched by a Monitor; rank 0 gathers the ranks' figures over the
job's own process group and writes them to the store, each with its rank. Runs on a CPU (gloo) in seconds:

    python -m torch.distributed.run --nproc_per_node 2 examples/ddp_monitor.py [--steps 200] [--store runs.sqlite3]

On GPUs the same script uses NCCL, one GPU per rank (the Monitor needs torch.cuda.set_device(local_rank), as DDP
does). The dashboard's Train and Compare pages show each rank's step times and their spread.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_core.monitor import Monitor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--store", default=None, help="run store (default: $AMP_LAB_STORE or ~/.amp_lab)")
    parser.add_argument("--name", default="ddp example")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, device = dist.get_rank(), torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 1)).to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device.type)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data

    with Monitor(model, optimizer, scaler, name=args.name, store=args.store, mode="16-mixed") as monitor:
        for _ in range(args.steps):
            x = torch.randn(args.batch_size, 10, generator=generator).to(device)
            y = (x.sum(dim=1, keepdim=True) * 3 + 10).to(device)
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            monitor.step(loss, samples=args.batch_size)
    if rank == 0:
        print(f"run {monitor.run_id}: {monitor.steps_done} steps on each of {dist.get_world_size()} ranks")
    del model, optimizer, monitor
    gc.collect()  # DDP's reducer sits in reference cycles: collected now, not as Python exits (gloo may abort then)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
