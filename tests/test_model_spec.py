"""Models built in one place: config keys checked against the builder, seeded builds equal to the
old code path, a frozen part identical across processes, the named view, the public slice."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from raysim.config import ConfigError, DataConfig, load_config
from raysim.data import build_federated_dataset
from raysim.data.public import public_indices
from raysim.data.sources import load_digits
from raysim.engine.experiment import build_dataset, initial_weights
from raysim.models import (
    CNN,
    MLP,
    build_from_spec,
    flat_params,
    frozen_state,
    init_seed,
    model_spec,
    named_view,
    param_layout,
)
from raysim.seeding import SERVER, torch_generator


@pytest.mark.parametrize(
    "sets, message",
    [
        (["model.name=cnn", "model.hidden=32"], "model.hidden: unknown key for model 'cnn'"),
        (
            ["model.name=mlp", "model.widht=3"],
            "model.widht: unknown key for model 'mlp'; allowed: name, hidden",
        ),
        (["model.name=vit_lora", "model.rank=four"], "model.rank: "),
        (["model.name=vit_lora", "model.public=1"], "model.public: unknown key"),
        (["model.name=vgg"], "model.name: unknown model 'vgg'; allowed: cnn"),
    ],
)
def test_model_keys_are_checked_against_the_builder(sets, message):
    with pytest.raises(ConfigError, match="invalid config") as err:
        load_config(None, sets)
    assert message in str(err.value)


def test_model_keys_reach_the_builder_and_old_dumps_still_load():
    cfg = load_config(None, ["model.name=mlp", "model.hidden=16", "data.dataset=digits"])
    model = build_from_spec(model_spec(cfg), (1, 8, 8), 10, seed=0)
    assert isinstance(model, MLP) and model.fc1.out_features == 16
    # configs dumped before this change hold `hidden: 64` for every model
    old = load_config(None, ["model.name=cnn", "model.hidden=64"])
    assert old.model.model_extra == {}
    lora = load_config(None, ["model.name=vit_lora", "model.targets=[attn.q]", "model.rank=2"])
    assert model_spec(lora).kwargs["targets"] == ("attn.q",)


def test_initial_weights_are_bit_identical_to_the_old_path():
    cfg = load_config(None, ["data.dataset=digits", "data.num_clients=4", "model.name=cnn"])
    ds = build_dataset(cfg)
    seed = int(torch_generator(cfg.seed, 0, SERVER, "model_init").initial_seed())
    with torch.random.fork_rng(devices=[]):  # what experiment.initial_weights did before
        torch.manual_seed(seed)
        old = flat_params(CNN(ds.feature_shape, ds.num_classes))
    assert seed == init_seed(cfg.seed)
    assert torch.equal(initial_weights(cfg, ds), old)


def test_a_pretrained_lora_model_without_a_public_slice_is_a_config_error():
    cfg = load_config(None, ["data.dataset=digits", "data.num_clients=4", "model.name=cnn_lora"])
    with pytest.raises(ConfigError, match="data.public_pretrain_samples"):
        initial_weights(cfg, build_dataset(cfg))


def _frozen_digest(seed: int, global_seed: int) -> tuple[dict[str, bytes], bytes]:
    torch.manual_seed(global_seed)  # each "worker" has its own global RNG state
    cfg = load_config(None, ["model.name=vit_lora", "model.base=random", "data.dataset=digits"])
    model = build_from_spec(model_spec(cfg), (1, 28, 28), 10, seed=seed)
    frozen = {k: v.numpy().tobytes() for k, v in frozen_state(model).items()}
    return frozen, flat_params(model).numpy().tobytes()


def test_frozen_part_is_identical_in_separate_processes():
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        (fa, ta), (fb, tb) = pool.starmap(_frozen_digest, [(11, 1), (12, 2)], chunksize=1)
    assert len(fa) > 40 and fa == fb  # every frozen tensor, bit for bit
    assert ta != tb  # the trainable adapter follows the init seed


def test_named_view_matches_the_flat_order():
    model = CNN((1, 8, 8), 10)
    vec = flat_params(model)
    layout = param_layout(model)
    assert [s.name for s in layout] == [n for n, _ in model.named_parameters()]
    assert layout[-1].stop == vec.numel()
    views = named_view(model, vec)
    for name, p in model.named_parameters():
        assert torch.equal(views[name], p.detach())
    views["fc.bias"].fill_(7.0)  # views, not copies
    assert torch.all(vec[layout[-1].offset :] == 7.0)


def test_the_public_slice_never_reaches_a_client():
    n_public = 300
    cfg = DataConfig(
        dataset="digits", num_clients=10, cluster_sizes=[5, 5], public_pretrain_samples=n_public
    )
    ds = build_federated_dataset(cfg, seed=0)
    used = np.concatenate([ds.client_source_index(i) for i in range(ds.num_clients)])
    public = public_indices(load_digits(), n_public)
    assert public.tolist() == list(range(1797 - n_public, 1797))
    assert not np.isin(used, public).any()
    assert len(used) == (1797 - n_public) // 10 * 10  # all the rest, 149 per client
    with pytest.raises(ValueError, match="data.public_pretrain_samples"):
        build_federated_dataset(DataConfig(dataset="digits", public_pretrain_samples=1797), 0)
    # without a public slice those rows are used
    plain = build_federated_dataset(DataConfig(dataset="digits", num_clients=10), seed=0)
    plain_used = np.concatenate([plain.client_source_index(i) for i in range(10)])
    assert np.isin(plain_used, public).sum() > 200


def test_a_worker_builds_the_drivers_model():
    from raysim.runtime.worker import ClientWorker

    sets = ["data.dataset=digits", "data.num_clients=4", "model.name=vit_lora", "model.base=random"]
    cfg = load_config(None, [*sets, "model.patch=4", "model.train_head=true"])
    ds = build_dataset(cfg)
    threads = torch.get_num_threads()
    try:
        worker = ClientWorker(None, ds, model_spec(cfg), cfg.seed, 1, 0.0)
    finally:
        torch.set_num_threads(threads)
    model = worker.trainer.model
    assert torch.equal(flat_params(model), initial_weights(cfg, ds))  # seeded like the init
    other = build_from_spec(model_spec(cfg), ds.feature_shape, ds.num_classes, seed=99)
    fa, fb = frozen_state(model), frozen_state(other)
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
