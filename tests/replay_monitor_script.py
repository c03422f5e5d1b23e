"""A user's 16-mixed loop (autocast + GradScaler on the CPU) under a Monitor, for the attached-replay tests, run in a
process of its own: one batch is an outlier (its inputs, and a regression's targets, times a factor) at a chosen step.
It prints one JSON line at the end: the run's id and the steps its scaler skipped.

    python tests/replay_monitor_script.py --store S --model amplified --outlier-at 30 --factor 1000 --replay true

Models: `amplified` (a Linear whose outputs run in the hundreds before a LayerNorm: large inputs overflow its fp16
output while fp32 shrugs them off: a precision failure); `regression` (an MLP on values: inputs and targets times the
factor make the loss an outlier in every format: a data failure); `wide` (a 4096x1536 Linear, 24 MiB of weights and
twice that of Adam's moments: above replay="auto"'s limit of 64 MiB, by a margin, and no larger, since the Monitor's
gradient statistics on its skipped steps take their time).
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict

import torch
from torch import nn

from amp_core.attach.monitor import Monitor

AMPLIFY = 300.0


def build(kind: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, bool]:
    """(model, inputs, targets, whether the targets are values that an outlier scales too)."""
    torch.manual_seed(0)
    if kind == "amplified":
        model = nn.Sequential(OrderedDict(amplify=nn.Linear(16, 64), norm=nn.LayerNorm(64), act=nn.ReLU(),
                                          head=nn.Linear(64, 4)))
        with torch.no_grad():
            model.amplify.weight.mul_(AMPLIFY)
        inputs = torch.randn(64, 16)
        return model, inputs, (inputs[:, :4] * torch.arange(1.0, 5.0)).argmax(dim=1), False
    if kind == "regression":
        model = nn.Sequential(OrderedDict(layer1=nn.Linear(10, 20), relu=nn.ReLU(), layer2=nn.Linear(20, 1)))
        inputs = torch.randn(64, 10)
        return model, inputs, inputs.sum(dim=1, keepdim=True) * 0.5 + 1, True
    model = nn.Sequential(nn.Linear(4096, 1536), nn.ReLU(), nn.Linear(1536, 1))
    inputs = torch.randn(8, 4096)
    return model, inputs, torch.randn(8, 1), True


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.is_floating_point():
        return nn.functional.mse_loss(output.float(), target)
    return nn.functional.cross_entropy(output.float(), target)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--model", choices=["amplified", "regression", "wide"], default="amplified")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--outlier-at", type=int, default=-1)
    parser.add_argument("--factor", type=float, default=1000.0)
    parser.add_argument("--replay", choices=["auto", "true", "false"], default="auto")
    args = parser.parse_args()

    model, inputs, targets, scale_targets = build(args.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    replay = {"auto": "auto", "true": True, "false": False}[args.replay]
    skipped = []
    with Monitor(model, optimizer, scaler, name=f"replay test ({args.model})", store=args.store, replay=replay,
                 loss_fn=lambda net, batch: loss_of(net(batch[0]), batch[1])) as monitor:
        for step in range(args.steps):
            batch = (inputs, targets)
            if step == args.outlier_at:
                batch = (inputs * args.factor, targets * args.factor if scale_targets else targets)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model(batch[0]), batch[1])
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < before:
                skipped.append(step)
            monitor.step(loss, samples=len(batch[0]), batch=batch)
    print(json.dumps({"run_id": monitor.run_id, "skipped": skipped}), flush=True)


if __name__ == "__main__":
    main()
