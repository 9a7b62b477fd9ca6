"""Federated algorithms by the names configs use (`algorithm.name`)."""

from __future__ import annotations

from algorithms.base import Algorithm, Environment
from algorithms.dp_group import DPGroup
from algorithms.fedavg import FedAvg
from algorithms.fedper import FedPer
from algorithms.fedprox import FedProx
from algorithms.ifca import IFCA
from algorithms.kmeans_cfl import KMeansCFL
from algorithms.local import Local
from algorithms.mr_mtl import MRMTL
from algorithms.oracle import Oracle
from algorithms.pina import PINA, KMeansSketchCFL
from algorithms.rdpcfl import RDPCFL
from algorithms.rr_cluster import RRCluster
from raysim.config import ConfigError, did_you_mean, import_named

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        Local,
        RDPCFL,
        IFCA,
        KMeansCFL,
        MRMTL,
        Oracle,
        RRCluster,
        FedProx,
        FedPer,
        DPGroup,
        PINA,
        KMeansSketchCFL,
    )
}


def get_algorithm(name: str) -> type[Algorithm]:
    """A registered algorithm, or ``module:Class`` for one of your own (docs/architecture.md)."""
    if ":" in name:
        return _import_algorithm(name)
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"algorithm.name: unknown algorithm {name!r}; allowed: {', '.join(sorted(ALGORITHMS))}"
            " or module:Class" + did_you_mean(name, ALGORITHMS)
        ) from None


def _import_algorithm(path: str) -> type[Algorithm]:
    cls = import_named(path, "algorithm.name")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(f"algorithm.name: {path!r} is not an Algorithm subclass")
    return cls


__all__ = ["ALGORITHMS", "Algorithm", "Environment", "get_algorithm"]
