"""A researcher's own data as an .npz file (raysim.data.arrays): checked against the built-in
digits loader, numpy's own statistics and the data's client ids."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import small_config

from raysim.cli.main import main
from raysim.config import ConfigError, DataConfig, load_config
from raysim.data import build_federated_dataset
from raysim.data.federated import FederatedDataset
from raysim.data.public import load_public_slice
from raysim.data.sources import load_digits
from raysim.engine.experiment import build_dataset


def _sets(**overrides: object) -> list[str]:
    return sum((["--set", s] for s in small_config(**overrides)), [])


@pytest.fixture(scope="module")
def digits_npz(tmp_path_factory):
    """digits' own standardised float images: the same population as `dataset: digits`."""
    base = load_digits()
    path = tmp_path_factory.mktemp("npz") / "digits.npz"
    np.savez(path, x=base.x, y=base.y)
    return path


def _ragged(tmp_path, rng, ids=(3, 11, 40, 41, 7)) -> tuple[str, np.ndarray, np.ndarray, int]:
    """uint8 3-channel images in the split layout: clients of 4 to 30 training rows and 2 to 10
    test rows, in shuffled order. Returns the path, every row's client id, the images and the
    number of training rows."""
    ids = np.asarray(ids)
    train = rng.permutation(np.repeat(ids, rng.integers(4, 31, size=len(ids))))
    test = rng.permutation(np.repeat(ids, rng.integers(2, 11, size=len(ids))))
    client = np.concatenate([train, test])
    x = rng.integers(0, 256, size=(len(client), 3, 8, 8), dtype=np.uint8)
    y = rng.integers(0, 4, size=len(client))
    cut = len(train)
    path = tmp_path / "ragged.npz"
    np.savez(
        path,
        x_train=x[:cut],
        y_train=y[:cut],
        client_train=train,
        x_test=x[cut:],
        y_test=y[cut:],
        client_test=test,
    )
    return str(path), client, x, cut


def test_float_arrays_give_the_built_in_loaders_population(digits_npz):
    kw = {"num_clients": 12, "cluster_sizes": [4, 4, 4], "shift": "rotation"}
    built_in = build_federated_dataset(DataConfig(dataset="digits", **kw), 3)
    mine = build_federated_dataset(DataConfig(dataset="npz", root=str(digits_npz), **kw), 3)
    assert mine.task == "classification" and mine.num_classes == 10
    for i in range(12):
        for part in ("client_train", "client_test"):
            (xa, ya), (xb, yb) = getattr(built_in, part)(i), getattr(mine, part)(i)
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_uint8_images_are_standardised_by_the_pools_own_statistics(tmp_path):
    rng = np.random.default_rng(0)
    path, client, x, _ = _ragged(tmp_path, rng)
    ds = build_federated_dataset(
        DataConfig(dataset="npz", root=path, num_clients=5, cluster_sizes=None, shift="none"), 0
    )
    x01 = x.astype(np.float64) / 255  # numpy's statistics, not the loader's histogram
    assert ds.pixels.mean == pytest.approx(tuple(x01.mean(axis=(0, 2, 3))), abs=1e-12)
    assert ds.pixels.std == pytest.approx(tuple(x01.std(axis=(0, 2, 3))), abs=1e-12)
    decoded = np.concatenate([ds.client_train(i)[0] for i in range(5)])
    decoded = np.concatenate([decoded, *(ds.client_test(i)[0] for i in range(5))])
    assert decoded.dtype == np.float32 and decoded.shape == (len(x), 3, 8, 8)
    assert np.abs(decoded.mean(axis=(0, 2, 3))).max() < 1e-5
    assert np.abs(decoded.std(axis=(0, 2, 3)) - 1).max() < 1e-5
    ds.to_parquet(str(tmp_path / "p.parquet"))  # the statistics travel with the table
    again = FederatedDataset.from_parquet(str(tmp_path / "p.parquet"))
    assert again.pixels == ds.pixels
    assert np.array_equal(again.client_train(2)[0], ds.client_train(2)[0])


