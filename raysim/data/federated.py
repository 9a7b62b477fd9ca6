"""The federated population: one columnar table, sliced per client without copies.

Storage choice. The population is one ``pyarrow.Table`` (``x``: FixedSizeList of the flattened
features, ``y``, ``source_index``) plus small numpy metadata. Image datasets store their uint8
pixels (``pixels``, a ``PixelCodec``) and standardise a client's rows when they are read, with
the loader's own float32 operations (the same bits, a 4x smaller table); other data is float32.
Ray pickles with protocol 5 and hands every Arrow buffer (and numpy array) out of band, so
``ray.put(fd)`` writes the column buffers into the object store once and ``ray.get`` in any
worker maps them back without a copy: the numpy views returned by
:meth:`FederatedDataset.client_train` point straight into the shared plasma memory for float32
data, and so do the pixel views images are decoded from (``tests/test_data_ray.py`` checks the
address lies in ``/dev/shm/plasma*`` and is the same across two ``ray.get`` calls). The derived
numpy views are dropped when pickling, or the data would travel twice.

The views are read-only (Arrow buffers are immutable): copy before mutating (decoded images are
fresh arrays). ``torch.from_numpy`` warns on read-only arrays; use ``torch.tensor(x)`` (one copy
per batch) or ``torch.from_numpy(x.copy())``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from raysim.data.lazy import ByCluster, LazyPopulation
from raysim.data.load import load_base
from raysim.data.partition import (
    ClientRng,
    allocate_dirichlet,
    allocate_iid,
    allocate_natural,
    apply_shift,
    cluster_assignment,
    iid_samples_per_client,
    num_train_for,
    shared_samples,
    split_as_given,
    split_train_test,
)
from raysim.data.public import private_pool
from raysim.data.seeding import client_rng, rng_for
from raysim.data.sources import BaseData, PixelCodec
from raysim.data.synthetic import make_synthetic_linear

if TYPE_CHECKING:  # the section's type only: data sits below the config's schema
    from raysim.config import DataConfig

_VIEWS = ("_x", "_y")


@dataclass(eq=False)
class FederatedDataset(ByCluster):
    """All clients' data; rows ordered by client, each client's train rows then its test rows."""

    table: pa.Table  # x: fixed_size_list<float32 | uint8>[prod(feature_shape)], y, source_index
    offsets: np.ndarray  # (num_clients + 1,) int64: client i owns rows offsets[i]:offsets[i+1]
    num_train: np.ndarray  # (num_clients,) int64: the first num_train[i] rows of i are train
    true_cluster: np.ndarray  # (num_clients,) int64
    feature_shape: tuple[int, ...]
    num_classes: int  # 0 for regression
    task: str  # "classification" | "regression"
    dataset: str
    meta: dict[str, Any] = field(default_factory=dict)  # provenance: seed, shift, true params...
    pixels: PixelCodec | None = None  # x holds uint8 pixels, standardised on read

    def __post_init__(self) -> None:
        if any(self.table.column(c).num_chunks != 1 for c in self.table.column_names):
            self.table = self.table.combine_chunks()
        self.offsets = np.asarray(self.offsets, dtype=np.int64)
        self.num_train = np.asarray(self.num_train, dtype=np.int64)
        self.true_cluster = np.asarray(self.true_cluster, dtype=np.int64)
        self.feature_shape = tuple(int(s) for s in self.feature_shape)
        n = len(self.true_cluster)
        if self.offsets.shape != (n + 1,) or self.num_train.shape != (n,):
            raise ValueError("offsets / num_train / true_cluster disagree on the number of clients")
        if self.offsets[0] != 0 or self.offsets[-1] != self.table.num_rows:
            raise ValueError("offsets must run from 0 to the number of rows")
        if np.any(self.num_train < 0) or np.any(self.num_train > np.diff(self.offsets)):
            raise ValueError("num_train must lie between 0 and each client's size")
        self._attach_views()

    def _attach_views(self) -> None:
        rows = self.table.column("x").chunk(0)
        width = rows.type.list_size
        x = _numpy_view(rows.values.slice(rows.offset * width, len(rows) * width))
        self._x = x.reshape(self.table.num_rows, *self.feature_shape)
        self._y = _numpy_view(self.table.column("y").chunk(0))

    # Pickle (and so ray.put) the table and metadata only; views are rebuilt on arrival.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _VIEWS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attach_views()

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def train_sizes(self) -> np.ndarray:
        return self.num_train.copy()

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def client_train(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client i's training ``(x, y)``: float32 x shaped (n, *feature_shape), y a read-only
        view (x too, except for images, which are decoded from their pixel view)."""
        lo = self.offsets[i]
        return self._rows(lo, lo + self.num_train[i])

    def client_test(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Client i's local test ``(x, y)``, as ``client_train``."""
        return self._rows(self.offsets[i] + self.num_train[i], self.offsets[i + 1])

    def client_pixels(self, i: int) -> np.ndarray | None:
        """Client i's stored rows (train then test) as uint8 pixel views; None when not images."""
        return None if self.pixels is None else self._x[self.offsets[i] : self.offsets[i + 1]]

    def _rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        x = self._x[lo:hi]
        return (x if self.pixels is None else self.pixels.decode(x)), self._y[lo:hi]

    def cluster_labels(self, k: int) -> tuple[np.ndarray, None]:
        """The stored labels of cluster k's clients (train and test); None: all of them."""
        y = self._y
        return np.concatenate(
            [y[self.offsets[i] : self.offsets[i + 1]] for i in self.clients_of_cluster(k)]
        ), None

    def client_source_index(self, i: int) -> np.ndarray:
        """Pool index of each of client i's rows (train then test): for tests and debugging."""
        col = self.table.column("source_index").chunk(0).to_numpy(zero_copy_only=True)
        return col[self.offsets[i] : self.offsets[i + 1]]

    # --------------------------------------------------------------------------- persistence

    def to_parquet(self, path: str) -> None:
        """Write the table with all metadata in the Parquet schema (one self-contained file)."""
        import pyarrow.parquet as pq

        header = {
            "offsets": self.offsets.tolist(),
            "num_train": self.num_train.tolist(),
            "true_cluster": self.true_cluster.tolist(),
            "feature_shape": list(self.feature_shape),
            "num_classes": self.num_classes,
            "task": self.task,
            "dataset": self.dataset,
            "meta": {k: np.asarray(v).tolist() for k, v in self.meta.items()},
            "pixels": None if self.pixels is None else asdict(self.pixels),
        }
        table = self.table.replace_schema_metadata({"raysim": json.dumps(header)})
        pq.write_table(table, path)

    @classmethod
    def from_parquet(cls, path: str) -> FederatedDataset:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        header = json.loads(table.schema.metadata[b"raysim"])
        meta = {
            k: v if not isinstance(v, list) else np.asarray(v) for k, v in header["meta"].items()
        }
        return cls(
            table=table.replace_schema_metadata(None),
            offsets=np.asarray(header["offsets"]),
            num_train=np.asarray(header["num_train"]),
            true_cluster=np.asarray(header["true_cluster"]),
            feature_shape=tuple(header["feature_shape"]),
            num_classes=header["num_classes"],
            task=header["task"],
            dataset=header["dataset"],
            meta=meta,
            pixels=_codec(header.get("pixels")),
        )


def _codec(header: str | dict[str, Any] | None) -> PixelCodec | None:
    """A table's codec: its fields, or (files written before codecs carried statistics) the
    built-in dataset's name."""
    if not header:
        return None
    if isinstance(header, str):
        return PixelCodec(header)
    stats = {k: tuple(v) if isinstance(v, list) else v for k, v in header.items()}
    return PixelCodec(**stats)


def make_table(x: np.ndarray, y: np.ndarray, source_index: np.ndarray) -> pa.Table:
    """Columnar population table; wraps the numpy buffers without copying them (x: uint8
    pixels stay uint8, anything else becomes float32)."""
    dtype = np.uint8 if x.dtype == np.uint8 else np.float32
    flat = np.ascontiguousarray(x, dtype=dtype).reshape(len(x), -1)
    values = _arrow(flat.reshape(-1))
    # Not FixedSizeListArray.from_arrays (nor .flatten() to read it): both load pyarrow.compute
    # (~0.1 s in every process that builds or opens the population)
    xcol = pa.Array.from_buffers(
        pa.list_(values.type, flat.shape[1]), len(x), [None], children=[values]
    )
    columns = [xcol, _arrow(y), _arrow(np.asarray(source_index, dtype=np.int64))]
    return pa.Table.from_arrays(columns, names=["x", "y", "source_index"])


def _numpy_view(array: pa.Array) -> np.ndarray:
    """A read-only numpy view of a primitive Arrow array without nulls. Not ``to_numpy``: it
    imports pandas (~0.4 CPU-s in every process that opens the population)."""
    if array.null_count or not pa.types.is_primitive(array.type) or pa.types.is_boolean(array.type):
        raise TypeError(f"population column of type {array.type} cannot be viewed without a copy")
    dtype = np.dtype(array.type.to_pandas_dtype())
    data = array.buffers()[1]
    view = np.frombuffer(data, dtype, count=len(array), offset=array.offset * dtype.itemsize)
    view.flags.writeable = False
    return view


def _arrow(values: np.ndarray) -> pa.Array:
    """A 1-D numpy array as an Arrow array over the same buffer. Not ``pa.array``: its first
    call imports pandas (~0.4 CPU-s in the start-up's serial part) to ask whether ``values``
    is a pandas object."""
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("="))
    kind = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def _allocate(cfg: DataConfig, base: BaseData, seed: int) -> Sequence[np.ndarray]:
    if base.client is not None:  # the data's own partition
        for key in ("dirichlet_alpha", "samples_per_client"):
            if getattr(cfg, key) is not None:
                raise ValueError(
                    f"data.{key}: the data's client ids give each client its rows; remove it"
                )
        keep = (
            private_pool(base, cfg.public_pretrain_samples) if cfg.public_pretrain_samples else None
        )
        return allocate_natural(base.client, cfg.num_clients, keep)
    if cfg.public_pretrain_samples:  # the public slice never reaches a client
        pool = private_pool(base, cfg.public_pretrain_samples)
        return pool[_allocate_rows(cfg, base.y[pool], base.num_classes, seed)]
    return _allocate_rows(cfg, base.y, base.num_classes, seed)


