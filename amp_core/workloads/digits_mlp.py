"""digits_mlp: the MNIST MLP of seed notes 002 on real handwritten digits (shipped 8x8, or MNIST idx files)."""

from __future__ import annotations

import gzip
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from amp_core.workloads.base import Data, Workload

DIGITS_FILE = Path(__file__).resolve().parent / "data" / "digits_8x8.npz"
"""UCI's 1,797 8x8 handwritten digits, shipped with AMP Lab (data/DIGITS.md: source, licence, how it was made)."""


class Net(nn.Module):
    """fc1 -> ReLU -> fc2, as in the seed (784 -> 256 -> 10 for MNIST; 64 -> 256 -> 10 for 8x8 digits)."""

    def __init__(self, in_features: int, hidden: int, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def read_idx(path: Path) -> np.ndarray:
    """Read one MNIST idx file (optionally .gz) into an array; ValueError if it is not one."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path.name} is not an unsigned-byte idx file")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path.name} is cut short: its header names {ndim} dimensions")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path.name}: header says {dims} but holds {body.size} bytes")
    return body.reshape(dims)


def find_mnist(folder: Path) -> tuple[Path, Path]:
    """The training images and labels files in `folder` (plain or .gz); FileNotFoundError naming what is missing."""
    found = {}
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        for candidate in (folder / stem, folder / f"{stem}.gz", folder / stem.replace("-idx", ".idx")):
            if candidate.is_file():
                found[stem] = candidate
                break
        else:
            raise FileNotFoundError(f"{folder} has no {stem}[.gz]")
    return found["train-images-idx3-ubyte"], found["train-labels-idx1-ubyte"]


@lru_cache(maxsize=4)
def _load(data_dir: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    if data_dir:
        images_path, labels_path = find_mnist(Path(data_dir))
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"MNIST files in {data_dir} disagree: images {images.shape}, labels {labels.shape}")
        x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255.0)
        description = f"MNIST idx: {len(x)} images of {images.shape[1]}x{images.shape[2]}"
        return x, torch.from_numpy(labels.astype(np.int64)), description
    images, labels = load_shipped_digits()
    x = torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 16.0)  # pixel counts 0..16 -> [0, 1]
    return x, torch.from_numpy(labels.astype(np.int64)), f"UCI 8x8 digits: {len(x)} images of 8x8"


def load_shipped_digits() -> tuple[np.ndarray, np.ndarray]:
    """The shipped digits: images uint8 (1797, 8, 8) with pixel counts 0..16, labels uint8 (1797,) 0..9."""
    with np.load(DIGITS_FILE) as arrays:
        return arrays["images"], arrays["labels"]


class DigitsMLP(Workload):
    name = "digits_mlp"
    title = "Handwritten digits (a small classifier network)"
    description = ("Tells which digit (0-9) an 8x8 image of a handwritten digit shows: a two-layer network "
                   "(fc1, ReLU, fc2) with a cross-entropy loss. The images ship with AMP Lab; MNIST files work too.")
    sizes = {"small": {"hidden": 256}, "medium": {"hidden": 1024}, "large": {"hidden": 4096}}

    def check_config(self, config) -> None:
        from amp_core.config import ConfigError

        if config.data_dir:
            try:
                find_mnist(Path(config.data_dir))
            except FileNotFoundError as exc:
                raise ConfigError("data_dir", str(exc)) from None

    def load_data(self, config) -> Data:
        x, y, description = _load(config.data_dir)
        return Data(x, y, description)

    def build_model(self, size: str, data: Data) -> nn.Module:
        return Net(data.inputs.shape[1], self.sizes[size]["hidden"])

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)