def test_client_ids_give_the_natural_partition(tmp_path):
    rng = np.random.default_rng(1)
    path, client, _, cut = _ragged(tmp_path, rng)
    cfg = DataConfig(dataset="npz", root=path, num_clients=5, cluster_sizes=[2, 3])
    ds = build_federated_dataset(cfg, 0)
    ids = np.unique(client)
    for i, cid in enumerate(ids):  # client i: the i-th smallest id, its rows, the file's split
        rows = ds.client_source_index(i)
        train, test = rows[: ds.num_train[i]], rows[ds.num_train[i] :]
        assert list(train) == list(np.flatnonzero(client[:cut] == cid))
        assert list(test) == list(cut + np.flatnonzero(client[cut:] == cid))
    assert list(ds.sizes) == [int((client == c).sum()) for c in ids]
    assert list(ds.true_cluster) == [0, 0, 1, 1, 1] and ds.meta["partition"] == "natural"
    arrays = dict(np.load(path))
    only_train = arrays["client_test"] == arrays["client_test"][0]
    for key in ("x_test", "y_test", "client_test"):  # one client left without test rows
        arrays[key] = arrays[key][~only_train]
    np.savez(tmp_path / "no_test.npz", **arrays)
    with pytest.raises(ValueError, match="none in x_test; with client ids, the data's own split"):
        build_federated_dataset(cfg.model_copy(update={"root": str(tmp_path / "no_test.npz")}), 0)
    with pytest.raises(ValueError, match="data.num_clients: 5"):
        build_federated_dataset(cfg.model_copy(update={"num_clients": 6, "cluster_sizes": None}), 0)
    for key, value in (("dirichlet_alpha", 0.5), ("samples_per_client", 10)):
        with pytest.raises(ValueError, match=f"data.{key}"):
            build_federated_dataset(cfg.model_copy(update={key: value}), 0)


def test_clusters_given_per_row_are_the_clients_true_clusters(tmp_path, capsys):
    rng = np.random.default_rng(4)
    client = rng.permutation(np.repeat(np.arange(6), 10))
    truth = np.array([1, 0, 2, 1, 0, 2])  # per client id
    arrays = {"x": rng.normal(size=(60, 5)), "y": rng.integers(0, 3, 60), "client": client}
    np.savez(tmp_path / "c.npz", **arrays, cluster=truth[client])
    sets = ["data.dataset=npz", f"data.root={tmp_path / 'c.npz'}", "data.num_clients=6"]
    cfg = load_config(None, [*sets, "data.cluster_sizes=null", "data.shift=label_flip"])
    ds = build_dataset(cfg)
    assert list(ds.true_cluster) == list(truth)
    for i in range(6):  # label_flip by the file's cluster: (y + k) mod 3
        rows = ds.client_source_index(i)
        flipped = (arrays["y"][rows] + truth[i]) % 3
        train, test = ds.client_train(i)[1], ds.client_test(i)[1]
        assert np.array_equal(np.concatenate([train, test]), flipped)
    given = [*sets, "data.cluster_sizes=[2,2,2]"]
    assert main(["data", "describe", *sum((["--set", s] for s in given), [])]) == 2
    assert "data.cluster_sizes: the data gives each client's cluster" in capsys.readouterr().err
    np.savez(tmp_path / "mixed.npz", **arrays, cluster=rng.integers(0, 2, 60))
    mixed = [*sets, f"data.root={tmp_path / 'mixed.npz'}", "data.cluster_sizes=null"]
    with pytest.raises(ConfigError, match="rows of more than one cluster"):
        build_dataset(load_config(None, mixed))
    np.savez(tmp_path / "alone.npz", x=arrays["x"], y=arrays["y"], cluster=truth[client])
    with pytest.raises(ValueError, match="needs the client ids"):
        build_federated_dataset(DataConfig(dataset="npz", root=str(tmp_path / "alone.npz")), 0)


def test_the_public_slice_is_the_end_of_x_train_and_no_client_holds_it(tmp_path):
    rng = np.random.default_rng(2)
    path, client, x, cut = _ragged(tmp_path, rng)
    images, _ = load_public_slice("npz", path, 5)
    ds = build_federated_dataset(
        DataConfig(
            dataset="npz", root=path, num_clients=5, cluster_sizes=None, public_pretrain_samples=5
        ),
        0,
    )
    held = np.concatenate([ds.client_source_index(i) for i in range(5)])
    assert images.shape == (5, 3, 8, 8)
    assert set(held) == set(range(len(client))) - set(range(cut - 5, cut))


def test_float_targets_are_a_regression_task(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200, 6)).astype(np.float32)
    np.savez(tmp_path / "r.npz", x=x, y=(x @ np.arange(6.0)).astype(np.float32))
    cfg = DataConfig(
        dataset="npz", root=str(tmp_path / "r.npz"), num_clients=4, cluster_sizes=None, shift="none"
    )
    ds = build_federated_dataset(cfg, 0)
    assert (ds.task, ds.num_classes, ds.feature_shape, ds.pixels) == ("regression", 0, (6,), None)
    with pytest.raises(ValueError, match="data.shift='rotation' needs square images"):
        build_federated_dataset(cfg.model_copy(update={"shift": "rotation"}), 0)


