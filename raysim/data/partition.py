"""Cutting a pooled dataset into a federated population with a known cluster structure.

Pure numpy: every function takes the ``np.random.Generator`` it may use (see ``seeding``), so
the same seed always yields the same clients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np

SHIFTS = ("none", "rotation", "label_flip")

# A client's own generator for one purpose, by client id (``seeding.client_rng``): the
# per-client draws that let a client's rows be made without drawing anyone else's.
ClientRng = Callable[[int], np.random.Generator]


# ------------------------------------------------------------------------------ cluster structure


def sizes_from_ratios(num_clients: int, ratios: Sequence[float]) -> list[int]:
    """Cluster sizes proportional to ``ratios`` that sum to ``num_clients``.

    Largest-remainder rounding: floor every quota, then give the leftover clients to the largest
    fractional parts (ties to the lower cluster index), so [2, 1, 1] of 1000 is [500, 250, 250].
    """
    r = np.asarray(ratios, dtype=np.float64)
    if r.ndim != 1 or len(r) == 0 or not np.all(np.isfinite(r)) or np.any(r <= 0):
        raise ValueError(f"data.cluster_ratios: need positive numbers, got {list(ratios)}")
    quota = num_clients * r / r.sum()
    sizes = np.floor(quota).astype(np.int64)
    short = num_clients - int(sizes.sum())
    order = sorted(range(len(r)), key=lambda k: (-(quota[k] - sizes[k]), k))
    for k in order[:short]:
        sizes[k] += 1
    return [int(s) for s in sizes]


def cluster_assignment(
    num_clients: int,
    cluster_sizes: Sequence[int] | None = None,
    cluster_ratios: Sequence[float] | None = None,
) -> np.ndarray:
    """True cluster of every client, numbered cluster by cluster (cluster 0's clients first).

    With neither sizes nor ratios there is one cluster. Every cluster must get a client.
    """
    if num_clients <= 0:
        raise ValueError(f"data.num_clients must be positive, got {num_clients}")
    if cluster_sizes is not None and cluster_ratios is not None:
        raise ValueError("give data.cluster_sizes or data.cluster_ratios, not both")
    if cluster_sizes is not None:
        sizes = [int(s) for s in cluster_sizes]
        if not sizes or min(sizes) <= 0 or sum(sizes) != num_clients:
            raise ValueError(
                f"data.cluster_sizes {sizes} must be positive and add up to "
                f"data.num_clients={num_clients}"
            )
    elif cluster_ratios is not None:
        sizes = sizes_from_ratios(num_clients, cluster_ratios)
        if min(sizes) == 0:
            raise ValueError(
                f"data.cluster_ratios {list(cluster_ratios)} leave a cluster empty with "
                f"data.num_clients={num_clients} (sizes {sizes})"
            )
    else:
        sizes = [num_clients]
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)


# ------------------------------------------------------------------------- sample allocation


def resolve_samples_per_client(
    pool_size: int, num_clients: int, samples_per_client: int | None
) -> int:
    """``samples_per_client`` or, when None, the whole pool divided evenly (remainder unused)."""
    n = samples_per_client if samples_per_client is not None else pool_size // num_clients
    if n <= 0:
        raise ValueError(
            f"data.num_clients={num_clients} exceeds the {pool_size} samples of the dataset; "
            "lower data.num_clients or set data.samples_per_client"
        )
    return int(n)


def allocate_iid(
    pool_size: int,
    num_clients: int,
    samples_per_client: int | None,
    rng: np.random.Generator,
    client_rng: ClientRng | None = None,
) -> np.ndarray:
    """Uniform allocation, equal sizes: (num_clients, n) indices into the pool.

    While ``num_clients * n <= pool_size`` clients are disjoint (one permutation, cut into
    blocks). Beyond that a sample can no longer be unique: each client then draws its ``n``
    indices without replacement on its own (``shared_samples``), so samples repeat across
    clients (never within one) and a ``UserWarning`` says so. ``n > pool_size`` is an error.
    """
    n = iid_samples_per_client(pool_size, num_clients, samples_per_client)
    if n * num_clients <= pool_size:
        return rng.permutation(pool_size)[: n * num_clients].reshape(num_clients, n)
    warnings.warn(shared_samples(pool_size, num_clients, n), stacklevel=2)
    if client_rng is not None:
        return np.stack(
            [client_rng(i).choice(pool_size, n, replace=False) for i in range(num_clients)]
        )
    return np.stack([rng.choice(pool_size, n, replace=False) for _ in range(num_clients)])


def iid_samples_per_client(pool_size: int, num_clients: int, samples_per_client: int | None) -> int:
    """Each client's samples under the uniform allocation; an error past the pool's size."""
    n = resolve_samples_per_client(pool_size, num_clients, samples_per_client)
    if n > pool_size:
        raise ValueError(
            f"data.samples_per_client={n} exceeds the {pool_size} samples of the dataset"
        )
    return n


def shared_samples(pool_size: int, num_clients: int, n: int) -> str:
    """What a run says where clients share base samples (a run's summary says it too)."""
    return (
        f"{num_clients} clients x {n} samples > {pool_size} in the dataset: "
        "samples are reused across clients (each client's own samples stay distinct)"
    )


def allocate_natural(
    client_ids: np.ndarray, num_clients: int, keep: np.ndarray | None = None
) -> list[np.ndarray]:
    """The data's own partition: one client per distinct id, in increasing id order, holding the
    rows with that id (of ``keep``, when given). Clients may differ in size."""
    rows = np.arange(len(client_ids), dtype=np.int64) if keep is None else np.asarray(keep)
    ids, first = np.unique(client_ids[rows], return_inverse=True)
    if len(ids) != num_clients:
        raise ValueError(
            f"data.num_clients={num_clients}, but the data's client ids name {len(ids)} "
            f"clients; set data.num_clients: {len(ids)}"
        )
    sizes = np.bincount(first, minlength=len(ids))
    if sizes.min() < 2:
        small = ids[sizes < 2][:10].tolist()
        raise ValueError(
            f"data: clients {small} of the data's client ids have fewer than 2 rows; a client "
            "needs at least 2 for its train/test split"
        )
    order = np.argsort(first, kind="stable")  # rows grouped by client, in row order within
    return np.split(rows[order], np.cumsum(sizes)[:-1])


def allocate_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    samples_per_client: int | None,
    alpha: float,
    rng: np.random.Generator,
    num_classes: int | None = None,
) -> np.ndarray:
    """Label-skewed allocation, equal sizes, without replacement: (num_clients, n) indices.

    The usual construction (Hsu et al. 2019): client i draws class proportions
    ``q_i ~ Dir(alpha * 1_C)`` and takes ``n`` samples by those proportions from the remaining
    pool of each class. When a class runs dry its share is redrawn over the classes still
    available. Clients are served in a random order, so the late clients' forced leftovers are
    not tied to a cluster. Small ``alpha`` gives one or two classes per client, large ``alpha``
    near-uniform labels.
    """
    labels = np.asarray(labels)
    c = int(num_classes if num_classes is not None else labels.max() + 1)
    n = resolve_samples_per_client(len(labels), num_clients, samples_per_client)
    if n * num_clients > len(labels):
        raise ValueError(
            f"data.samples_per_client={n}: {num_clients} clients x {n} samples exceed the "
            f"{len(labels)} samples of the dataset (Dirichlet allocation never reuses samples)"
        )
    pools = [rng.permutation(np.flatnonzero(labels == k)) for k in range(c)]
    left = np.array([len(p) for p in pools], dtype=np.int64)
    taken = np.zeros(c, dtype=np.int64)
    out = np.empty((num_clients, n), dtype=np.int64)
    for i in rng.permutation(num_clients):
        q = rng.dirichlet(np.full(c, float(alpha)))
        counts = np.zeros(c, dtype=np.int64)
        need = n
        while need > 0:
            avail = left > 0
            p = np.where(avail, q, 0.0)
            if not np.isfinite(p).all() or p.sum() <= 0:
                p = avail.astype(np.float64)
            got = np.minimum(rng.multinomial(need, p / p.sum()), left)
            counts += got
            left -= got
            need -= int(got.sum())
        out[i] = np.concatenate([pools[k][taken[k] : taken[k] + counts[k]] for k in range(c)])
        taken += counts
    return out


# --------------------------------------------------------------------------- train/test split


def num_train_for(n: int, train_fraction: float) -> int:
    """Train size of an ``n``-sample client: round(fraction * n), leaving >= 1 of each side."""
    if n < 2:
        raise ValueError(
            f"a client needs at least 2 samples for its train/test split, got {n}; "
            "raise data.samples_per_client or lower data.num_clients"
        )
    return int(min(max(np.floor(train_fraction * n + 0.5), 1), n - 1))


def split_train_test(
    allocation: Sequence[np.ndarray],
    train_fraction: float,
    rng: np.random.Generator | ClientRng,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shuffle each client's samples and cut them into train then test.

    ``rng``: each client's own generator (``ClientRng``: ``data.draws: per_client``), or one
    generator drawn from client after client (``sequential``, the draws of earlier versions).
    Returns ``(rows, offsets, num_train)``: ``rows`` are pool indices in population order (client
    0's train rows, its test rows, then client 1...), client i owns
    ``rows[offsets[i]:offsets[i+1]]`` of which the first ``num_train[i]`` are train.
    """
    sizes = np.array([len(a) for a in allocation], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    num_train = np.array([num_train_for(int(s), train_fraction) for s in sizes], dtype=np.int64)
    rows = np.concatenate(
        [
            (rng(i) if callable(rng) else rng).permutation(np.asarray(a, dtype=np.int64))
            for i, a in enumerate(allocation)
        ]
    )
    return rows, offsets, num_train


def split_as_given(
    allocation: Sequence[np.ndarray], train_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``split_train_test``'s result where the data splits each client itself: its rows from
    the training part (pool rows before ``train_rows``) are its train rows, the others its test
    rows, each in the data's order."""
    parts = [(a[a < train_rows], a[a >= train_rows]) for a in allocation]
    empty = [i for i, (train, test) in enumerate(parts) if not len(train) or not len(test)]
    if empty:
        raise ValueError(
            f"data: clients {empty[:10]} have no row in x_train or none in x_test; with client "
            "ids, the data's own split is each client's train/test split"
        )
    rows = np.concatenate([np.concatenate(p) for p in parts]).astype(np.int64)
    num_train = np.array([len(train) for train, _ in parts], dtype=np.int64)
    sizes = np.array([len(a) for a in allocation], dtype=np.int64)
    return rows, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), num_train


# ------------------------------------------------------------------------------------- shifts


def apply_shift(
    x: np.ndarray, y: np.ndarray, row_cluster: np.ndarray, shift: str, num_classes: int
) -> None:
    """Make cluster k differ from cluster 0, in place on population arrays.

    ``rotation`` (covariate shift): images of cluster k turned by k * 90 degrees, i.e.
    ``np.rot90(img, k)`` over the (H, W) axes. ``label_flip`` (concept shift):
    ``y -> (y + k) mod num_classes``. ``none``: nothing.
    """
    if shift not in SHIFTS:
        raise ValueError(f"data.shift: unknown shift {shift!r}; allowed: {', '.join(SHIFTS)}")
    if shift == "none":
        return
    if shift == "rotation" and (x.ndim != 4 or x.shape[-1] != x.shape[-2]):
        raise ValueError(
            f"data.shift='rotation' needs square images (N, C, H, H), got {x.shape}; "
            "set data.shift to none or label_flip"
        )
    if shift == "label_flip" and num_classes <= 0:
        raise ValueError("data.shift='label_flip' needs a classification dataset")
    for k in (int(v) for v in np.unique(row_cluster)):
        mask = row_cluster == k
        if shift == "rotation" and k % 4:
            x[mask] = np.rot90(x[mask], k, axes=(-2, -1))
        elif shift == "label_flip" and k % num_classes:
            y[mask] = (y[mask] + k) % num_classes
