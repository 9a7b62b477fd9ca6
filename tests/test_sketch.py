"""private_sketch as PINA's stage 1 needs it: default k = 64, one public projection per round
shared by all clients, and sketches of LoRA-sized updates that still separate the clusters."""

from __future__ import annotations

import numpy as np
from sklearn.cluster import KMeans
from sklearn.metrics import adjusted_rand_score

from raysim.privacy import SKETCH_DIM, private_sketch
from raysim.seeding import numpy_rng, public_seed

D = 4096  # the default vit_lora adapter


def _two_clusters(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((2, D))
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    labels = np.repeat([0, 1], n // 2)
    return centers[labels] + 0.02 * rng.standard_normal((n, D)), labels


def test_the_projection_is_public_per_round_and_shared_by_clients():
    assert SKETCH_DIM == 64
    s = public_seed(0, 3, "sketch_projection")
    assert s == public_seed(0, 3, "sketch_projection")
    assert (
        len({s, public_seed(0, 4, "sketch_projection"), public_seed(1, 3, "sketch_projection")})
        == 3
    )
    update = np.random.default_rng(0).standard_normal(D)
    # two clients (own noise streams, zero noise here) sketch the same update identically
    a = private_sketch(update, SKETCH_DIM, s, 10.0, 0.0, numpy_rng(0, 3, 0, "sketch"))
    b = private_sketch(update, SKETCH_DIM, s, 10.0, 0.0, numpy_rng(0, 3, 1, "sketch"))
    assert a.shape == (64,) and np.array_equal(a, b)
    other = public_seed(0, 4, "sketch_projection")
    assert not np.allclose(
        a, private_sketch(update, SKETCH_DIM, other, 10.0, 0.0, numpy_rng(0, 4, 0, "s"))
    )


def test_sketches_of_lora_sized_updates_keep_two_clusters_apart():
    updates, labels = _two_clusters(200, seed=1)
    seed = public_seed(0, 1, "sketch_projection")
    ari = {}
    for z in (0.0, 0.1, 0.3):
        sketches = np.stack(
            [
                private_sketch(u, SKETCH_DIM, seed, 1.0, z, numpy_rng(0, 1, c, "sketch"))
                for c, u in enumerate(updates)
            ]
        )
        pred = KMeans(2, n_init=10, random_state=0).fit_predict(sketches)
        ari[z] = adjusted_rand_score(labels, pred)
    assert ari[0.0] == 1.0 and ari[0.1] >= 0.95
    assert ari[0.3] < 0.9  # the noise does matter: this is not a test that cannot fail
