"""What RR-Cluster (``algorithms.rr_cluster``) asks of the clustering algorithm it runs over,
``algorithm.base``: how a sampled client chooses its cluster and trains, whether the cohort may
choose first and then train as one vectorized group, and how the server moves the cluster models
from the groups RR-Cluster formed. RR-Cluster keeps the rest: the round plan, the identifiers'
release, the rebalancing, the sensitivity of rebalanced groups and the diagnostics.

One implementation per base, in the base's own module: ``algorithms.ifca.LossChoice``,
``algorithms.fesem.NearestCentre``, ``algorithms.fedcam.AdditiveMoves``. RR-Cluster picks one
once, when it is built, and reaches the base only through it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from raysim.privacy.view import Reports
from raysim.protocol import ClientContext, ClientReport, ClientTask

if TYPE_CHECKING:
    from algorithms.clustered import ClusterState
    from algorithms.rr_cluster import RRCluster


class ClusterBase(ABC):
    """One base of RR-Cluster, bound to the RR-Cluster instance that runs it (``rr``)."""

    name: ClassVar[str]  # the value of ``algorithm.base`` that picks it
    # whether the cohort may choose first (``rr.choose``), then train as one vectorized group
    trains_in_groups: ClassVar[bool] = True

    def __init__(self, rr: RRCluster) -> None:
        self.rr = rr

    def check(self) -> None:  # noqa: B027 (a hook: most bases run every config)
        """Refuse (ConfigError) a config this base cannot run; called once, at build time."""

    @abstractmethod
    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        """One sampled client: its choice (where the task lets it choose), its training and its
        report, released through ``ctx.release``."""

    def sum_sensitivity(self, cluster: float) -> float:
        """The sensitivity the round's model sums are drawn at, given that of the k rebalanced
        cluster sums: those alone, unless the base releases more sums beside them."""
        return cluster

    @abstractmethod
    def move(
        self,
        state: ClusterState,
        reports: Reports,
        groups: np.ndarray,
        rng: np.random.Generator,
        counts: np.ndarray | None,
    ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The cluster models after the round, each group (``groups``: the rebalanced cluster of
        every report; ``counts``: the released noisy counts under ``identifiers=histogram``)
        released through the view; and what the base keeps in ``state.info`` beside them."""
