"""The black-box audit's input-space canaries (``sample``, and ``none``, where it shows the leak):
each a seeded random input with a seeded label (mislabelled: nothing in the data predicts it),
included with probability 1/2 (seeded by (seed, canary, purpose)) in the train set of a client
(spread over the clients, round robin over a seeded order); each scored by minus the loss of its
label under the final model its client is judged on (the model the server would hand it: the
released model). The claim is the largest epsilon the run's own ledger charged any client: each
canary is one example of one client, so each is protected at least that well."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from raysim.audit.training import (
    CLAIM_NOTE,
    Trained,
    claimed_epsilon,
    on_judged_models,
    run_rounds,
    start_loop,
)
from raysim.config import ConfigError
from raysim.data.federated import FederatedDataset, make_table
from raysim.data.sources import PIXEL_SCALE
from raysim.seeding import SERVER, numpy_rng

VIEW = "final models (black-box: the model each canary's client is judged on)"
CANARIES = 500  # default canaries, capped at half the population's train rows


def default_canaries(ds: FederatedDataset) -> int:
    return int(min(CANARIES, int(np.sum(ds.train_sizes)) // 2))


def canary_inputs(ds: FederatedDataset, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``m`` random inputs as the population stores them (uint8 pixels or float32 features),
    each with a random label: mislabelled examples, memorised only where they were trained on."""
    if ds.task != "classification":
        raise ConfigError(
            f"data.dataset: the black-box audit's canaries are mislabelled examples; "
            f"{ds.dataset} is a {ds.task} task"
        )
    rng = numpy_rng(seed, 0, SERVER, "audit_canary_inputs")
    shape = (m, *ds.feature_shape)
    if ds.pixels is not None:
        top = ds.pixels.scale or PIXEL_SCALE[ds.pixels.dataset]
        # black-and-white noise: the largest spread the pixels allow, so the most to memorise
        x = (rng.integers(0, 2, size=shape) * int(top)).astype(np.uint8)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, ds.num_classes, size=m)
    return x, y


def owners(m: int, num_clients: int, seed: int) -> np.ndarray:
    """The client whose train set each canary joins: round robin over a seeded order, so every
    client holds m / num_clients of them (within one)."""
    order = numpy_rng(seed, 0, SERVER, "audit_canary_clients").permutation(m)
    out = np.empty(m, dtype=np.int64)
    out[order] = np.arange(m) % num_clients
    return out


def with_canaries(
    ds: FederatedDataset, x: np.ndarray, y: np.ndarray, included: np.ndarray, owner: np.ndarray
) -> FederatedDataset:
    """The population with each included canary appended to its owner's train rows."""
    raw_x = ds._x  # as stored: the canaries join in the same encoding
    raw_y = np.asarray(ds._y)
    source = ds.table.column("source_index").chunk(0).to_numpy(zero_copy_only=False)
    xs, ys, srcs, offsets, num_train = [], [], [], [0], []
    for c in range(ds.num_clients):
        lo, hi, n = ds.offsets[c], ds.offsets[c + 1], ds.num_train[c]
        mine = np.flatnonzero(included & (owner == c))
        xs += [raw_x[lo : lo + n], x[mine], raw_x[lo + n : hi]]
        ys += [raw_y[lo : lo + n], y[mine].astype(raw_y.dtype), raw_y[lo + n : hi]]
        srcs += [source[lo : lo + n], -1 - mine, source[lo + n : hi]]
        num_train.append(n + len(mine))
        offsets.append(offsets[-1] + (hi - lo) + len(mine))
    table = make_table(np.concatenate(xs), np.concatenate(ys), np.concatenate(srcs))
    return FederatedDataset(
        table=table,
        offsets=np.asarray(offsets),
        num_train=np.asarray(num_train),
        true_cluster=ds.true_cluster,
        feature_shape=ds.feature_shape,
        num_classes=ds.num_classes,
        task=ds.task,
        dataset=ds.dataset,
        meta=dict(ds.meta),
        pixels=ds.pixels,
    )


def final_scores(
    prep: Any, loop: Any, x: np.ndarray, y: np.ndarray, owner: np.ndarray
) -> np.ndarray:
    """Minus each canary's loss under the final model its client is judged on (a client that
    picks its model: the best of the released models), from the models alone."""
    import torch

    from raysim.models import build_from_spec, load_flat_

    ds = prep.dataset
    plan = prep.algorithm.plan_evaluation(loop.state)
    models = [m.detach().to("cpu", torch.float32) for m in plan.models]
    net = build_from_spec(prep.spec, ds.feature_shape, ds.num_classes)
    inputs = torch.from_numpy(ds.pixels.decode(x) if ds.pixels is not None else x)
    target = torch.as_tensor(y, dtype=torch.int64)
    losses = []
    with torch.no_grad():
        for weights in models:
            load_flat_(net, weights)
            net.eval()
            out = net(inputs)
            losses.append(torch.nn.functional.cross_entropy(out, target, reduction="none"))
    by_model = -torch.stack(losses).double().numpy() if losses else np.zeros((0, len(y)))
    return on_judged_models(prep, plan, by_model, owner)


class InputCanaries:
    """``sample``, ``none``: ``m`` mislabelled inputs, each joining its owner's train rows where
    included; ``train`` runs one training with those included and scores every canary."""

    view = VIEW
    note = CLAIM_NOTE

    def __init__(
        self, base: FederatedDataset, m: int, seed: int, prepare: Callable[..., Any]
    ) -> None:
        self.base, self.prepare, self.m = base, prepare, m
        self.x, self.y = canary_inputs(base, m, seed)
        self.owner = owners(m, base.num_clients, seed)

    def train(
        self, cfg: Any, included: np.ndarray, progress: Callable[[int], None] | None
    ) -> Trained:
        ds = with_canaries(self.base, self.x, self.y, included, self.owner)
        prep = self.prepare(cfg, ds)
        loop = run_rounds(start_loop(prep), prep.cfg.rounds, progress)
        scores = final_scores(prep, loop, self.x, self.y, self.owner)
        return Trained(scores, claimed_epsilon(prep, loop), prep, self.owner)
