"""The server's weighted mean, against numpy's float64 average (an independent implementation)."""

from __future__ import annotations

import numpy as np
import torch

from raysim.server.aggregation import weighted_mean


def test_weighted_mean_matches_numpy_and_leaves_its_inputs_alone() -> None:
    rng = np.random.default_rng(0)
    updates = [torch.from_numpy(rng.normal(size=1000).astype(np.float32)) for _ in range(7)]
    before = [u.clone() for u in updates]
    weights = [60, 1, 17, 60, 3, 0, 42]
    got = weighted_mean(updates, weights)
    want = np.average(np.stack([u.double().numpy() for u in updates]), axis=0, weights=weights)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(u, b) for u, b in zip(updates, before, strict=True))  # scaled a copy
    # float64 updates (stack copies them too): the caller's tensors stay as they were
    doubles = [u.double() for u in updates]
    weighted_mean(doubles, weights)
    assert all(torch.equal(d.float(), b) for d, b in zip(doubles, before, strict=True))