def client_draws(cfg: DataConfig, seed: int, purpose: str) -> ClientRng | None:
    """Each client's own generator of ``purpose`` (``data.draws: per_client``), or None where
    one generator serves client after client (``sequential``)."""
    if cfg.draws == "sequential":
        return None
    return partial(client_rng, seed, purpose)


def _allocate_rows(cfg: DataConfig, y: np.ndarray, num_classes: int, seed: int) -> np.ndarray:
    if cfg.dirichlet_alpha is None:
        return allocate_iid(
            len(y),
            cfg.num_clients,
            cfg.samples_per_client,
            rng_for(seed, "allocate"),
            client_draws(cfg, seed, "allocate"),
        )
    return allocate_dirichlet(
        y,
        cfg.num_clients,
        cfg.samples_per_client,
        cfg.dirichlet_alpha,
        rng_for(seed, "dirichlet"),
        num_classes=num_classes,
    )


def file_clusters(
    cfg: DataConfig, row_cluster: np.ndarray, allocation: Sequence[np.ndarray]
) -> np.ndarray:
    """Each client's true cluster as the data gives it (one per client, numbered 0..K-1)."""
    for key in ("cluster_sizes", "cluster_ratios"):
        if getattr(cfg, key) is not None:
            raise ValueError(f"data.{key}: the data gives each client's cluster; remove it")
    clusters = np.array([row_cluster[rows[0]] for rows in allocation], dtype=np.int64)
    mixed = [i for i, rows in enumerate(allocation) if np.any(row_cluster[rows] != clusters[i])]
    if mixed:
        raise ValueError(f"data: clients {mixed[:10]} have rows of more than one cluster")
    missing = sorted(set(range(int(clusters.max()) + 1)) - set(clusters.tolist()))
    if missing:
        raise ValueError(f"data: clusters are numbered 0..K-1; no client is in {missing[:10]}")
    return clusters


