"""R-DPCFL (Malekmohammadi et al., Differentially Private Clustered FL, Algorithm 1): robust
sample-level DP clustered FL in three stages.

1. Round 1: every client runs DP-SGD from the initial model with a full batch (b1 = N_i, one
   step per local epoch; the trainer accumulates physical chunks so memory stays bounded). The
   server fits a spherical GMM on these updates (raysim.server.clustering), reads its confidence MSS
   and uncertainty MPO = 2Q(MSS), sets E_c = floor((1 - MPO) E / 2) and, when
   ``algorithm.num_clusters`` is not given, M = argmax MSS over ``num_clusters_candidates``.
   M is chosen on the updates' signal directions (``select_projection="pca"``), the clients
   are then clustered by a GMM with that M in full dimension (``projection="none"``, the
   paper). Why: the paper's argument for argmax MSS (appendix F.2) is that a fit with too few
   components merges clusters into one wide component. In p ~ 3e4 dimensions with 21 points
   the DP noise spread (p sigma^2) dwarfs the distance between merged clusters, so a merged
   component is barely wider and argmax MSS picks M = 2 in 17 of 18 FMNIST fits; on the few
   signal directions the widening shows and it picks M = 4 at every eps >= 3 measured. For
   the clustering itself full dimension is the better choice (at eps = 2 with M = 4 given:
   ARI 1 in 4 of 4 seeds in full dimension, 1 of 4 on the PCA directions).
   The round-1 updates only cluster: every cluster model restarts from the initial model.
2. Rounds 2..E_c: each client's cluster is drawn from its GMM posterior pi_i (by the server:
   post-processing, no privacy cost); batch size b.
3. Rounds > E_c: clients get all M models and pick the one that fits their training data best
   (accuracy by default, or clipped loss: ``select_by``) with the exponential mechanism
   (eps_select each, charged to their ledger); see algorithms/clustered.py.

Aggregation: cluster model += plain mean of its members' updates.

Privacy: z_i is calibrated per train size for the whole two-phase schedule (round 1 at q = 1,
then Poisson rate b/N) composed with the selections. E_c is only known after round 1, so the
calibration reserves the most selections the run can make (E - 1, or the selection window);
a client that makes fewer ends below the requested epsilon, never above.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import numpy as np
from pydantic import Field

from algorithms.clustered import ClusteredAlgorithm, ClusterState, SelectionParams
from raysim.config import ConfigError
from raysim.privacy import Phase
from raysim.privacy.planning import dpsgd_round_phase
from raysim.protocol import Message, RoundPlan, ServerResult
from raysim.server.clustering import (
    candidate_range,
    fit_gmm,
    prepare_features,
    sample_assignments,
    select_num_clusters,
    switch_round,
)


class RDPCFLParams(SelectionParams):
    num_clusters_candidates: list[int] = Field(default_factory=lambda: list(range(2, 9)))
    # Optional projection of the updates before the GMM (raysim.server.clustering.prepare_features):
    # "none" is the paper; "pca" with pca_components "auto" keeps the signal directions only.
    projection: Literal["none", "pca"] = "none"
    # The projection of the candidate fits that choose M (see the module docstring).
    select_projection: Literal["none", "pca"] = "pca"
    pca_components: int | Literal["auto"] | None = "auto"
    gmm_covariance: Literal["shared", "spherical"] = "shared"
    full_batch_first_round: bool = True  # False: the ablation of paper Fig. 5 (left)
    gmm_max_iter: int = Field(100, gt=0)
    gmm_n_init: int = Field(10, gt=0)


class RDPCFL(ClusteredAlgorithm):
    name = "rdpcfl"
    Params = RDPCFLParams

    def __init__(self, env) -> None:
        super().__init__(env)
        candidates = self.params.num_clusters_candidates
        if self.cfg.algorithm.num_clusters is None:  # M is chosen among them: one must be usable
            try:
                candidate_range(candidates, env.num_clients)
            except ValueError:
                raise ConfigError(
                    f"algorithm.num_clusters_candidates={candidates}: M is chosen among them "
                    f"(algorithm.num_clusters unset), so one must lie in [2, "
                    f"{max(env.num_clients - 1, 2)}] for {env.num_clients} clients"
                ) from None

    # -- privacy -----------------------------------------------------------------------------
    def dpsgd_schedule(self, n: int) -> list[Phase]:
        base = self.base_train_config()
        later = dpsgd_round_phase(n, base)
        first = later
        if self.params.full_batch_first_round:
            first = dpsgd_round_phase(n, replace(base, full_batch=True))
        return [first] + [later] * (self.cfg.rounds - 1)

    def reserved_selections(self) -> int:
        return max(0, min(self.cfg.rounds - 1, self.selection_window()))

    def may_select(self, round: int) -> bool:
        # worst case E_c = 1 (a GMM with MPO ~ 1): choices in rounds 2 .. 1 + window
        return 2 <= round <= 1 + self.selection_window()

    # -- rounds ------------------------------------------------------------------------------
    def init_state(self, rng: np.random.Generator) -> ClusterState:
        return ClusterState([self.env.init_weights.clone()])

    def stage(self, state: ClusterState, round: int) -> int:
        if round == 1 or state.info.get("switch_round") is None:
            return 1
        return 2 if round <= state.info["switch_round"] else 3

    def plan_round(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        stage = self.stage(state, round)
        if stage == 1:  # everyone: the GMM needs every client's update
            full = self.params.full_batch_first_round
            tasks = [self.task(c, cluster=0) for c in range(self.env.num_clients)]
            if full:
                for t in tasks:
                    t.train = self.train_config(t.client_id, full_batch=True)
            return RoundPlan(tasks, [self.env.init_weights], {"stage": 1}, waits_for_all=True)
        cohort = self.cohort(rng)
        if stage == 2:
            drawn = sample_assignments(state.info["posteriors"], rng)
            tasks = [self.task(c, cluster=int(drawn[c])) for c in cohort]
        elif round <= state.info["switch_round"] + self.selection_window():
            tasks = [self.selecting_task(c) for c in cohort]
        else:  # after the selection window: keep the last choice
            tasks = [self.task(c, cluster=int(state.assigned[c])) for c in cohort]
        return RoundPlan(tasks, state.models, {"stage": stage})

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: list[Message],
        rng: np.random.Generator,
    ) -> ServerResult:
        if plan.info["stage"] == 1:
            new_state, metrics = self.fit_clusters(reports, rng)
            metrics["stage"] = 1
            return ServerResult(new_state, metrics)
        models = self.aggregate_clusters(state.models, reports, rng)
        assigned = state.assigned.copy()
        for r in reports:  # stage 3: the clients' choices; stage 2 keeps the GMM's labels
            if r.extra.get("selected"):
                assigned[r.client_id] = r.cluster
        info = state.info
        metrics = {**info["metrics"], "stage": plan.info["stage"]}
        metrics.update(self.cluster_metrics(assigned, len(models)))
        return ServerResult(ClusterState(models, assigned, info), metrics)

    def fit_clusters(
        self, reports: list[Message], rng: np.random.Generator
    ) -> tuple[ClusterState, dict[str, float]]:
        """Stage 1 on the server: GMM, MSS, MPO, E_c and (if not given) M."""
        p = self.params
        seed = int(rng.integers(2**31 - 1))
        updates = np.stack([r.update.double().numpy() for r in reports])
        x = prepare_features(updates, p.projection, p.pca_components, seed)
        fit_kw = {
            "max_iter": p.gmm_max_iter,
            "n_init": p.gmm_n_init,
            "covariance": p.gmm_covariance,
        }
        metrics: dict[str, float] = {}
        m, gmm = self.cfg.algorithm.num_clusters, None
        if m is None:
            same = p.select_projection == p.projection
            proj = p.select_projection
            xs = x if same else prepare_features(updates, proj, p.pca_components, seed)
            m, fits = select_num_clusters(xs, p.num_clusters_candidates, seed, **fit_kw)
            metrics.update({f"mss_m{k}": f.mss for k, f in fits.items()}, select_dims=xs.shape[1])
            if same:  # the chosen candidate is already the clustering fit
                gmm = fits[m]
        if gmm is None:
            gmm = fit_gmm(x, m, seed, **fit_kw)
        e_c = switch_round(gmm.mpo, self.cfg.rounds)
        metrics.update(
            gmm_dims=x.shape[1],
            gmm_mss=gmm.mss,
            gmm_mpo=gmm.mpo,
            switch_round=e_c,
            num_clusters=gmm.num_clusters,
            gmm_iterations=gmm.n_iter,
            gmm_converged=gmm.converged,
        )
        posteriors = np.zeros((self.env.num_clients, gmm.num_clusters))
        posteriors[[r.client_id for r in reports]] = gmm.posteriors
        assigned = np.argmax(posteriors, axis=1)
        models = [self.env.init_weights.clone() for _ in range(gmm.num_clusters)]
        info = {"posteriors": posteriors, "switch_round": e_c, "metrics": dict(metrics)}
        metrics.update(self.cluster_metrics(assigned, gmm.num_clusters))
        return ClusterState(models, assigned, info), metrics
