"""Seed notes 001's loop (Adam + OneCycleLR + GradScaler under autocast), watched by AMP Lab's Monitor. The scheduler
is handed to the Monitor too: the run then knows its length (OneCycleLR's total_steps) for the progress bar, and the
LR chart shows the one-cycle schedule. Runs on a CPU in seconds (raise --epochs to watch it longer):

    python examples/monitor_onecycle.py [--epochs 4] [--store runs.sqlite3]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from amp_core.monitor import Monitor


class Regressor(nn.Module):
    def __init__(self, features: int, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--store", default=None, help="run store (default: $AMP_LAB_STORE or ~/.amp_lab)")
    parser.add_argument("--name", default="seed 001: OneCycleLR + GradScaler")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 16))
    y = x @ rng.normal(size=16) * 4 + 20  # targets far from 0: fp16 gradients overflow at the initial scale
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)

    torch.manual_seed(0)
    model = Regressor(x.shape[1]).to(device)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, args.lr, cycle_momentum=False, epochs=args.epochs,
        steps_per_epoch=int(np.ceil(len(x) / args.batch_size)))
    scaler = torch.amp.GradScaler(device)
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size,
                                          shuffle=True)

    with Monitor(model, optimizer, scaler, scheduler, name=args.name, store=args.store) as monitor:
        for epoch in range(args.epochs):
            for i, (x_batch, y_batch) in enumerate(batches):
                x_batch, y_batch = x_batch.to(device), y_batch.to(device)
                optimizer.zero_grad()
                with torch.autocast(device, dtype=torch.float16):
                    y_pred = model(x_batch).squeeze()
                    loss = loss_fn(y_pred, y_batch)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                monitor.step(loss, samples=len(x_batch))
                if i % 32 == 0:
                    print(f"Epoch {epoch + 1}/{args.epochs}; Batch {i}; Loss: {loss.item():.4f}")
    print(f"run {monitor.run_id}: {monitor.steps_done} steps ({monitor.mode})")


if __name__ == "__main__":
    main()