def build_population(
    cfg: DataConfig, seed: int, kind: str = "auto"
) -> FederatedDataset | LazyPopulation:
    """The population a run trains on, as a table or lazily (``runtime.population``: the same
    rows either way). ``auto``: lazy where clients must share the pool's rows (more clients
    than the pool fits), where a table would grow past the dataset; else the table."""
    if kind == "table":
        return build_federated_dataset(cfg, seed)
    why = _why_not_lazy(cfg)
    if why is not None:
        if kind == "lazy":
            raise ValueError(f"runtime.population=lazy: {why}; use table or auto")
        return build_federated_dataset(cfg, seed)
    base = load_base(cfg.dataset, cfg.root)
    if base.client is not None:
        if kind == "lazy":
            raise ValueError(
                "runtime.population=lazy: the data's client ids give each client its rows (a "
                "natural partition, built whole); use table or auto"
            )
        return build_federated_dataset(cfg, seed, base)
    pool = private_pool(base, cfg.public_pretrain_samples) if cfg.public_pretrain_samples else None
    pool_size = len(base) if pool is None else len(pool)
    n = iid_samples_per_client(pool_size, cfg.num_clients, cfg.samples_per_client)
    fits = n * cfg.num_clients <= pool_size
    if fits and kind == "auto":
        return build_federated_dataset(cfg, seed, base)
    clusters = cluster_assignment(cfg.num_clients, cfg.cluster_sizes, cfg.cluster_ratios)
    order = (
        rng_for(seed, "allocate").permutation(pool_size)[: n * cfg.num_clients] if fits else None
    )
    if not fits:
        warnings.warn(shared_samples(pool_size, cfg.num_clients, n), stacklevel=2)
    meta: dict[str, Any] = {"seed": int(seed), "shift": cfg.shift, "shared_samples": not fits}
    if cfg.public_pretrain_samples:
        meta["public_pretrain_samples"] = cfg.public_pretrain_samples
    lazy = LazyPopulation(
        source=base.features if base.pixels is None else base.pixels,
        labels=base.y,
        pool=pool,
        pool_size=pool_size,
        order=order,
        samples_per_client=n,
        train_rows=num_train_for(n, cfg.train_fraction),
        seed=int(seed),
        shift=cfg.shift,
        true_cluster=clusters,
        **_described(base, cfg, meta),
    )
    lazy.client_train(0)  # a shift the data cannot take is refused now, not on a worker
    return lazy


