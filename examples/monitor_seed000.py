"""Seed notes 000's loop (an MLP regression with autocast + GradScaler), watched by AMP Lab's Monitor: three added
lines (the import, the `with Monitor(...)`, `monitor.step(loss)`). Runs on a CPU in seconds, on CUDA when there is one:

    python examples/monitor_seed000.py [--epochs 2] [--store runs.sqlite3]

Open the dashboard (`amp-lab ui`) on the same store to watch it live: the first steps overflow in fp16 and are
skipped while the GradScaler backs its scale off (the Train page marks them, the Overflow debugger names the
parameters).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from amp_core.monitor import Monitor


class SimpleDataset(Dataset):
    """Random inputs and targets around 10, as in the seed."""

    def __init__(self, num_samples: int = 1000, input_dim: int = 10, output_dim: int = 1):
        self.X = torch.randn(num_samples, input_dim)
        self.y = torch.randn(num_samples, output_dim) * 5 + 10

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, idx):
        return self.X[idx], self.y[idx]


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(10, 20)
        self.relu = nn.ReLU()
        self.layer2 = nn.Linear(20, 1)

    def forward(self, x):
        return self.layer2(self.relu(self.layer1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--store", default=None, help="run store (default: $AMP_LAB_STORE or ~/.amp_lab)")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    dataloader = DataLoader(SimpleDataset(num_samples=args.samples), batch_size=64, shuffle=True)
    model = MyModel().to(device)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler(device)

    with Monitor(model, optim, scaler, name="seed 000: MLP regression", store=args.store) as monitor:
        for epoch in range(args.epochs):
            for batch_idx, (data, target) in enumerate(dataloader):
                data, target = data.to(device), target.to(device)
                optim.zero_grad()
                with torch.autocast(device, dtype=torch.float16):
                    output = model(data)
                    loss = criterion(output, target)
                scaler.scale(loss).backward()
                scaler.step(optim)
                scaler.update()
                monitor.step(loss, samples=len(data))
                if batch_idx % 100 == 0:
                    print(f"Epoch {epoch}, Batch {batch_idx}, Loss: {loss.item():.4f}")  # the seed's own print
    print(f"run {monitor.run_id}: {monitor.steps_done} steps ({monitor.mode})")


if __name__ == "__main__":
    main()
