"""The datasets by the names configs use (``data.dataset``): each loaded as one pooled
``BaseData``, read from its source (``sources``: the built-in ones; ``arrays``: a user's npz)."""

from __future__ import annotations

from raysim.data.arrays import load_npz
from raysim.data.sources import BaseData, load_cifar10, load_digits, load_idx_dataset


def load_base(name: str, root: str | None) -> BaseData:
    """Load dataset ``name`` as one pooled ``BaseData``.

    ``synthetic_linear`` needs the cluster of every client, so it has its own entry point
    (:func:`raysim.data.synthetic.make_synthetic_linear`).
    """
    if name == "digits":
        return load_digits()
    if name in ("mnist", "fmnist"):
        return load_idx_dataset(name, root)
    if name == "cifar10":
        return load_cifar10(root)
    if name == "npz":
        return load_npz(root)
    if name == "synthetic_linear":
        raise ValueError(
            "synthetic_linear is generated per client from the cluster assignment; "
            "use raysim.data.synthetic.make_synthetic_linear (build_federated_dataset does)"
        )
    raise ValueError(f"data.dataset: unknown dataset {name!r}")
