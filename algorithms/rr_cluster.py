"""RR-Cluster (DP Federated Clustering with Random Rebalancing, Algorithms 1-2): client-level DP
federated clustering with random rebalancing, as a plug-in over a base clustering algorithm
(``algorithm.base``).

One round (trusted server, client-level central DP, fixed-size cohort of q*M clients):
the base decides each sampled client's cluster on the client (IFCA: lowest train loss; FeSEM:
nearest centre to the local model), the server privatizes the one-hot identifiers (Algorithm 2
line 8, ``privatize_onehot``), groups the updates by the noisy argmax, rebalances the groups so
that each holds at least B updates (``raysim.server.rebalancing``), and moves every cluster model by
its clipped, noised sum over |S_j|. B = 0 is the base algorithm directly privatized (the paper's
DP-IFCA / DP-FeSEM baselines); ``small_clusters="global"`` is the GMFSC baseline of appendix
E.4 (no rebalancing; a cluster with fewer than B updates takes the global model).

Structure: RRCluster holds its base (``self.base``, one ``algorithms.rr_base.ClusterBase``
picked from ``algorithm.base`` when it is built: the client's choice and training, whether the
cohort trains as one group, how the server moves the cluster models from the groups) and IFCA's
round plan (``self.rounds``, ``algorithms.ifca.SelectionRounds``); the identifiers' release, the
grouping, the rebalancing, the sensitivity and the diagnostics are its own.

Identifiers (``algorithm.identifiers``), client-level DP:
- ``private`` (default, Theorem 1): the server privatizes the one-hot ids (Gaussian, charged
  with the model sums), groups by the noisy argmax and rebalances on it. Model-sum sensitivity
  2*C_theta under replace-one whatever B: the model release is conditioned on the released noisy
  ids (``raysim.server.rebalancing``, point 1).
- ``unaccounted``: ids at a given noise-to-signal ``id_noise_to_signal`` (0: exact) that the
  ledger does NOT charge; eps covers the model updates only (conditionally on the ids, 2*C),
  and every summary says "cluster identifiers not private". What the paper's Table 4 implies.
- ``histogram``: ids stay exact; the server releases one noisy count per cluster (charged like
  the ids), groups and rebalances on the exact ids, and divides each noisy sum by the size
  predicted from the noisy counts. The rebalancing then depends on one client's exact id, so
  the model sums take the exact-id coupling sensitivity (``raysim.server.rebalancing``, point 2).

Privacy decisions:
- Only fixed-size cohorts without replacement are allowed in client mode. The identifiers are
  released per cohort member; under Poisson sampling (add/remove-one) the number of released
  rows itself changes with one client, which a Gaussian on a fixed-length vector does not
  cover. With a fixed cohort (replace-one, Theorem 1's amplification of Wang et al. 2019) the
  ids are one Gaussian mechanism on the cohort's stacked one-hots, sensitivity sqrt(2)*min(1,
  C_s), and |S_j| (hence dividing by it) is post-processing of them.
- An empty cluster (possible only without rebalancing) releases nothing and keeps its model
  when emptiness is a function of released ids; under ``histogram`` every sum is released.
- Diagnostics per round: the ids' noise-to-signal s and the analytic keep probability
  (``raysim.privacy.identifiers``), the smallest group before rebalancing, the updates moved;
  what needs the clients' own choices or the truth (measured keep rate, clustering accuracy
  before and after rebalancing) the engine computes from ``round_grouping``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from algorithms.base import Environment
from algorithms.clustered import ClusteredAlgorithm, ClusterState
from algorithms.fedcam import AdditiveMoves
from algorithms.fesem import NearestCentre
from algorithms.ifca import IFCAParams, LossChoice, SelectionRounds
from algorithms.rr_base import ClusterBase
from raysim import privacy as privacy_lib
from raysim.config import ConfigError
from raysim.privacy.identifiers import keep_probability, noise_to_signal
from raysim.privacy.needs import PrivacyNeeds
from raysim.privacy.view import Reports
from raysim.protocol import (
    ClientContext,
    ClientReport,
    ClientTask,
    RoundPlan,
    ServerResult,
)
from raysim.server.rebalancing import (
    Grouping,
    SensitivityRule,
    expected_sizes,
    rebalance,
    sensitivity,
)

Identifiers = Literal["private", "unaccounted", "histogram"]
# The paper's 2*C_theta with rebalancing on exact identifiers: a reproduction, labelled as one
PAPER_RULE_WARNING = (
    "epsilon understated: sensitivity=paper charges 2*C_theta, but rebalancing on exact "
    "identifiers (identifiers=histogram, B > 0) moves the sums by up to 3*C_theta (add/remove), "
    "6*C_theta (replace-one); a reproduction of the paper's accounting, not a guarantee"
)


class RRParams(IFCAParams):
    """``algorithm.*`` keys of RR-Cluster and its client-level bases."""

    base: Literal["ifca", "fesem", "fedcam"] = "ifca"
    global_share: float = Field(0.5, ge=0, le=1)  # fedcam: the global part's share of a move
    B: int = Field(8, ge=0)  # minimum cluster size after rebalancing (0: the base alone)
    id_clip: float = Field(0.1, gt=0)  # C_s (appendix D: 0.1; argmax does not depend on it)
    id_noise_ratio: float = Field(1.0, gt=0)  # sigma_s / sigma_theta
    sensitivity: SensitivityRule = "sound"  # "paper": 2*C_theta per cluster sum (appendix B.2)
    identifiers: Identifiers = "private"  # how cluster ids reach the grouping (module docstring)
    id_noise_to_signal: float = Field(0.0, ge=0)  # s of "unaccounted" ids (0: exact)
    small_clusters: Literal["rebalance", "global"] = "rebalance"  # "global": GMFSC (E.4)


# ``algorithm.base``: each value of RRParams.base names one (tests/test_rr_cluster.py checks)
BASES: dict[str, type[ClusterBase]] = {
    cls.name: cls for cls in (LossChoice, NearestCentre, AdditiveMoves)
}


class RRCluster(ClusteredAlgorithm):
    """RR-Cluster over a base (``self.base``, from ``algorithm.base``: IFCA, Algorithm 2; FeSEM,
    ``algorithms.fesem``: how a client chooses; FedCAM, ``algorithms.fedcam``: how the server
    moves additive models), with IFCA's round plan (``self.rounds``)."""

    name = "rr_cluster"
    Params = RRParams
    privacy_modes = ("none", "client")

    def __init__(self, env: Environment) -> None:
        if env.cfg.privacy.clip_quantile is not None:
            raise ConfigError(
                "privacy.clip_quantile: adaptive clipping counts one model sum a round, and "
                "rr_cluster releases one per cluster beside its identifiers; use it with fedavg, "
                "fedprox or fedper, or give rr_cluster a fixed privacy.clip"
            )
        super().__init__(env)
        self.check_params(self.params)
        q = self.cfg.training.sampling_rate
        if self.params.selection_fraction < 1 and q < 1:
            raise ConfigError(
                f"algorithm.selection_fraction: after the selection window a client trains the "
                f"cluster it last chose, and at training.sampling_rate={q:g} some clients are "
                "first sampled after it, with no choice to keep; leave selection_fraction at 1 "
                "(each sampled client chooses, as in RR-Cluster's Algorithm 2) or sample every "
                "client (training.sampling_rate=1)"
            )
        self.base: ClusterBase = BASES[self.params.base](self)
        self.base.check()
        self.rounds = SelectionRounds(self)
        k = self.num_clusters()
        cohort = self.cfg.training.sampling_rate * env.num_clients
        if self.params.B * k > cohort:
            raise ConfigError(f"algorithm.B: need B <= qM/k = {cohort / k:g}, got {self.params.B}")

    @staticmethod
    def check_params(params: RRParams) -> None:
        if params.id_noise_to_signal and params.identifiers != "unaccounted":
            raise ConfigError(
                "algorithm.id_noise_to_signal: only with algorithm.identifiers=unaccounted "
                f"(got identifiers={params.identifiers!r})"
            )

    # -- privacy ---------------------------------------------------------------------------
    def privacy_needs(self) -> PrivacyNeeds:
        """The model sums and the identifiers (charged, or declared unaccounted); no
        exponential-mechanism choices: the trusted server privatizes the ids."""
        if self.params.identifiers == "unaccounted":
            s = self.params.id_noise_to_signal
            needs = PrivacyNeeds(self.dpsgd_schedule, unaccounted_id_noise=s)
        else:
            needs = PrivacyNeeds(self.dpsgd_schedule, id_noise_ratio=self.params.id_noise_ratio)
        return self.rounds.needs(needs)

    def id_noise_to_signal(self, noise: dict[str, Any]) -> float | None:
        """s of the per-client ids the grouping sees, under the view's ``noise`` (empty: the
        ids are exact)."""
        if not noise:
            return 0.0
        if self.params.identifiers == "unaccounted":
            return self.params.id_noise_to_signal
        if self.params.identifiers == "histogram":
            return 0.0
        return noise_to_signal(noise["id_noise_multiplier"], noise["replace_one"])

    def id_diagnostics(self, noise: dict[str, Any]) -> dict[str, Any]:
        """What the identifiers still say, known before training (``raysim privacy``)."""
        if getattr(self, "_id_diagnostics", None) is None:
            self._id_diagnostics = self._compute_id_diagnostics(noise)
        return dict(self._id_diagnostics)

    def _compute_id_diagnostics(self, noise: dict[str, Any]) -> dict[str, Any]:
        k, s = self.num_clusters(), self.id_noise_to_signal(noise)
        out: dict[str, Any] = {"identifiers": self.params.identifiers}
        if s is not None:
            out["id_noise_to_signal"] = s
            out["id_keep_analytic"] = keep_probability(s, k)
        if noise and self.params.identifiers == "private":
            out.update(self.id_ceiling(k, noise["replace_one"]))
        if noise and self.params.identifiers == "histogram":
            sens = math.sqrt(2.0) if noise["replace_one"] else 1.0
            out["id_count_noise_std"] = sens * noise["id_noise_multiplier"]
        return out

    @property
    def rebalancing_B(self) -> int:
        return self.params.B if self.params.small_clusters == "rebalance" else 0

    def model_sensitivity(self) -> float:
        """Std / z of every model sum: the rebalanced cluster sums', joint with whatever else
        the base releases beside them (FedCAM's global sum)."""
        exact = self.params.identifiers == "histogram"  # rebalanced on exact, unreleased ids
        return self.base.sum_sensitivity(self.group_sensitivity(self.rebalancing_B, exact))

    def group_sensitivity(self, min_size: int, exact_ids: bool = False) -> float:
        """L2 sensitivity of the k sums of groups of at least ``min_size`` updates (0: no
        rebalancing), under the run's sampling and ``algorithm.sensitivity`` rule."""
        replace_one = self.cfg.training.sampling == "without_replacement"
        rule, clip = self.params.sensitivity, self.cfg.privacy.clip
        return sensitivity(clip, min_size, replace_one, rule, exact_ids=exact_ids)

    def id_ceiling(self, k: int, replace_one: bool) -> dict[str, Any]:
        """The best the accounted ids can do even with infinite model noise: all of eps on the
        identifier Gaussian gives multiplier z*, so s >= sqrt(2) z* (replace-one)."""
        p, t = self.cfg.privacy, self.cfg.training
        if p.epsilon is None:
            return {}
        z = privacy_lib.calibrate_central(
            self.cfg.rounds,
            t.sampling_rate,
            p.epsilon,
            p.delta,
            sampling=t.sampling,
            population=self.env.num_clients,
            accountant=p.accountant,
        ).model
        s_min = noise_to_signal(z, replace_one)
        return {"id_noise_to_signal_floor": s_min, "id_keep_ceiling": keep_probability(s_min, k)}

    def privacy_summary(self, view: Reports) -> dict[str, Any]:
        out = super().privacy_summary(view)
        noise = view.noise()
        if noise:  # the sums are noised: at the sensitivity of rebalanced groups
            out["model_sensitivity"] = self.model_sensitivity()
            out.update(self.id_diagnostics(noise))
            unsound = self.params.sensitivity == "paper" and self.rebalancing_B > 0
            if unsound and self.params.identifiers == "histogram":
                out["accounting_warning"] = PAPER_RULE_WARNING
        return out

    # -- the round plan: IFCA's -------------------------------------------------------------
    def may_select(self, round: int) -> bool:
        return self.rounds.may_select(round)

    def init_state(self, rng: np.random.Generator) -> ClusterState:
        return self.rounds.init_state(rng)

    def plan_round(self, state: ClusterState, round: int, rng: np.random.Generator) -> RoundPlan:
        return self.rounds.plan(state, round, rng)

    # -- clients: the base's ---------------------------------------------------------------
    def client_step(self, task: ClientTask, ctx: ClientContext) -> ClientReport:
        return self.base.client_step(task, ctx)

    def trains_in_groups(self) -> bool:
        return self.base.trains_in_groups

    # -- server ----------------------------------------------------------------------------
    def group(self, reports: Reports, k: int, rng: np.random.Generator) -> np.ndarray:
        """Each report's cluster for aggregation: noisy ids (client mode), then rebalancing."""
        return self.grouping(reports, k, rng)[0].after

    def grouping(
        self, reports: Reports, k: int, rng: np.random.Generator
    ) -> tuple[Grouping, np.ndarray | None, int]:
        """The round's grouping, the released noisy counts (``histogram``; else None) and the
        number of updates rebalancing moved. Every identifier release goes through the mode.
        Identifier noise and rebalancing draw from their own streams, so B changes no other
        draw (runs that differ only in B see the same noise)."""
        id_rng, rebalance_rng = rng.spawn(2)
        chosen = np.array([r.cluster for r in reports], dtype=np.int64)
        how, clip = self.params.identifiers, self.params.id_clip
        before, counts = reports.cluster_ids(chosen, k, how, clip, id_rng)
        out = rebalance(before, k, self.rebalancing_B, rebalance_rng)
        clients = np.array([r.client_id for r in reports], dtype=np.int64)
        return Grouping(clients, np.asarray(before), out.clusters), counts, int(out.moved.size)

    def aggregate_groups(
        self,
        models: list[torch.Tensor],
        reports: Reports,
        groups: np.ndarray,
        rng: np.random.Generator,
        counts: np.ndarray | None = None,
    ) -> list[torch.Tensor]:
        out = self.cluster_moves(models, reports, groups, rng, counts)
        if self.params.small_clusters == "global":
            out = self.global_for_small(models, out, groups, len(reports))
        return out

    def cluster_moves(
        self,
        models: list[torch.Tensor],
        reports: Reports,
        groups: np.ndarray,
        rng: np.random.Generator,
        counts: np.ndarray | None = None,
    ) -> list[torch.Tensor]:
        """Each cluster model after its group's update, as the mode releases the group's mean:
        the plain mean without DP; with client-level DP the clipped sum + N(0, (sens * z)^2)
        over |S_j| (Algorithm 1 l. 11), or, with released noisy ``counts`` (``histogram``), over
        the sizes they predict, every sum released, empty or not (emptiness is a function of
        the exact ids)."""
        sens = self.sum_sensitivity(reports)
        sizes = None if counts is None else expected_sizes(counts, self.rebalancing_B)
        out = []
        for j, model in enumerate(models):
            members = [r for r, g in zip(reports, groups, strict=True) if g == j]
            size = len(members) if sizes is None else float(sizes[j])
            how = {"sensitivity": sens, "denominator": size, "release_empty": sizes is not None}
            out.append(self.aggregate(model, reports, rng, j, members, equal_weights=True, **how))
        return out

    def sum_sensitivity(self, reports: Reports) -> float | None:
        """The sensitivity the round's noisy sums are drawn at (None: they are exact)."""
        return self.model_sensitivity() if reports.noise() else None

    def global_for_small(
        self, old: list[torch.Tensor], new: list[torch.Tensor], groups: np.ndarray, n: int
    ) -> list[torch.Tensor]:
        """GMFSC: the global model (post-processing: the sum of the noisy cluster moves) replaces
        every cluster model that had fewer than B updates this round."""
        sizes = np.bincount(groups, minlength=len(old))
        step = sum(((nw - od) * s for od, nw, s in zip(old, new, sizes, strict=True)), 0)
        global_model = torch.stack(old).mean(0) + step / max(n, 1)
        return [
            global_model.clone() if s < self.params.B else m
            for m, s in zip(new, sizes, strict=True)
        ]

    def server_step(
        self,
        state: ClusterState,
        plan: RoundPlan,
        reports: Reports,
        rng: np.random.Generator,
    ) -> ServerResult:
        k = len(state.models)
        group_rng, rng = rng.spawn(2)  # model noise: its own stream
        grouping, counts, moved = self.grouping(reports, k, group_rng)
        groups = grouping.after
        models, kept = self.base.move(state, reports, groups, rng, counts)
        info = {**state.info, **kept, "grouping": grouping}
        assigned = self.updated_assignments(state, reports)
        metrics = self.cluster_metrics(np.maximum(assigned, 0), k)
        sizes = np.bincount(groups, minlength=k) if groups.size else np.zeros(k, dtype=np.int64)
        metrics["round_cluster_size_min"] = int(sizes.min())
        metrics.update(self.round_diagnostics(grouping, counts, moved, k, reports.noise()))
        return ServerResult(ClusterState(models, assigned, info), metrics)

    def round_diagnostics(
        self,
        grouping: Grouping,
        counts: np.ndarray | None,
        moved: int,
        k: int,
        noise: dict[str, Any],
    ) -> dict[str, Any]:
        """The server's own view of its grouping: the smallest group before rebalancing (noisy
        counts under ``histogram``: the server publishes nothing finer), the updates moved."""
        out = {k_: v for k_, v in self.id_diagnostics(noise).items() if k_ != "identifiers"}
        if counts is not None:
            out["group_size_min_before"] = float(counts.min())
        elif grouping.before.size:
            out["group_size_min_before"] = float(np.bincount(grouping.before, minlength=k).min())
        out["rebalance_moved"] = moved
        return out

    def evaluates_by_choice(self, state: ClusterState) -> bool:
        return True  # most clients were never sampled: the server has no assignment for them

    def round_grouping(self, state: ClusterState) -> Grouping | None:
        """The last round's grouping, for the engine's truth-dependent diagnostics."""
        return state.info.get("grouping")

    def choices(self, state: ClusterState) -> np.ndarray | None:
        """The clients' own last choices, -1 for clients never sampled (clustering accuracy)."""
        return state.assigned
