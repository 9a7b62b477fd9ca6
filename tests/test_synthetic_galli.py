"""synthetic_linear with given true weights, uniform label noise and inputs (Galli et al. §4),
and the bias-free linear model (n = dim parameters)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from scipy import stats

from raysim.config import ConfigError, DataConfig, load_config
from raysim.data.federated import build_federated_dataset
from raysim.data.synthetic import make_synthetic_linear
from raysim.models import build_model, model_spec, num_params

GALLI = {"true_weights": [[5.0, 6.0], [4.0, -4.5]], "label_noise": "uniform"}

# sha256 prefixes of (x, y, w, b) drawn by the code before these options existed (clusters
# [0, 1, 1, 0, 2], seed 7): the defaults must keep drawing exactly these numbers.
PINNED = [
    ({}, "ef7eb73e1effda6a"),
    ({"dim": 2, "noise_std": 0.5, "cluster_separation": 3.0, "samples_per_client": 10},
     "15826616da6fcead"),
    ({"shift": "none", "dim": 3}, "3da12b677dad2149"),
]  # fmt: skip


@pytest.mark.parametrize(("kw", "digest"), PINNED)
def test_defaults_draw_the_same_bits_as_before(kw, digest) -> None:
    s = make_synthetic_linear(np.array([0, 1, 1, 0, 2]), DataConfig(**kw), 7)
    raw = s.data.x.tobytes() + s.data.y.tobytes() + s.weights.tobytes() + s.bias.tobytes()
    assert hashlib.sha256(raw).hexdigest()[:16] == digest


def _galli(**kw) -> DataConfig:
    base = dict(dataset="synthetic_linear", num_clients=100, cluster_sizes=[50, 50])
    return DataConfig(**{**base, **GALLI, **kw})


def test_given_weights_and_uniform_noise() -> None:
    cfg = _galli(samples_per_client=40)
    assert cfg.dim == 2  # taken from the rows
    clusters = np.repeat([0, 1], 50)
    s = make_synthetic_linear(clusters, cfg, 3)
    np.testing.assert_array_equal(s.weights, np.float32([[5, 6], [4, -4.5]]))
    np.testing.assert_array_equal(s.bias, [0, 0])
    rows = np.repeat(clusters, 40)
    u = s.data.y - np.einsum("nd,nd->n", s.data.x, s.weights[rows])
    assert u.min() >= -1e-5 and u.max() < 1 + 1e-5
    assert stats.kstest(u, stats.uniform(0, 1).cdf).pvalue > 1e-3
    assert stats.kstest(s.data.x.reshape(-1), stats.norm.cdf).pvalue > 1e-3
    # least squares without intercept recovers each optimum (E[x] = 0: u's mean adds no slope)
    for k, theta in enumerate(([5, 6], [4, -4.5])):
        sel = rows == k
        fit = np.linalg.lstsq(s.data.x[sel], s.data.y[sel], rcond=None)[0]
        np.testing.assert_allclose(fit, theta, atol=0.05)


def test_uniform_inputs_and_bias() -> None:
    cfg = _galli(input_dist="uniform", true_bias=[1.0, -2.0], label_noise="gaussian", noise_std=0)
    s = make_synthetic_linear(np.repeat([0, 1], 50), cfg, 0)
    x = s.data.x.reshape(-1)
    assert x.min() >= -1 and x.max() <= 1
    assert stats.kstest(x, stats.uniform(-1, 2).cdf).pvalue > 1e-3
    rows = np.repeat([0, 1], 50 * 100)  # 50 clients each, default 100 samples per client
    expect = np.einsum("nd,nd->n", s.data.x, s.weights[rows]) + np.float32([1, -2])[rows]
    np.testing.assert_allclose(s.data.y, expect, atol=1e-5)


def test_shift_none_copies_cluster_zero_of_given_weights() -> None:
    s = make_synthetic_linear(np.repeat([0, 1], 50), _galli(shift="none"), 0)
    np.testing.assert_array_equal(s.weights, np.float32([[5, 6], [5, 6]]))


def test_federated_dataset_carries_the_given_weights() -> None:
    ds = build_federated_dataset(_galli(samples_per_client=10), 0)
    np.testing.assert_array_equal(ds.meta["true_weights"], np.float32([[5, 6], [4, -4.5]]))
    assert ds.feature_shape == (2,) and ds.num_classes == 0


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["data.true_weights=[[5, 6]]"], "true_weights must be 2 row(s)"),
        (["data.true_weights=[[5, 6], [4]]"], "true_weights must be 2 row(s)"),
        (["data.true_weights=[[5, 6], [4, 3]]", "data.dim=3"], "dim=3"),
        (["data.true_bias=[1, 2]"], "true_bias needs true_weights"),
        (["data.true_weights=[[5, 6], [4, 3]]", "data.true_bias=[1]"], "true_bias must be 2"),
        (["data.label_noise=laplace"], "data.label_noise"),
        (["data.input_dist=cauchy"], "data.input_dist"),
        (["model.bias=maybe"], "model.bias"),
    ],
)
def test_bad_synthetic_options_name_the_field(sets, needle) -> None:
    base = ["data.dataset=synthetic_linear", "data.num_clients=4", "data.cluster_sizes=[2, 2]"]
    with pytest.raises(ConfigError) as err:
        load_config(None, base + sets)
    assert needle in str(err.value)


def test_linear_without_bias_has_dim_parameters() -> None:
    cfg = load_config(None, ["model.name=linear", "model.bias=false"])
    assert model_spec(cfg).kwargs == {"bias": False}
    model = build_model("linear", (2,), 0, seed=0, **model_spec(cfg).kwargs)
    assert num_params(model) == 2 and model.fc.bias is None
    assert num_params(build_model("linear", (2,), 0, seed=0)) == 3  # default keeps the bias
    assert model_spec(load_config(None, ["model.name=mlp", "model.hidden=8"])).kwargs == {
        "hidden": 8
    }
    assert model_spec(load_config(None, ["model.name=cnn"])).kwargs == {}
