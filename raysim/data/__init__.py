"""Data layer: base datasets, federated partitioning and the zero-copy population container."""

from raysim.data.describe import describe
from raysim.data.federated import FederatedDataset, build_federated_dataset, build_population
from raysim.data.lazy import LazyPopulation
from raysim.data.load import load_base
from raysim.data.partition import (
    allocate_dirichlet,
    allocate_iid,
    apply_shift,
    cluster_assignment,
    sizes_from_ratios,
    split_train_test,
)
from raysim.data.sources import BaseData, DataNotFoundError
from raysim.data.synthetic import make_synthetic_linear

Population = FederatedDataset | LazyPopulation  # the same rows, built whole or per client

__all__ = [
    "BaseData",
    "DataNotFoundError",
    "FederatedDataset",
    "LazyPopulation",
    "Population",
    "allocate_dirichlet",
    "allocate_iid",
    "apply_shift",
    "build_federated_dataset",
    "build_population",
    "cluster_assignment",
    "describe",
    "load_base",
    "make_synthetic_linear",
    "sizes_from_ratios",
    "split_train_test",
]