BAD_FILES = {
    "unknown arrays": {"images": np.zeros((4, 8, 8)), "labels": np.zeros(4, int)},
    "both layouts": {"x": np.zeros((4, 2)), "y": np.zeros(4, int), "x_train": np.zeros((4, 2))},
    "looks channels-last": {"x": np.zeros((4, 8, 8, 3), np.uint8), "y": np.zeros(4, int)},
    "one value per row": {"x": np.zeros((4, 2)), "y": np.zeros(3, int)},
    "NaN or infinite": {"x": np.full((4, 2), np.nan), "y": np.zeros(4, int)},
    "class labels must be 0": {"x": np.zeros((4, 2)), "y": -np.ones(4, int)},
    "num_classes must be": {"x": np.zeros((4, 2)), "y": np.arange(4), "num_classes": 3},
    "one integer id per row": {"x": np.zeros((4, 2)), "y": np.zeros(4, int), "client": np.zeros(4)},
}


@pytest.mark.parametrize("message", BAD_FILES)
def test_a_bad_file_stops_the_command_naming_data_root(message, tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", **BAD_FILES[message])
    out = tmp_path / "out"
    sets = _sets(**{"data.dataset": "npz", "data.root": str(tmp_path / "bad.npz")})
    assert main(["run", "--out", str(out), *sets, "--set", "data.shift=none"]) == 2
    err = capsys.readouterr().err
    assert "data.root" in err and message in err and "Traceback" not in err
    assert not out.exists()


def test_a_missing_or_unreadable_file_is_a_config_error(tmp_path):
    (tmp_path / "not.npz").write_text("not a zip")
    with pytest.raises(ValueError, match="data.root: dataset npz reads"):
        DataConfig(dataset="npz")
    with pytest.raises(ValueError, match="is a directory, not a file"):
        DataConfig(dataset="npz", root=str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        DataConfig(dataset="npz", root=str(tmp_path / "none.npz"))
    cfg = load_config(None, ["data.dataset=npz", f"data.root={tmp_path / 'not.npz'}"])
    with pytest.raises(ConfigError, match="not a readable .npz file"):
        build_dataset(cfg)


def test_a_run_on_the_file_has_the_built_in_datasets_metrics(ray_session, digits_npz, tmp_path):
    """The whole run on Ray: the same population gives the same rounds, to the bit."""
    runs = {}
    for name, extra in (("digits", []), ("npz", ["data.dataset=npz", f"data.root={digits_npz}"])):
        out = tmp_path / name
        argv = ["run", "--out", str(out), *_sets(), *sum((["--set", s] for s in extra), [])]
        assert main(argv) == 0
        runs[name] = pq.read_table(out / "metrics.parquet").to_pandas()
    cols = ["round", "accuracy", "loss", "epsilon"]
    assert runs["digits"][cols].equals(runs["npz"][cols])


def test_an_exported_population_reads_back_as_the_same_population_and_run(ray_session, tmp_path):
    """`raysim data export`: the same clients, rows, split and clusters, and the same run."""
    sets = _sets(**{"data.cluster_sizes": "[3, 5]"})
    assert main(["data", "export", "--out", str(tmp_path / "pop.npz"), *sets]) == 0
    back = [
        "data.dataset=npz",
        f"data.root={tmp_path / 'pop.npz'}",
        "data.cluster_sizes=null",
        "data.shift=none",
    ]
    sets_back = [*sets, *sum((["--set", s] for s in back), [])]
    original = build_dataset(load_config(None, sets[1::2]))
    again = build_dataset(load_config(None, sets_back[1::2]))
    assert list(again.true_cluster) == list(original.true_cluster) == [0] * 3 + [1] * 5
    for i in range(8):
        for part in ("client_train", "client_test"):
            (xa, ya), (xb, yb) = getattr(original, part)(i), getattr(again, part)(i)
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    metrics = []
    for name, argv in (("original", sets), ("exported", sets_back)):
        assert main(["run", "--out", str(tmp_path / name), *argv]) == 0
        metrics.append(pq.read_table(tmp_path / name / "metrics.parquet").to_pandas())
    cols = ["round", "accuracy", "loss", "epsilon", "accuracy_cluster_0", "accuracy_cluster_1"]
    assert metrics[0][cols].equals(metrics[1][cols])


def test_export_refuses_a_path_that_is_not_an_npz_file(tmp_path, capsys):
    assert main(["data", "export", "--out", str(tmp_path / "pop.csv")]) == 2
    assert main(["data", "export", "--out", str(tmp_path / "no" / "pop.npz")]) == 2
    err = capsys.readouterr().err
    assert "--out: an .npz file" in err and "does not exist" in err


def test_a_full_disk_fails_the_export_by_its_name_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    """A failure of the export (here, the disk full) says what failed (not "run failed"),
    exits 1, and leaves neither the target nor a partial file."""
    import errno

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    assert main(["data", "export", "--out", str(tmp_path / "pop.npz")]) == 1
    err = capsys.readouterr().err
    assert "raysim: data export failed:" in err and "No space left" in err, err
    assert list(tmp_path.iterdir()) == []
