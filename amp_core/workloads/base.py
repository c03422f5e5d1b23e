"""The workload contract: a model, its data, a loss, and a batch sampler every lane shares; what a plugin's Workload
must hold to join the registry (`contract_problems`)."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from amp_core.config import RunConfig

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
"""A workload name is typed on command lines and saved with runs: letters, digits, `_`, `.`, `-`."""


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
    """Base class of every workload: the built-ins (one file each in this package) and plugins (a module named at
    start-up that defines subclasses; see amp_core.workloads.load_plugins).

    A subclass sets `name`, `title`, `description` and `sizes`, and defines `load_data(config)`,
    `build_model(size, data)` and `loss(output, target)`; it is created with no arguments.
    """

    name: str = ""
    title: str = ""
    description: str = ""
    sizes: dict[str, dict[str, Any]] = {}
    requires: tuple[str, ...] = ()
    """The optional extras (pyproject.toml) it needs, e.g. ("hf",); listed without them, refused at launch."""

    def check_config(self, config: RunConfig) -> None:
        """Refuse settings this workload cannot use (raise ConfigError)."""
        from amp_core.config import ConfigError

        if config.data_dir:
            raise ConfigError("data_dir", f"{self.name} generates its own data; data_dir is for digits_mlp only")

    def load_data(self, config: RunConfig) -> Data:
        raise NotImplementedError

    def seeded_model_and_batch(self, config: RunConfig) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
        """A fresh model of `config.size` and its first batch of `config.batch_size`, seeded as a run seeds them
        (`config.seed`), without moving the process's global RNG (a training thread may be using it)."""
        data = self.load_data(config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = self.build_model(config.size, data)
        return model, data.sample(torch.Generator().manual_seed(config.seed), config.batch_size)

    def build_model(self, size: str, data: Data) -> torch.nn.Module:
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def samples_in(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        """How many samples a batch holds (for samples/s)."""
        return int(batch[0].shape[0])


REQUIRED_METHODS: dict[str, tuple[str, ...]] = {
    "load_data": ("config",), "build_model": ("size", "data"), "loss": ("output", "target")}
"""The methods a workload must define, with the arguments the runner passes them (positionally)."""


def contract_problems(workload: Workload, allowed_sizes: tuple[str, ...]) -> list[str]:
    """What keeps `workload` (an instance) from being used like a built-in, one sentence each; [] when nothing does.
    Checked without running anything of the plugin's but its attributes: building its data or model is left to a
    launch (where a failure is that run's error)."""
    problems = []
    name = getattr(workload, "name", None)
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        problems.append(f"`name` must be a non-empty string of letters, digits, _ . - (got {name!r})")
    for text in ("title", "description"):
        if not isinstance(getattr(workload, text, None), str):
            problems.append(f"`{text}` must be a string (got {getattr(workload, text, None)!r})")
    sizes = getattr(workload, "sizes", None)
    if not isinstance(sizes, dict) or not sizes:
        problems.append(f"`sizes` must be a non-empty dict of size name -> settings (got {sizes!r})")
    else:
        unknown = [size for size in sizes if size not in allowed_sizes]
        if unknown:
            problems.append(f"`sizes` names {', '.join(map(repr, unknown))}; a size is one of "
                            f"{', '.join(allowed_sizes)}")
    for method, arguments in REQUIRED_METHODS.items():
        bound = getattr(workload, method, None)
        if getattr(type(workload), method, None) is getattr(Workload, method) or not callable(bound):
            problems.append(f"it does not define {method}({', '.join(arguments)})")
            continue
        try:
            inspect.signature(bound).bind(*arguments)
        except TypeError as exc:
            problems.append(f"{method} cannot be called as {method}({', '.join(arguments)}): {exc}")
        except ValueError:  # a builtin without a signature: it will be called as it is
            pass
    return problems
