"""The population crosses Ray once and is read in place (zero-copy) from the object store."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from raysim.config import DataConfig
from raysim.data import FederatedDataset, build_federated_dataset

ray = pytest.importorskip("ray")
ON_LINUX = Path("/proc/self/maps").exists()  # where a mapping has a name to check


@pytest.fixture(scope="module")
def local_ray(ray_session) -> Iterator[None]:
    # workers cannot import this test module: ship its helpers by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield


def _mapping_of(address: int) -> str:
    """The /proc/self/maps line holding ``address`` ('' where /proc is unavailable)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return ""
    for line in maps.read_text().splitlines():
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= address < hi:
            return line
    return ""


def _probe(fd: FederatedDataset) -> tuple[int, bool, float, str]:
    """Where the last client's stored rows live (its uint8 pixels, for an image dataset)."""
    x = fd.client_pixels(fd.num_clients - 1)
    if x is None:
        x, _ = fd.client_train(fd.num_clients - 1)
    return x.ctypes.data, bool(x.flags.writeable), float(x.sum()), _mapping_of(x.ctypes.data)


def test_put_once_read_in_place(local_ray: None) -> None:
    fd = build_federated_dataset(
        DataConfig(dataset="digits", num_clients=21, cluster_sizes=[3, 6, 6, 6]), 0
    )
    ref = ray.put(fd)

    # driver: two gets map the same object-store bytes, nothing is copied out
    a, b = ray.get(ref, timeout=60), ray.get(ref, timeout=60)
    pa_, pb = _probe(a), _probe(b)
    assert pa_[0] == pb[0]
    assert not pa_[1]
    assert "plasma" in pa_[3] or not ON_LINUX, pa_[3]
    np.testing.assert_array_equal(a.client_test(2)[0], fd.client_test(2)[0])

    # worker: the same, and the data it reads is the data we put
    probe = ray.remote(num_cpus=1)(_probe)
    w1, w2 = ray.get([probe.remote(ref), probe.remote(ref)], timeout=120)
    assert not w1[1] and not w2[1]
    assert w1[2] == pytest.approx(_probe(fd)[2])
    assert "plasma" in w1[3] or not ON_LINUX, w1[3]
