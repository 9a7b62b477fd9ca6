"""Federated algorithms by the names configs use (`algorithm.name`)."""

from __future__ import annotations

from algorithms.base import Algorithm, Environment
from algorithms.fedavg import FedAvg
from algorithms.fedper import FedPer
from algorithms.fedprox import FedProx
from algorithms.ifca import IFCA
from algorithms.kmeans_cfl import KMeansCFL
from algorithms.local import Local
from algorithms.mr_mtl import MRMTL
from algorithms.oracle import Oracle
from algorithms.rdpcfl import RDPCFL
from algorithms.rr_cluster import RRCluster
from raysim.config import ConfigError, did_you_mean

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (FedAvg, Local, RDPCFL, IFCA, KMeansCFL, MRMTL, Oracle, RRCluster, FedProx, FedPer)
}


def get_algorithm(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"algorithm.name: unknown algorithm {name!r}; allowed: {', '.join(sorted(ALGORITHMS))}"
            + did_you_mean(name, ALGORITHMS)
        ) from None


__all__ = ["ALGORITHMS", "Algorithm", "Environment", "get_algorithm"]
