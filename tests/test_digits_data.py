"""The 8x8 digits shipped with AMP Lab are the 1,797 images digits_mlp always trained on (no scikit-learn needed)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from amp_core.config import RunConfig
from amp_core.workloads import WORKLOADS
from amp_core.workloads.digits_mlp import DIGITS_FILE, load_shipped_digits

# Recorded when digits_8x8.npz was made (scripts/make_digits.py; amp_core/workloads/data/DIGITS.md says the same).
SHIPPED_SHA256 = "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"
# UCI's class distribution of its test set optdigits.tes, digits 0..9.
CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_the_shipped_arrays_are_the_recorded_ones():
    with np.load(DIGITS_FILE) as arrays:
        assert sorted(arrays.files) == ["images", "labels"]
        images, labels = arrays["images"], arrays["labels"]
    assert (images.shape, images.dtype, labels.shape, labels.dtype) == ((1797, 8, 8), np.uint8, (1797,), np.uint8)
    assert hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest() == SHIPPED_SHA256
    assert np.bincount(labels, minlength=10).tolist() == CLASS_COUNTS
    assert images.min() == 0 and images.max() == 16
    assert DIGITS_FILE.stat().st_size < 100_000  # a small compressed array, not a data set download


def test_the_shipped_arrays_equal_scikit_learns_copy():
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn is not installed (nor needed by AMP Lab)")
    reference = datasets.load_digits()
    images, labels = load_shipped_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(labels, reference.target)
    assert np.array_equal(images.reshape(len(images), -1), reference.data)


def test_digits_mlp_trains_on_the_shipped_images():
    data = WORKLOADS["digits_mlp"].load_data(RunConfig(workload="digits_mlp"))
    images, labels = load_shipped_digits()
    assert data.inputs.shape == (1797, 64) and data.inputs.dtype == torch.float32
    # Pixel counts 0..16 scaled to [0, 1], computed here in float64 and compared exactly (k / 16 is exact in fp32).
    expected = images.reshape(1797, 64).astype(np.float64) / 16.0
    assert np.array_equal(data.inputs.numpy().astype(np.float64), expected)
    assert data.targets.tolist() == labels.tolist()
    assert "1797 images of 8x8" in data.description
