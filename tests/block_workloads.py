"""A workload with a planted outlier channel for block-scaled numerics and bisect tests: three Linear layers of 64
(whole blocks of 16 and 32, so NVFP4 and MXFP8 convert every one); fc2's input carries three constant outlier
features x300 in three different blocks of 16, so NVFP4 flushes their neighbours while MXFP8 (e4m3 elements, blocks of
32) keeps them."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads import Data, Workload

WIDTH = 64
OUTLIER = 300.0
OUTLIER_FEATURES = (5, 20, 40)
PLANTED_LAYER = "fc2"


class PlantedChannels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        outliers = torch.zeros(WIDTH)
        outliers[list(OUTLIER_FEATURES)] = OUTLIER
        self.register_buffer("outliers", outliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.gelu(self.fc1(x))
        return self.fc3(nn.functional.gelu(self.fc2(hidden + self.outliers) / 30.0))


class PlantedChannelWorkload(Workload):
    name = "planted_channel"
    title = "Linear layers with a planted outlier channel (block-scaled tests)"
    description = "fc1 -> GELU -> (+ three outlier features x300) fc2 -> GELU -> fc3; regression onto a fixed map."
    sizes = {"small": {}}

    def load_data(self, config) -> Data:
        generator = torch.Generator().manual_seed(config.seed)
        inputs = torch.randn(512, WIDTH, generator=generator)
        targets = torch.tanh(inputs @ torch.randn(WIDTH, WIDTH, generator=generator) / 8)
        return Data(inputs, targets, "512 synthetic samples, 64 features, 64 targets")

    def build_model(self, size: str, data: Data) -> nn.Module:
        return PlantedChannels()

    def loss(self, output, target):
        return nn.functional.mse_loss(output.float(), target)


BLOCKED_LAYER = "mid"
"""The layer whose every block of 16 inputs shares one with an outlier (PlantedBlocks)."""


class PlantedBlocks(nn.Module):
    """inp -> mid -> out, where mid sees an outlier x300 at the first feature of every 16 and its effect is taken off
    its output by plain code (mid(h + o) - W o: mid(h) exactly in real arithmetic): NVFP4 flushes the 15 small inputs
    beside each outlier to zero, so the signal never gets past `mid`; MXFP8 keeps them; kept out of the format, `mid`
    trains as in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        outliers = torch.zeros(WIDTH)
        outliers[::16] = OUTLIER
        self.register_buffer("outliers", outliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mid = self.mid(self.inp(x) + self.outliers) - nn.functional.linear(self.outliers, self.mid.weight)
        return self.out(mid)


class PlantedBlocksWorkload(PlantedChannelWorkload):
    name = "planted_blocks"
    title = "Linear layers, one whose every block shares an outlier (block-scaled bisect tests)"
    description = "inp -> mid (an outlier x300 in every 16 of its inputs, taken off after it) -> out; a linear map."

    def load_data(self, config) -> Data:
        generator = torch.Generator().manual_seed(config.seed)
        inputs = torch.randn(512, WIDTH, generator=generator)
        targets = inputs @ torch.randn(WIDTH, WIDTH, generator=generator) / 8
        return Data(inputs, targets, "512 synthetic samples, 64 features, a linear map")

    def build_model(self, size: str, data: Data) -> nn.Module:
        return PlantedBlocks()
