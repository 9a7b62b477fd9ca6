"""A population whose clients' rows are made when asked: cross-device scale on one machine.

A client's rows are a function of (data seed, client id): which pool images it holds (a block of
one permutation of the pool while the clients fit in it, else its own draw without replacement),
their order and train/test cut (its own generator), and its cluster's shift. So the worker that
trains a client makes its rows then and drops them after, and what the population holds is the
base pool (shared zero-copy, as the table is) and a few numbers per client: memory and start-up
do not grow with the number of clients. The rows are the very rows the table
(``raysim.data.federated``) holds for the same config and seed (``tests/test_data_lazy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raysim.data.partition import apply_shift
from raysim.data.seeding import client_rng
from raysim.data.sources import PixelCodec


class ByCluster:
    """What both kinds of population read off each client's true cluster and sizes."""

    true_cluster: np.ndarray
    sizes: np.ndarray
    train_sizes: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.true_cluster)

    @property
    def num_clusters(self) -> int:
        return int(self.true_cluster.max()) + 1

    @property
    def test_sizes(self) -> np.ndarray:
        return self.sizes - self.train_sizes

    def clients_of_cluster(self, k: int) -> np.ndarray:
        return np.flatnonzero(self.true_cluster == k)


@dataclass(eq=False)
class LazyPopulation(ByCluster):
    """Every client holds ``samples_per_client`` pool rows, the first ``train_rows`` for training.

    ``source``: the base pool's stored rows (uint8 pixels decoded by ``pixels``, or float32
    features); ``pool``: the rows clients may hold (None: all; else the private pool, without
    the public slice); ``order``: the pool permutation cut into one block per client, where the
    clients fit in the pool (None: each client draws its own)."""

    source: np.ndarray
    labels: np.ndarray
    pool: np.ndarray | None
    pool_size: int
    order: np.ndarray | None
    samples_per_client: int
    train_rows: int
    seed: int
    shift: str
    true_cluster: np.ndarray  # (num_clients,) int64
    feature_shape: tuple[int, ...]
    num_classes: int
    task: str
    dataset: str
    meta: dict[str, Any] = field(default_factory=dict)
    pixels: PixelCodec | None = None

    def __post_init__(self) -> None:
        self.true_cluster = np.asarray(self.true_cluster, dtype=np.int64)
        self.feature_shape = tuple(int(s) for s in self.feature_shape)

    @property
    def train_sizes(self) -> np.ndarray:
        return np.full(self.num_clients, self.train_rows, dtype=np.int64)

    @property
    def sizes(self) -> np.ndarray:
        return np.full(self.num_clients, self.samples_per_client, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        arrays = (self.source, self.labels, self.pool, self.order, self.true_cluster)
        return int(sum(a.nbytes for a in arrays if a is not None))

    def client_source_index(self, i: int) -> np.ndarray:
        """Pool index of each of client i's rows, train then test (the table's order)."""
        n = self.samples_per_client
        if self.order is not None:
            picked = self.order[i * n : (i + 1) * n]
        else:
            picked = client_rng(self.seed, "allocate", i).choice(self.pool_size, n, replace=False)
        if self.pool is not None:
            picked = self.pool[picked]
        return client_rng(self.seed, "split", i).permutation(np.asarray(picked, dtype=np.int64))

    def cluster_labels(self, k: int, most: int = 2000) -> tuple[np.ndarray, int | None]:
        """The stored labels of cluster k's clients (train and test), and None; or, where
        clients draw their own rows, those of ``most`` of its clients drawn at random, and how
        many: a million clients' draws would take seconds to read."""
        ids = self.clients_of_cluster(k)
        sampled = None
        if self.order is not None:
            rows = self.order.reshape(self.num_clients, -1)[ids].ravel()
            rows = rows if self.pool is None else self.pool[rows]
        else:
            if len(ids) > most:
                ids = np.sort(
                    client_rng(self.seed, "describe", -1).choice(ids, most, replace=False)
                )
                sampled = most
            rows = np.concatenate([self.client_source_index(int(i)) for i in ids])
        y = self.labels[rows]
        if self.shift == "label_flip" and self.num_classes and k % self.num_classes:
            y = (y + k) % self.num_classes
        return y, sampled

    def client_pixels(self, i: int) -> np.ndarray | None:
        """Client i's rows (train then test) as uint8 pixels, shifted; None when not images."""
        return None if self.pixels is None else self._stored(i)[0]

    def client_train(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client i's training ``(x, y)``, as the table's ``client_train`` (fresh arrays)."""
        x, y = self._stored(i)
        return self._decode(x[: self.train_rows]), y[: self.train_rows]

    def client_test(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self._stored(i)
        return self._decode(x[self.train_rows :]), y[self.train_rows :]

    def _stored(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client i's rows as the table stores them: pool rows, its cluster's shift applied."""
        rows = self.client_source_index(i)
        x, y = self.source[rows], self.labels[rows]
        cluster = np.full(len(rows), self.true_cluster[i], dtype=np.int64)
        apply_shift(x, y, cluster, self.shift, self.num_classes)
        return x, y

    def _decode(self, x: np.ndarray) -> np.ndarray:
        return x if self.pixels is None else self.pixels.decode(x)