def _described(base: BaseData, cfg: DataConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """A population's description of its rows, the same whichever way they are kept."""
    return {
        "feature_shape": base.feature_shape,
        "num_classes": base.num_classes,
        "task": base.task,
        "dataset": cfg.dataset,
        "meta": meta,
        "pixels": base.codec if base.pixels is not None else None,
    }


def _why_not_lazy(cfg: DataConfig) -> str | None:
    """Why the config's clients cannot be made one at a time (None: they can)."""
    if cfg.dataset == "synthetic_linear":
        return "synthetic_linear generates every client's rows from one stream"
    if cfg.dirichlet_alpha is not None:
        return "data.dirichlet_alpha deals the pool's rows out client after client"
    if cfg.draws == "sequential":
        return "data.draws=sequential draws each client's split after the one before"
    return None


def build_federated_dataset(
    cfg: DataConfig, seed: int, base: BaseData | None = None
) -> FederatedDataset:
    """The population a run trains on, fully determined by ``(cfg, seed)``.

    Clusters (``cluster_sizes``/``cluster_ratios``), then per-client samples (uniform or
    Dirichlet label skew), each client's shuffled ``train_fraction`` split, then the shift of
    cluster k (rotation by k*90 degrees or labels (y+k) mod C). Raises ``DataNotFoundError`` when
    files are missing and ``ValueError`` naming the ``data.*`` field when the request can't be met.
    """
    clusters = cluster_assignment(cfg.num_clients, cfg.cluster_sizes, cfg.cluster_ratios)
    meta: dict[str, Any] = {"seed": int(seed), "shift": cfg.shift}
    if cfg.dataset == "synthetic_linear":
        if cfg.public_pretrain_samples:
            raise ValueError("data.public_pretrain_samples: synthetic_linear has no public slice")
        if cfg.dirichlet_alpha is not None:
            raise ValueError(
                "data.dirichlet_alpha: label skew needs class labels; synthetic_linear is "
                "regression (its clusters differ by their true weights)"
            )
        syn = make_synthetic_linear(clusters, cfg, seed)
        base = syn.data
        n = syn.samples_per_client
        allocation = np.arange(len(base), dtype=np.int64).reshape(cfg.num_clients, n)
        meta.update(true_weights=syn.weights, true_bias=syn.bias)
    else:
        base = load_base(cfg.dataset, cfg.root) if base is None else base
        allocation = _allocate(cfg, base, seed)
        if base.client is not None:
            meta["partition"] = "natural"  # the data's client ids
        if base.cluster is not None:
            clusters = file_clusters(cfg, base.cluster, allocation)
        if cfg.dirichlet_alpha is not None:
            meta["dirichlet_alpha"] = cfg.dirichlet_alpha
        if cfg.public_pretrain_samples:
            meta["public_pretrain_samples"] = cfg.public_pretrain_samples
    if base.client is not None and base.train_file_size is not None:
        rows, offsets, num_train = split_as_given(allocation, base.train_file_size)
    else:
        split = client_draws(cfg, seed, "split") or rng_for(seed, "split")
        rows, offsets, num_train = split_train_test(list(allocation), cfg.train_fraction, split)
    meta["shared_samples"] = bool(len(np.unique(rows)) < len(rows))  # clients hold the same rows
    # images travel as their uint8 pixels (rotated as they are), standardised when read
    x = base.images(rows) if base.pixels is None else base.pixels[rows]
    y = base.y[rows]
    if cfg.dataset != "synthetic_linear":  # its clusters differ by their true weights
        apply_shift(x, y, np.repeat(clusters, np.diff(offsets)), cfg.shift, base.num_classes)
    return FederatedDataset(
        table=make_table(x, y, rows),
        offsets=offsets,
        num_train=num_train,
        true_cluster=clusters,
        **_described(base, cfg, meta),
    )
