"""A LightningModule recorded by AMP Lab with one callback: a small MLP fits a noisy sine on the CPU in seconds.

    python examples/lightning_module.py [--store S] [--steps 40] [--precision 32-true|bf16-mixed|16-true|16-mixed]

It prints the run's id and, as JSON on its last line, the losses its training_step returned (for the tests).
"""

from __future__ import annotations

import argparse
import json
import warnings

import lightning as L
import torch
from torch import nn

from amp_core.integrations.lightning import AmpLabCallback


class SineFit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())  # the example's own check, not AMP Lab's (which adds no sync)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None, help="store path (default: $AMP_LAB_STORE)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|litlogger).*")

    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 512).unsqueeze(1)
    data = torch.utils.data.TensorDataset(x, torch.sin(x) + 0.05 * torch.randn_like(x))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    module = SineFit()
    amp_lab = AmpLabCallback(name="lightning example", store=args.store)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=args.precision, max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[amp_lab])
    trainer.fit(module, loader)
    monitor = amp_lab.monitor
    print(f"run {monitor.run_id}: {monitor.steps_done} steps ({monitor.mode})")
    print(json.dumps({"run_id": monitor.run_id, "losses": module.losses}))


if __name__ == "__main__":
    main()
