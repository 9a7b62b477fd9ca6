"""The federated population built from a config: shifts, splits, determinism, persistence."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raysim.config import DataConfig
from raysim.data import FederatedDataset, build_federated_dataset, describe, load_base
from raysim.data.partition import apply_shift

PAPER = dict(dataset="digits", num_clients=21, cluster_sizes=[3, 6, 6, 6])


@pytest.fixture(scope="module")
def digits_x() -> np.ndarray:
    return load_base("digits", None).x


def _client_rows(fd: FederatedDataset, i: int) -> tuple[np.ndarray, np.ndarray]:
    (xtr, ytr), (xte, yte) = fd.client_train(i), fd.client_test(i)
    return np.concatenate([xtr, xte]), np.concatenate([ytr, yte])


def test_paper_population_shape() -> None:
    fd = build_federated_dataset(DataConfig(**PAPER), seed=0)
    assert fd.num_clients == 21
    assert np.bincount(fd.true_cluster).tolist() == [3, 6, 6, 6]
    assert fd.feature_shape == (1, 8, 8) and fd.num_classes == 10
    n = 1797 // 21  # all data divided evenly
    assert fd.sizes.tolist() == [n] * 21
    assert fd.train_sizes.tolist() == [round(0.8 * n)] * 21
    assert (fd.train_sizes + fd.test_sizes).tolist() == [n] * 21
    x, y = fd.client_train(4)
    assert x.shape == (fd.train_sizes[4], 1, 8, 8) and x.dtype == np.float32
    assert y.dtype == np.int64


def test_clients_are_disjoint_and_rows_ordered() -> None:
    """Every pool row belongs to one client, and the table holds the clients one after another
    (client i's rows at offsets[i]:offsets[i + 1], as many as its train and test sets)."""
    fd = build_federated_dataset(DataConfig(**PAPER), seed=3)
    src = np.concatenate([fd.client_source_index(i) for i in range(fd.num_clients)])
    assert len(np.unique(src)) == len(src) == fd.table.num_rows
    assert fd.offsets[0] == 0 and fd.offsets[-1] == fd.table.num_rows
    assert np.array_equal(np.diff(fd.offsets), fd.sizes)
    for i in (0, 7, fd.num_clients - 1):
        x, _ = fd.client_train(i)
        xt, _ = fd.client_test(i)
        rows = fd.client_source_index(i)
        assert len(rows) == len(x) + len(xt)


def test_rotation_is_exactly_rot90_k(digits_x: np.ndarray) -> None:
    fd = build_federated_dataset(DataConfig(**PAPER, shift="rotation"), seed=1)
    plain = build_federated_dataset(DataConfig(**PAPER, shift="none"), seed=1)
    for i in range(fd.num_clients):
        k = int(fd.true_cluster[i])
        x, y = _client_rows(fd, i)
        x0, y0 = _client_rows(plain, i)
        np.testing.assert_array_equal(
            x, np.rot90(digits_x[fd.client_source_index(i)], k, axes=(2, 3))
        )
        np.testing.assert_array_equal(x, np.rot90(x0, k, axes=(2, 3)))
        np.testing.assert_array_equal(y, y0)


def test_label_flip_is_exactly_y_plus_k(digits_x: np.ndarray) -> None:
    fd = build_federated_dataset(DataConfig(**PAPER, shift="label_flip"), seed=1)
    plain = build_federated_dataset(DataConfig(**PAPER, shift="none"), seed=1)
    for i in range(fd.num_clients):
        k = int(fd.true_cluster[i])
        x, y = _client_rows(fd, i)
        x0, y0 = _client_rows(plain, i)
        np.testing.assert_array_equal(y, (y0 + k) % 10)
        np.testing.assert_array_equal(x, digits_x[fd.client_source_index(i)])


def test_same_seed_same_bits_other_seed_differs() -> None:
    cfg = DataConfig(**PAPER, dirichlet_alpha=0.5)
    a, b, c = (build_federated_dataset(cfg, s) for s in (7, 7, 8))
    assert a.table.equals(b.table)
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.num_train, b.num_train)
    assert not np.array_equal(a.client_source_index(0), c.client_source_index(0))


def test_dirichlet_population_is_skewed() -> None:
    fd = build_federated_dataset(
        DataConfig(dataset="digits", num_clients=20, dirichlet_alpha=0.05), 0
    )
    top_share = [np.bincount(_client_rows(fd, i)[1]).max() / fd.sizes[i] for i in range(20)]
    assert np.median(top_share) > 0.6


def test_samples_per_client_and_errors() -> None:
    fd = build_federated_dataset(
        DataConfig(dataset="digits", num_clients=10, samples_per_client=50), 0
    )
    assert fd.sizes.tolist() == [50] * 10 and fd.train_sizes.tolist() == [40] * 10
    with pytest.raises(ValueError, match="data.samples_per_client"):
        build_federated_dataset(
            DataConfig(dataset="digits", num_clients=2, samples_per_client=5000), 0
        )
    with pytest.raises(ValueError, match="data.samples_per_client"):
        build_federated_dataset(DataConfig(dataset="digits", num_clients=1000), 0)  # 1 each
    with pytest.raises(ValueError, match="data.dirichlet_alpha"):
        build_federated_dataset(
            DataConfig(dataset="synthetic_linear", num_clients=4, dirichlet_alpha=1.0), 0
        )


