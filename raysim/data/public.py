"""The public pretraining slice: images set aside for a central, frozen base model.

A LoRA model needs a frozen base that comes from somewhere real. Offline there is no pretrained
model, so the base is pretrained centrally on a *public* slice of the same dataset: the last
``data.public_pretrain_samples`` images of the dataset's training file (for Fashion-MNIST with
10000: training images 50000-59999), unrotated and with their true labels. The federated
partition never allocates those rows (``build_federated_dataset`` removes them from the pool
before clients are drawn), so no client ever holds an image the base was trained on.
"""

from __future__ import annotations

import numpy as np

from raysim.data.sources import BaseData


def public_indices(base: BaseData, samples: int) -> np.ndarray:
    """Pool rows of the public slice: the last ``samples`` rows of the training file."""
    stop = base.train_file_size if base.train_file_size is not None else len(base)
    if samples < 0:
        raise ValueError(f"data.public_pretrain_samples must be >= 0, got {samples}")
    if samples >= stop:
        raise ValueError(
            f"data.public_pretrain_samples={samples} leaves no training images for the clients "
            f"(the training file has {stop})"
        )
    return np.arange(stop - samples, stop, dtype=np.int64)


def private_pool(base: BaseData, samples: int) -> np.ndarray:
    """Pool rows the federated partition may use: everything but the public slice."""
    keep = np.ones(len(base), dtype=bool)
    keep[public_indices(base, samples)] = False
    return np.flatnonzero(keep)


def load_public_slice(
    dataset: str, root: str | None, samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of the public slice: standardised float32 images and int64 labels (copies)."""
    from raysim.data.load import load_base

    if samples < 1:
        raise ValueError(f"data.public_pretrain_samples must be >= 1, got {samples}")
    if dataset == "synthetic_linear":
        raise ValueError("data.public_pretrain_samples: synthetic_linear has no public slice")
    base = load_base(dataset, root)
    idx = public_indices(base, samples)
    return base.images(idx), base.y[idx].copy()
