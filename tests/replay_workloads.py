"""A workload with one layer that overflows fp16 on a batch of large inputs while fp32 shrugs them off (for replay
tests: the planted precision fault)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from amp_core.workloads import Data, Workload

AMPLIFY = 300.0
"""The first layer's weights are multiplied by this: its outputs reach a few hundred on ordinary inputs, fine in
fp16; inputs 1000x larger push them past fp16's 65504, and the LayerNorm after it makes fp32 indifferent to scale."""


class AmplifiedNorm(Workload):
    """4-class classification of 16 inputs: amplify (Linear, x300) -> LayerNorm -> ReLU -> head."""

    name = "amplified_norm"
    title = "Amplified layer before a LayerNorm (replay tests)"
    description = "One Linear whose outputs run in the hundreds, then a LayerNorm: scale-free in fp32."
    sizes = {"small": {"samples": 512}}

    def load_data(self, config) -> Data:
        generator = torch.Generator().manual_seed(config.seed)
        inputs = torch.randn(self.sizes[config.size]["samples"], 16, generator=generator)
        targets = (inputs[:, :4] * torch.arange(1.0, 5.0)).argmax(dim=1)
        return Data(inputs, targets, "512 synthetic samples, 16 features, 4 classes")

    def build_model(self, size: str, data: Data) -> nn.Module:
        model = nn.Sequential(OrderedDict(amplify=nn.Linear(16, 64), norm=nn.LayerNorm(64), act=nn.ReLU(),
                                          head=nn.Linear(64, 4)))
        with torch.no_grad():
            model.amplify.weight.mul_(AMPLIFY)
        return model

    def loss(self, output, target):
        return nn.functional.cross_entropy(output.float(), target)
