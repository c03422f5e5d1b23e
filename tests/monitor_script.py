"""A user's script for the Monitor tests, run in a process of its own: seed 000's fp16 loop (autocast + GradScaler)
under a Monitor, with overflows forced at chosen steps. It says on stdout (one JSON line each) where it pauses and,
at the end, which steps skipped by its own public-API check (the scale backed off), and waits on stdin at each pause:
the test decides when it goes on, or kills it there.

    python tests/monitor_script.py --store S --steps 40 --pause-at 9,19 --overflow-at 12,25 --plant-at 30,31

--plant-at plants an overflow in one module instead: at those steps the ReLU's (module "1") fp16 output is multiplied
by 1e5, past fp16's 65504, so its forward output is the first to hold inf (the first-inf/NaN event names it).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from amp_core.attach.monitor import Monitor


def numbers(text: str) -> set[int]:
    return {int(n) for n in text.split(",") if n.strip()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pause-at", type=numbers, default=set())
    parser.add_argument("--overflow-at", type=numbers, default=set())
    parser.add_argument("--plant-at", type=numbers, default=set())
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(64, 10), torch.randn(64, 1) * 5 + 10
    skipped, planted = [], [False]
    # Registered before the Monitor's layer hooks, so they see the planted inf as module "1"'s own output.
    model[1].register_forward_hook(lambda module, args, output: output * 1e5 if planted[0] else None)
    with Monitor(model, optimizer, scaler, name="monitor test script", store=args.store, gradstats_every=10) as monitor:
        for step in range(args.steps):
            planted[0] = step in args.plant_at
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            factor = 1e30 if step in args.overflow_at else 1.0  # the fp16 backward overflows
            before = scaler.get_scale()
            scaler.scale(loss * factor).backward()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < before:
                skipped.append(step)
            monitor.step(loss, samples=len(x))
            if step in args.pause_at:
                monitor.flush()
                print(json.dumps({"run_id": monitor.run_id, "paused_at": step, "skipped": skipped}), flush=True)
                sys.stdin.readline()
    print(json.dumps({"run_id": monitor.run_id, "steps": args.steps, "skipped": skipped}), flush=True)


if __name__ == "__main__":
    main()
