from __future__ import annotations

import numpy as np
import pytest

from raysim.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 3\ndata:\n  dataset: digits\n  num_clients: 21\n")
    cfg = load_config(path, ["data.cluster_sizes=[3, 6, 6, 6]", "privacy.epsilon=2", "seed=7"])
    assert cfg.rounds == 3 and cfg.seed == 7
    assert cfg.data.cluster_sizes == [3, 6, 6, 6] and cfg.data.num_clusters == 4
    assert cfg.privacy.epsilon == 2.0


def test_algorithm_parameters_pass_through():
    cfg = load_config(None, ["algorithm.name=rr_cluster", "algorithm.B=8"])
    assert cfg.algorithm.model_extra == {"B": 8}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("data.dataset=cifar100", "data.dataset"),
        ("privacy.epsilon=0", "privacy.epsilon"),
        ("privacy.epsilon=-1", "privacy.epsilon"),
        ("privacy.delta=1.5", "privacy.delta"),
        ("privacy.delta=0", "privacy.delta"),
        ("training.sampling_rate=0", "training.sampling_rate"),
        ("training.sampling_rate=1.5", "training.sampling_rate"),
        ("rounds=0", "rounds"),
        ("data.num_clients=-3", "data.num_clients"),
        ("runtime.gpus_per_worker=1.5", "runtime.gpus_per_worker"),
        ("runtime.gpus_per_worker=0", "runtime.gpus_per_worker"),
        ("data.shift=flip", "data.shift"),
        ("data.root=/nonexistent/dir", "data.root"),
        ("training.bogus=1", "training.bogus"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value)


def test_cluster_sizes_must_add_up():
    with pytest.raises(ConfigError, match="cluster_sizes"):
        load_config(None, ["data.num_clients=20", "data.cluster_sizes=[3,6,6,6]"])


def test_client_level_delta_bound():
    with pytest.raises(ConfigError, match="privacy.delta"):
        load_config(None, ["privacy.mode=client", "data.num_clients=100", "privacy.delta=0.05"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rounds=true", "rounds: must be a whole number (got true)"),
        ("training.lr=false", "training.lr: must be a number (got false)"),
        ("privacy.epsilon=true", "privacy.epsilon: must be a number (got true)"),
        ("runtime.client_group_size=true", "must be a whole number or 'auto' (got true)"),
        ("algorithm.num_clusters=true", "algorithm.num_clusters: must be a whole number"),
        ("privacy.epsilon=.inf", "privacy.epsilon: must be a finite number"),
        ("training.lr=nan", "training.lr: must be a finite number"),
        ("rounds=", "rounds: must be a whole number (got None)"),
    ],
)
def test_values_that_are_not_the_number_asked_for_are_refused(override, message):
    # pydantic's lax mode would read true and false as 1 and 0
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert load_config(None, ["runtime.vectorize=false"]).runtime.vectorize is False


def test_algorithm_and_model_keys_refuse_booleans_too():
    from algorithms.fedprox import FedProxParams
    from raysim.models.spec import check_model_kwargs

    with pytest.raises(ValueError, match="must be a number"):
        FedProxParams(mu=True)
    with pytest.raises(ValueError, match="model.hidden: must be a whole number .got true."):
        check_model_kwargs("mlp", {"hidden": True})


@pytest.mark.parametrize("item", ["=3", "a..b=3", ".x=1", "x.=1"])
def test_set_needs_a_whole_dotted_key(item):
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(None, [item])


def test_more_cluster_models_than_clients_is_refused():
    from test_rdpcfl import env_for

    from algorithms.ifca import IFCA

    with pytest.raises(ConfigError, match=r"algorithm.num_clusters=6 is more than the 5 clients"):
        IFCA(env_for("algorithm.num_clusters=6", sizes=(2, 3)))
    state = IFCA(env_for("algorithm.num_clusters=5", sizes=(2, 3))).init_state(
        np.random.default_rng(0)
    )
    assert len(state.models) == 5


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 2\nseed: 1\nrounds: 3\n")  # YAML would keep the last silently
    with pytest.raises(ConfigError, match="key 'rounds' is given twice"):
        load_config(path)
