"""The workload contract: a model, its data, a loss, and a batch sampler every lane shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from amp_core.config import RunConfig


@dataclass(frozen=True, slots=True)
class Data:
    """A workload's data on the CPU. `sample` draws one batch with the run's generator."""

    inputs: torch.Tensor
    targets: torch.Tensor
    description: str

    def sample(self, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(self.inputs), (batch_size,), generator=generator)
        return self.inputs[idx], self.targets[idx]


class Workload:
    """Base class: one subclass per file in this package, registered in WORKLOADS."""

    name: str = ""
    title: str = ""
    description: str = ""
    sizes: dict[str, dict[str, Any]] = {}

    def check_config(self, config: RunConfig) -> None:
        """Refuse settings this workload cannot use (raise ConfigError)."""
        from amp_core.config import ConfigError

        if config.data_dir:
            raise ConfigError("data_dir", f"{self.name} generates its own data; data_dir is for digits_mlp only")

    def load_data(self, config: RunConfig) -> Data:
        raise NotImplementedError

    def build_model(self, size: str, data: Data) -> torch.nn.Module:
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def samples_in(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        """How many samples a batch holds (for samples/s)."""
        return int(batch[0].shape[0])
