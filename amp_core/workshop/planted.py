"""The workload of the workshop's "find the layer" scenario, loaded as a plugin when the scenario builds its runs:
the shipped 8x8 digits through blocks of Linear -> gain -> LayerNorm -> GELU, where one block's gain overflows fp16
and the others are large but safe — the kind of hand-written layer (an unscaled logit, a sum of squares) that breaks
one 16-bit recipe while every other layer would be fine."""

from __future__ import annotations

import torch
from torch import nn

from amp_core.workloads import Data, Workload
from amp_core.workloads.digits_mlp import DigitsMLP

PLANTED_BLOCK = 2
"""The block whose gain overflows fp16."""
PLANTED_MODULE = f"blocks.{PLANTED_BLOCK}.gain"
"""Its module name: what the scenario's bisect should find."""
OVERFLOW = 1e6
"""The planted gain multiplies by this and divides again: exact in fp32, inf in fp16 (largest 65504) for |x| > 0.07."""
SAFE = 300.0
"""The other blocks' gain: a few hundred at most after a Linear, well inside fp16."""
WIDTH, DEPTH = 32, 4


class Gain(nn.Module):
    """x * factor / factor: the identity in fp32, an overflow in a 16-bit format once |x| * factor passes its range."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.factor) / self.factor


class Boost(nn.Module):
    """x * factor: a module whose own output leaves fp16's range (factor 1e5 after values near 1) and that the code
    after it scales back by plain arithmetic (a hand-written logit scale, a sum before a mean). Kept in fp32, its
    fp32 output must reach that code as it is: cast back to fp16 at the module's boundary it is inf already."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Block(nn.Module):
    def __init__(self, width: int, factor: float):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gain = Gain(factor)
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.gain(self.linear(x))))


class PlantedNet(nn.Module):
    def __init__(self, features: int, classes: int):
        super().__init__()
        self.embed = nn.Linear(features, WIDTH)
        self.blocks = nn.Sequential(*(Block(WIDTH, OVERFLOW if index == PLANTED_BLOCK else SAFE)
                                      for index in range(DEPTH)))
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


class WorkshopPlantedDigits(Workload):
    name = "workshop_planted_digits"
    title = "Digits through blocks with one planted fp16 overflow (workshop)"
    description = (f"The shipped 8x8 digits through {DEPTH} blocks of Linear -> gain -> LayerNorm -> GELU; block "
                   f"{PLANTED_BLOCK}'s gain (x{OVERFLOW:g}, undone at once) overflows fp16, the others (x{SAFE:g}) "
                   "are large but safe. The workshop's \"find the layer\" scenario bisects it.")
    sizes = {"small": {}}

    def load_data(self, config) -> Data:
        return DigitsMLP().load_data(config)

    def build_model(self, size: str, data: Data) -> nn.Module:
        return PlantedNet(data.inputs.shape[1], 10)

    def loss(self, output, target):
        return nn.functional.cross_entropy(output.float(), target)


def register() -> None:
    """Load this module as a workload plugin (once; a later call changes nothing)."""
    from amp_core.workloads import load_plugins

    problems = load_plugins([__name__])
    if problems:
        raise RuntimeError(problems[0].message())


# --- "see it coming": a layer whose output grows steadily until fp16 overflows -----------------------------------

GROWING_MODULE = f"blocks.{PLANTED_BLOCK}.gain"
"""The module whose output grows (in GrowingPlantedDigits)."""
GROWTH_START = 64.0
"""The growing gain's factor at step 0: its output starts some 8 bits below fp16's largest value."""
GROWTH_RATES = {"small": 0.04, "medium": 0.02, "large": 0.01}
"""Size name -> bits per step the growing gain's factor gains (it doubles every 1 / rate steps): fp16 overflows after
roughly 200, 400 and 800 steps (a larger size is a longer run, the model is the same)."""
E4M3_START = GROWTH_START * 448.0 / 65504.0
"""GrowingE4m3Digits's factor at step 0: as far below e4m3's largest value (448) as GROWTH_START is below fp16's."""


class GrowingGain(nn.Module):
    """x * GROWTH_START * 2**(rate * steps), `steps` counting its training forwards: the LayerNorm after it takes the
    factor out again, so training is untouched in fp32 while the output's range grows geometrically — in a 16-bit
    format it overflows at the step the factor passes the format's range. (The count is an integer buffer: the model's
    casts leave it exact, and a shadow copy takes it with the weights.)"""

    def __init__(self, rate: float, start: float = GROWTH_START):
        super().__init__()
        self.rate, self.start = rate, start
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A 0-d tensor: no host read, and x keeps its dtype (a 16-bit x overflows as the layer would).
        factor = self.start * torch.exp2(self.rate * self.steps.double()).float()
        if self.training:
            self.steps += 1
        return x * factor


class GrowingNet(PlantedNet):
    def __init__(self, features: int, classes: int, rate: float, start: float = GROWTH_START):
        super().__init__(features, classes)
        self.blocks[PLANTED_BLOCK].gain = GrowingGain(rate, start)
        for index, block in enumerate(self.blocks):
            if index != PLANTED_BLOCK:
                block.gain = Gain(1.0)


class GrowingPlantedDigits(Workload):
    name = "workshop_growing_digits"
    title = "Digits through blocks with one layer whose output grows until fp16 overflows (workshop)"
    description = (f"The shipped 8x8 digits through {DEPTH} blocks of Linear -> gain -> LayerNorm -> GELU; block "
                   f"{PLANTED_BLOCK}'s gain grows by a rate per step (size: {', '.join(GROWTH_RATES)}) and the "
                   "LayerNorm after it undoes it: fine in fp32, an fp16 overflow after a few hundred steps that the "
                   "forecast should see coming.")
    sizes = {name: {"rate": rate} for name, rate in GROWTH_RATES.items()}

    def load_data(self, config) -> Data:
        return DigitsMLP().load_data(config)

    def build_model(self, size: str, data: Data) -> nn.Module:
        return GrowingNet(data.inputs.shape[1], 10, **self.sizes[size])

    def loss(self, output, target):
        return nn.functional.cross_entropy(output.float(), target)


class GrowingE4m3Digits(GrowingPlantedDigits):
    """The growing layer started as far below e4m3's largest value as GrowingPlantedDigits starts below fp16's: its
    output passes 448 where the other's passes 65504 (bench.forecast's e4m3 cases: where an unscaled e4m3 cast of
    it would overflow; it trains in fp32 or bf16 untouched)."""

    name = "workshop_growing_digits_e4m3"
    title = "Digits through blocks with one layer whose output grows past e4m3's largest value (workshop)"
    description = (f"{GrowingPlantedDigits.description.split(';')[0]}; block {PLANTED_BLOCK}'s gain grows by a rate "
                   f"per step (size: {', '.join(GROWTH_RATES)}) from {E4M3_START:.3g}, its output passing e4m3's "
                   "largest value (448) after a few hundred steps.")
    sizes = {name: {"rate": rate, "start": E4M3_START} for name, rate in GROWTH_RATES.items()}
