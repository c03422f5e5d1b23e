"""Make digits_8x8.npz, the 8x8 handwritten digits digits_mlp trains on, from scikit-learn's bundled copy (run once).

The array is in the repository so that AMP Lab needs no scikit-learn (and no scipy) to run. To make it again, on a
machine with scikit-learn installed (it is not in requirements.txt), from the repository root:

    python3 scripts/make_digits.py

It lives outside the amp_core package so that nothing the package imports (or ships) needs scikit-learn.
It prints the SHA-256 of the arrays' bytes; DIGITS.md and tests/test_digits_data.py record the one shipped.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

OUT = Path(__file__).resolve().parents[1] / "amp_core" / "workloads" / "data" / "digits_8x8.npz"


def main() -> None:
    digits = load_digits()
    # Pixels are counts 0..16 (of a 4x4 block of the 32x32 bitmap): uint8 holds them exactly.
    images = digits.images.astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target)
    np.savez_compressed(OUT, images=images, labels=labels)
    digest = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    print(f"{OUT.name}: {len(images)} images {images.shape[1]}x{images.shape[2]}, {OUT.stat().st_size} bytes, "
          f"sha256(images + labels) = {digest}")


if __name__ == "__main__":
    main()
