"""A researcher's own data: one NumPy ``.npz`` file (``data.dataset: npz``, ``data.root: FILE``).

The file holds either one pool, ``x`` and ``y``, or a training and a test part, ``x_train``,
``y_train``, ``x_test``, ``y_test`` (merged into one pool, training rows first, as the built-in
datasets' files are). Each client's train/test split is then drawn from its rows like theirs,
except where the file gives client ids with its two parts: then it is the file's split.

- ``x``: images ``(N, C, H, W)`` or ``(N, H, W)`` (one channel), or features ``(N, d)``.
  uint8 images are kept as pixels and standardised when read, with the per-channel mean and
  standard deviation of the whole pool (``PixelCodec``); any other numbers are used as they are,
  as float32 (the file's own preprocessing).
- ``y``: integer class labels ``0..C-1`` (classification, C = the largest label + 1, or the
  file's ``num_classes``), or floating-point targets (regression).
- ``client`` (``client_train`` and ``client_test`` with the split layout), optional: each row's
  client id. It gives the natural partition (one client per id, in increasing id order, holding
  exactly its rows) instead of a drawn one.
- ``cluster`` (``cluster_train``, ``cluster_test``), optional, with client ids: each row's true
  cluster, ``0..K-1``, one per client: the ground truth that clustering is scored against (ARI,
  minority) in place of ``data.cluster_sizes``.

Every mistake is a ``ValueError`` naming the key and what is allowed, so the CLI stops with it
before Ray starts.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from raysim.data.sources import BaseData, DataNotFoundError, PixelCodec

if TYPE_CHECKING:
    from raysim.data.federated import FederatedDataset

POOL_KEYS = ("x", "y")
SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")
PER_ROW_KEYS = ("client", "cluster")  # with the split layout: client_train, client_test...
SUFFIXES = ("_train", "_test")
OPTIONAL_KEYS = (*PER_ROW_KEYS, *(k + p for k in PER_ROW_KEYS for p in SUFFIXES), "num_classes")
LAYOUT = (
    "x and y (optionally client and cluster), or x_train, y_train, x_test and y_test "
    "(optionally client_train, client_test, cluster_train and cluster_test), and optionally "
    "num_classes"
)


def load_npz(path: str | None) -> BaseData:
    """The pooled dataset of the ``.npz`` file at ``path`` (``data.root``)."""
    if path is None:
        raise DataNotFoundError("data.root: data.dataset='npz' reads the .npz file data.root names")
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataNotFoundError(f"data.root: {str(file)!r} is not a file (npz needs a .npz file)")
    try:
        with np.load(file, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"data.root: {str(file)!r} is not a readable .npz file ({exc})") from None
    return base_from_arrays(arrays, f"data.root {str(path)!r}")


def base_from_arrays(arrays: dict[str, np.ndarray], name: str = "npz") -> BaseData:
    """``BaseData`` from the arrays of an ``.npz`` file; ``name`` labels the messages."""
    keys = set(arrays)
    unknown = sorted(keys - set(POOL_KEYS + SPLIT_KEYS + OPTIONAL_KEYS))
    if unknown:
        raise ValueError(f"{name}: unknown arrays {unknown}; an npz dataset holds {LAYOUT}")
    if keys >= set(SPLIT_KEYS) and not keys & set(POOL_KEYS):
        suffixes = SUFFIXES
    elif keys >= set(POOL_KEYS) and not keys & set(SPLIT_KEYS):
        suffixes = ("",)
    else:
        mixed = "both layouts, " if keys & set(POOL_KEYS) and keys & set(SPLIT_KEYS) else ""
        raise ValueError(f"{name}: holds {mixed}{sorted(keys)}; an npz dataset holds {LAYOUT}")
    xs = [_features(arrays["x" + p], "x" + p, name) for p in suffixes]
    ys = [_labels(arrays["y" + p], "y" + p, len(xs[i]), name) for i, p in enumerate(suffixes)]
    per_row: dict[str, np.ndarray] = {}
    for k in PER_ROW_KEYS:
        wanted = [k + p for p in suffixes]
        present = [k + p for p in ("", *SUFFIXES) if k + p in keys]
        if present and sorted(present) != sorted(wanted):
            layout = ", ".join("x" + p for p in suffixes)
            raise ValueError(f"{name}: with {layout} give {' and '.join(wanted)}")
        if present:
            per_row[k] = np.concatenate(
                [_ids(arrays[key], key, len(x), name) for key, x in zip(wanted, xs, strict=True)]
            )
    if "cluster" in per_row and "client" not in per_row:
        raise ValueError(f"{name}: a cluster per row needs the client ids (client) it belongs to")
    if len({x.shape[1:] for x in xs}) != 1 or len({x.dtype for x in xs}) != 1:
        raise ValueError(f"{name}: x_train {xs[0].shape} and x_test {xs[1].shape} differ per row")
    if len({y.dtype.kind for y in ys}) != 1:
        raise ValueError(f"{name}: y_train and y_test must both be labels or both targets")
    x, y = np.concatenate(xs), np.concatenate(ys)
    train_rows = len(xs[0]) if len(suffixes) == 2 else None
    task, num_classes = _task(y, arrays.get("num_classes"), name)
    groups = {"client": per_row.get("client"), "cluster": per_row.get("cluster")}
    if x.dtype == np.uint8 and x.ndim == 4:
        return BaseData(None, y, num_classes, task, train_rows, x, pixel_codec(x), **groups)
    return BaseData(x.astype(np.float32), y, num_classes, task, train_rows, **groups)


def pixel_codec(pixels: np.ndarray) -> PixelCodec:
    """Standardisation by the pool's own per-channel mean and std of the [0, 1]-scaled pixels
    (the built-in datasets use their published ones), from each channel's histogram of the 256
    values: exact, whatever the order of the rows, and without a float copy of the images."""
    mean, std = [], []
    values = np.arange(256, dtype=np.float64) / 255.0
    for c in range(pixels.shape[1]):
        counts = np.bincount(pixels[:, c].ravel(), minlength=256).astype(np.float64)
        m = float(counts @ values / counts.sum())
        s = float(np.sqrt(counts @ (values - m) ** 2 / counts.sum()))
        mean.append(m)
        std.append(s if s > 0 else 1.0)  # a constant channel: centred, not scaled
    return PixelCodec("npz", 255.0, tuple(mean), tuple(std))


def _features(x: np.ndarray, key: str, name: str) -> np.ndarray:
    if x.dtype.kind not in "uif" or x.ndim not in (2, 3, 4) or len(x) == 0:
        raise ValueError(
            f"{name}: {key} must be a non-empty numeric array (N, C, H, W), (N, H, W) or (N, d), "
            f"got {x.dtype} {x.shape}"
        )
    if x.ndim == 3:
        x = x[:, None]  # (N, H, W): one channel
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        raise ValueError(
            f"{name}: {key} {x.shape} looks channels-last; images are (N, C, H, W): "
            f"save x.transpose(0, 3, 1, 2)"
        )
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise ValueError(f"{name}: {key} holds NaN or infinite values")
    return x


def _labels(y: np.ndarray, key: str, rows: int, name: str) -> np.ndarray:
    if y.shape != (rows,):
        raise ValueError(
            f"{name}: {key} must be one value per row of x, shape ({rows},), got {y.shape}"
        )
    if y.dtype.kind in "iu":
        if len(y) and y.min() < 0:
            raise ValueError(f"{name}: {key}: class labels must be 0, 1, ..., got {int(y.min())}")
        return y.astype(np.int64)
    if y.dtype.kind == "f":
        if not np.isfinite(y).all():
            raise ValueError(f"{name}: {key} holds NaN or infinite targets")
        return y.astype(np.float32)
    raise ValueError(f"{name}: {key} must hold integer labels or float targets, got {y.dtype}")


def _ids(c: np.ndarray, key: str, rows: int, name: str) -> np.ndarray:
    if c.shape != (rows,) or c.dtype.kind not in "iu":
        raise ValueError(
            f"{name}: {key} must be one integer id per row, shape ({rows},), "
            f"got {c.dtype} {c.shape}"
        )
    return c.astype(np.int64)


def _task(y: np.ndarray, given: np.ndarray | None, name: str) -> tuple[str, int]:
    if y.dtype.kind == "f":
        if given is not None:
            raise ValueError(f"{name}: num_classes is for class labels; y holds float targets")
        return "regression", 0
    seen = int(y.max()) + 1
    if given is None:
        return "classification", seen
    if given.shape != () or given.dtype.kind not in "iu" or int(given) < seen:
        raise ValueError(
            f"{name}: num_classes must be one integer >= the largest label + 1 ({seen}), "
            f"got {given!r}"
        )
    return "classification", int(given)


def population_arrays(fd: FederatedDataset) -> dict[str, np.ndarray]:
    """A population as the arrays of an ``.npz`` file that ``data.dataset: npz`` reads back as
    the same population: the clients' rows in order, their train/test split, their true
    clusters, and the features as the clients read them (standardised float32, shifts applied;
    read back with ``data.shift: none``)."""
    parts: dict[str, list[np.ndarray]] = {}
    for i in range(fd.num_clients):
        for suffix, (x, y) in (("_train", fd.client_train(i)), ("_test", fd.client_test(i))):
            for key, value in (
                ("x", x),
                ("y", y),
                ("client", np.full(len(y), i, np.int64)),
                ("cluster", np.full(len(y), fd.true_cluster[i], np.int64)),
            ):
                parts.setdefault(key + suffix, []).append(value)
    arrays = {k: np.concatenate(v) for k, v in parts.items()}
    if fd.num_classes:
        arrays["num_classes"] = np.asarray(fd.num_classes, np.int64)
    return arrays
