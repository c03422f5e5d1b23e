"""A DDP job (torchrun, gloo) whose rank 1 poisons its own gradients after the all-reduce at one step, as a rank-local
bug would: that rank's GradScaler skips the step, the others do not. Its Monitors must say so.

    python -m torch.distributed.run --nproc_per_node 2 tests/ddp_skip_mismatch.py --store S --poison-at 7
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_core.attach.monitor import Monitor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--poison-at", type=int, default=7)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # small: no natural overflow, only the poisoned step
    generator = torch.Generator().manual_seed(rank)
    with Monitor(model, optimizer, scaler, store=args.store, name="skip mismatch") as monitor:
        for step in range(args.steps):
            x = torch.randn(32, 8, generator=generator)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            scaler.scale(loss).backward()
            if rank == 1 and step == args.poison_at:
                model.module[0].weight.grad[0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
            monitor.step(loss)
    del model, optimizer, monitor
    gc.collect()  # DDP's reducer sits in reference cycles: collected now, not as Python exits (gloo may abort then)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
