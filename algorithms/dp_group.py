"""Group privacy for personalized FL (Galli et al., Algorithm 1): IFCA-style clients that sanitize
their parameters with d-privacy, and a server that clusters the sanitized parameters.

Round t: U sampled clients each pick the hypothesis with the lowest loss on their data
(argmin_j F_c(theta_j), exact: the choice is revealed by design), run local SGD from it and
release theta_hat = theta_j + (delta + rho) with rho ~ L_eps, eps = n / (nu ||delta||)
(the ``dprivacy`` mode). The server runs k-means on the released
parameter vectors, initialised at the current k hypotheses (n_init = 1, line 9), and sets each
hypothesis to its members' mean (line 10); an empty cluster keeps its hypothesis. Ablation
``server_clustering: client_choice``: the clients' own choices group the vectors (IFCA on
sanitized vectors).

Initial hypotheses: ``init: gaussian`` draws them from N(0, I) (App. B.1), ``model`` from the
model's own initialisation (IFCA's random_models).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from algorithms.clustered import ClusterState, random_models
from algorithms.ifca import IFCA, IFCAParams
from raysim.protocol import Message, RoundPlan, ServerResult


class DPGroupParams(IFCAParams):
    select_by: Literal["loss", "accuracy"] = "loss"  # argmin_j F_c(theta_j)
    loss_clip: float = Field(1e12, gt=0)  # regression losses are unbounded: no clipping
    server_clustering: Literal["kmeans", "client_choice"] = "kmeans"
    init: Literal["gaussian", "model"] = "gaussian"
    init_std: float = Field(1.0, gt=0)


def kmeans_from(points: np.ndarray, centres: np.ndarray, max_iter: int = 300) -> np.ndarray:
    """Lloyd's k-means started at ``centres`` (one init, Algorithm 1 line 9). Written out rather
    than sklearn's KMeans, which moves a centre that lost all its points to a far point: here it
    stays put, as an empty cluster keeps its hypothesis (line 10)."""
    c = np.asarray(centres, dtype=np.float64).copy()
    labels = np.zeros(len(points), dtype=np.int64)
    for _ in range(max_iter):
        labels = np.argmin(((points[:, None, :] - c[None]) ** 2).sum(-1), axis=1)
        new = c.copy()
        for j in range(len(c)):
            if (labels == j).any():
                new[j] = points[labels == j].mean(0)
        if np.array_equal(new, c):
            break
        c = new
    return labels


class DPGroup(IFCA):
    name = "dp_group"
    Params = DPGroupParams
    privacy_modes = ("none", "dprivacy")
    default_clusters = 2  # the paper's synthetic experiment
    moves_models = False  # a model is the mean of its released points

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        m, dim = self.num_clusters(), self.env.init_weights.numel()
        if self.params.init == "gaussian":
            draws = rng.normal(0.0, self.params.init_std, size=(m, dim))
            models = [torch.tensor(d, dtype=torch.float32) for d in draws]
        else:
            models = random_models(self.env, m, int(rng.integers(2**31 - 1)))
        return ClusterState(models)

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: list[Message],
        rng: np.random.Generator,
    ) -> ServerResult:
        released = [r for r in reports if r.update is not None and r.cluster is not None]
        models = list(state.models)
        if released:
            # the released parameter vectors theta_hat = theta_j + sanitized move
            points = torch.stack([state.models[r.cluster] + r.update for r in released])
            if self.params.server_clustering == "kmeans":
                centres = torch.stack(state.models).double().numpy()
                groups = kmeans_from(points.double().numpy(), centres)
            else:
                groups = np.array([r.cluster for r in released])
            for j in range(len(models)):
                members = points[torch.from_numpy(groups == j)]
                if len(members):
                    models[j] = members.double().mean(0).float()
        assigned = self.updated_assignments(state, reports)
        metrics = self.cluster_metrics(assigned, len(models))
        return ServerResult(ClusterState(models, assigned, state.info), metrics)

    def evaluates_by_choice(self, state: ClusterState) -> bool:
        """Every judged client takes the hypothesis with the lowest loss on its own data, as
        the paper's validation users do (App. B.1, B.3): the server's record of last choices
        has none for a client never sampled (``training.held_out_clients``: none ever is)."""
        return True
