"""checkerboard_cnn: grid coordinates -> checkerboard with a 1x1 Conv2d/BatchNorm2d/ReLU stack (seed notes 004)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from amp_core.workloads.base import Data, Workload


def grid(width: int, height: int) -> torch.Tensor:
    hrange = torch.arange(width).unsqueeze(0).repeat([height, 1]).div(width)
    vrange = torch.arange(height).unsqueeze(1).repeat([1, width]).div(height)
    return torch.stack([hrange, vrange], 0)


def checker(width: int, height: int, freq: int) -> torch.Tensor:
    hrange = torch.arange(width).reshape([1, width]).mul(freq / width / 2.0).fmod(1.0).gt(0.5)
    vrange = torch.arange(height).reshape([height, 1]).mul(freq / height / 2.0).fmod(1.0).gt(0.5)
    return hrange.logical_xor(vrange).float()


class Net(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, channels, 1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 1, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True, slots=True)
class CropData(Data):
    """Batches are random square crops of the one image (the seed trains on the whole 512x512 image)."""

    crop: int = 16

    def sample(self, generator, batch_size):
        _, _, height, width = self.inputs.shape
        crop = min(self.crop, height, width)
        ys = torch.randint(height - crop + 1, (batch_size,), generator=generator).tolist()
        xs = torch.randint(width - crop + 1, (batch_size,), generator=generator).tolist()
        inputs = torch.stack([self.inputs[0, :, y:y + crop, x:x + crop] for y, x in zip(ys, xs, strict=True)])
        targets = torch.stack([self.targets[0, :, y:y + crop, x:x + crop] for y, x in zip(ys, xs, strict=True)])
        return inputs, targets


class CheckerboardCNN(Workload):
    name = "checkerboard_cnn"
    title = "Checkerboard pattern (a small convolutional network)"
    description = ("Learns to draw a checkerboard from pixel coordinates with 1x1 convolutions and BatchNorm, "
                   "squared-error loss: a classic mixed-precision example (EffectivePyTorch's).")
    sizes = {"small": {"image": 64, "crop": 16, "channels": 64},
             "medium": {"image": 128, "crop": 64, "channels": 128},
             "large": {"image": 512, "crop": 512, "channels": 256},
             # For a GPU: 1024-channel 1x1 convolutions (about 3 TFLOP a step at batch 64) on 64x64 crops, so the
             # activations (about 1 GiB a tensor at batch 64) fit a GPU's memory.
             "xl": {"image": 512, "crop": 64, "channels": 1024}}

    def load_data(self, config) -> Data:
        s = self.sizes[config.size]
        side = s["image"]
        return CropData(grid(side, side).unsqueeze(0), checker(side, side, 8).unsqueeze(0).unsqueeze(1),
                        f"{side}x{side} checkerboard, {s['crop']}x{s['crop']} crops", s["crop"])

    def build_model(self, size: str, data: Data) -> nn.Module:
        return Net(self.sizes[size]["channels"])

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)