def test_synthetic_linear_follows_its_cluster_weights() -> None:
    cfg = DataConfig(
        dataset="synthetic_linear", num_clients=12, cluster_sizes=[2, 4, 6], dim=3, noise_std=0.0
    )
    fd = build_federated_dataset(cfg, 0)
    w, b = fd.meta["true_weights"], fd.meta["true_bias"]
    assert fd.task == "regression" and fd.num_classes == 0 and fd.feature_shape == (3,)
    assert fd.sizes.tolist() == [100] * 12 and w.shape == (3, 3)
    for i in range(12):
        x, y = _client_rows(fd, i)
        k = fd.true_cluster[i]
        np.testing.assert_allclose(y, x @ w[k] + b[k], rtol=1e-5, atol=1e-5)
    noisy = build_federated_dataset(cfg.model_copy(update={"noise_std": 0.5}), 0)
    x, y = _client_rows(noisy, 0)
    assert 0.3 < float(np.std(y - x @ w[0] - b[0])) < 0.7
    shared = build_federated_dataset(cfg.model_copy(update={"shift": "none"}), 0)
    assert np.ptp(shared.meta["true_weights"], axis=0).max() == 0


def test_separation_scales_the_weights() -> None:
    def w(sep: float) -> np.ndarray:
        cfg = DataConfig(
            dataset="synthetic_linear", num_clients=4, cluster_sizes=[2, 2], cluster_separation=sep
        )
        return build_federated_dataset(cfg, 0).meta["true_weights"]

    np.testing.assert_allclose(w(3.0), 3.0 * w(1.0), rtol=1e-6)


def test_views_are_read_only_and_pickle_once() -> None:
    fd = build_federated_dataset(DataConfig(**PAPER), 0)
    pixels = fd.client_pixels(0)
    assert pixels.dtype == np.uint8 and not pixels.flags.writeable
    assert np.shares_memory(pixels, fd.client_pixels(0))
    assert not fd.client_train(0)[1].flags.writeable
    blob = pickle.dumps(fd, protocol=5)
    assert len(blob) < 1.2 * fd.nbytes  # the views do not travel next to the table
    back = pickle.loads(blob)
    np.testing.assert_array_equal(back.client_test(3)[0], fd.client_test(3)[0])


def test_parquet_round_trip(tmp_path: Path) -> None:
    fd = build_federated_dataset(
        DataConfig(dataset="synthetic_linear", num_clients=6, cluster_sizes=[2, 4]), 0
    )
    fd.to_parquet(str(tmp_path / "pop.parquet"))
    back = FederatedDataset.from_parquet(str(tmp_path / "pop.parquet"))
    assert back.table.equals(fd.table)
    assert back.feature_shape == fd.feature_shape and back.task == fd.task
    np.testing.assert_array_equal(back.meta["true_weights"], fd.meta["true_weights"])
    np.testing.assert_array_equal(back.client_train(5)[1], fd.client_train(5)[1])


def test_describe_mentions_clusters_and_labels() -> None:
    fd = build_federated_dataset(DataConfig(**PAPER), 0)
    text = describe(fd)
    assert "21 clients in 4 clusters [3, 6, 6, 6]" in text and "minority: cluster 0" in text
    assert "68/68/68" in text and "labels" in text
    reg = build_federated_dataset(DataConfig(dataset="synthetic_linear", num_clients=3), 0)
    assert "y mean/std" in describe(reg)


def test_images_are_stored_as_pixels_and_read_with_the_loaders_bits() -> None:
    """The table holds uint8 pixels (4x smaller); a client's rows decode to exactly what the
    float32 loader path gives, rotation included."""
    cfg = DataConfig(**PAPER, shift="rotation")
    fd = build_federated_dataset(cfg, 0)
    base = load_base(cfg.dataset, None)
    rows = fd.table.column("source_index").to_numpy()
    x, y = base.x[rows].copy(), base.y[rows].copy()
    apply_shift(x, y, np.repeat(fd.true_cluster, fd.sizes), cfg.shift, base.num_classes)
    for i in range(fd.num_clients):
        lo, hi = fd.offsets[i], fd.offsets[i + 1]
        got = np.concatenate([fd.client_train(i)[0], fd.client_test(i)[0]])
        assert got.dtype == np.float32 and np.array_equal(got, x[lo:hi])
        assert np.array_equal(
            np.concatenate([fd.client_train(i)[1], fd.client_test(i)[1]]), y[lo:hi]
        )
    assert fd.table.column("x").type.value_type == pa.uint8()
    assert fd.nbytes < 0.4 * x.nbytes


def test_population_views_are_read_only_and_follow_slices() -> None:
    """The zero-copy numpy views of the Arrow columns (``_numpy_view``, which replaces pyarrow's
    ``to_numpy`` to keep pandas out) start at an array's offset and cannot be written."""
    import pyarrow as pa

    from raysim.data.federated import _numpy_view, make_table

    pixels = np.arange(6 * 4, dtype=np.uint8).reshape(6, 4)
    table = make_table(pixels, np.arange(6) * 10, np.arange(6)).slice(2, 3)
    x = _numpy_view(table.column("x").chunk(0).flatten())
    y = _numpy_view(table.column("y").chunk(0))
    np.testing.assert_array_equal(x, pixels[2:5].reshape(-1))
    np.testing.assert_array_equal(y, [20, 30, 40])
    assert not x.flags.writeable and not y.flags.writeable
    with pytest.raises(TypeError, match="cannot be viewed"):
        _numpy_view(pa.array([1, None, 3]))


def test_base_data_decodes_image_rows_on_demand() -> None:
    """An image dataset keeps its uint8 pixels; ``images(rows)`` and the whole ``x`` are the
    codec's float32 decoding of them."""
    from raysim.data.sources import PixelCodec

    base = load_base("digits", None)
    assert base.features is None and base.pixels is not None
    rows = np.array([5, 0, 17])
    expected = PixelCodec("digits").decode(base.pixels[rows])
    np.testing.assert_array_equal(base.images(rows), expected)
    np.testing.assert_array_equal(base.x[rows], expected)
    assert base.feature_shape == (1, 8, 8)
