"""Per-round metrics from the clients' evaluation reports.

Definitions (used in result files, `raysim report` and the comparison tables):
- accuracy / loss: unweighted mean over clients of each client's test accuracy / loss (the
  papers average over clients, so a small client counts as much as a large one);
- accuracy_cluster_k: the same mean over the clients whose *true* cluster is k;
- accuracy_minority: over the smallest true cluster; accuracy_majority: over all the others
  (both absent when every cluster has the same size);
- accuracy_min: the worst client's accuracy;
- accuracy_disparity / loss_disparity: best minus worst client accuracy / loss;
- ari: adjusted Rand index of the algorithm's assignment against the true clusters, and
  clustered_correctly = (ari == 1), where the algorithm assigns clusters: in every round, not
  only the evaluated ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.protocol import EvalReport
from raysim.seeding import SERVER, numpy_rng

if TYPE_CHECKING:
    from raysim.config import ExperimentConfig


def minority_cluster(true_clusters: np.ndarray) -> int | None:
    """The smallest true cluster (R-DPCFL's "minority"; of equal smallest ones, the first), or
    None when all clusters have the same size."""
    ids, counts = np.unique(true_clusters, return_counts=True)
    if len(ids) < 2 or counts.min() == counts.max():
        return None
    return int(ids[np.argmin(counts)])


def clustering_metrics(true_clusters: np.ndarray, assigned: np.ndarray | None) -> dict[str, Any]:
    if assigned is None:
        return {}
    from sklearn.metrics import adjusted_rand_score  # ~0.7 s to import: only where a run scores

    ari = float(adjusted_rand_score(true_clusters, assigned))
    return {"ari": ari, "clustered_correctly": bool(np.isclose(ari, 1.0))}


def clustering_accuracy(true: np.ndarray, assigned: np.ndarray) -> float:
    """Fraction of clients whose cluster matches the truth after the best one-to-one relabelling
    (Hungarian; with fewer clusters than true groups, unmatched groups count as wrong). Clients
    with a negative assignment (never chose) are left out."""
    from scipy.optimize import linear_sum_assignment

    true, assigned = np.asarray(true, dtype=np.int64), np.asarray(assigned, dtype=np.int64)
    seen = assigned >= 0
    true, assigned = true[seen], assigned[seen]
    if true.size == 0:
        return float("nan")
    overlap = np.zeros((int(assigned.max()) + 1, int(true.max()) + 1))
    np.add.at(overlap, (assigned, true), 1)
    rows, cols = linear_sum_assignment(-overlap)
    return float(overlap[rows, cols].sum() / true.size)


# Per-round diagnostics of a grouping algorithm (RR-Cluster), averaged into summary.json
GROUPING_DIAGNOSTICS = (
    "id_noise_to_signal",
    "id_keep_analytic",
    "id_keep_measured",
    "id_count_noise_std",
    "group_size_min_before",
    "rebalance_moved",
    "clustering_accuracy_before",
    "clustering_accuracy_after",
)


def grouping_metrics(true: np.ndarray, choices: np.ndarray | None, grouping: Any) -> dict:
    """Against the truth and the clients' own choices, which only the simulator knows: how
    often the ids the server grouped by kept the client's choice, and the clustering accuracy
    of the cohort before and after rebalancing."""
    clients = np.asarray(grouping.clients, dtype=np.int64)
    if clients.size == 0:
        return {}
    truth = np.asarray(true)[clients]
    out = {
        "clustering_accuracy_before": clustering_accuracy(truth, grouping.before),
        "clustering_accuracy_after": clustering_accuracy(truth, grouping.after),
    }
    if choices is not None:
        out["id_keep_measured"] = float(np.mean(grouping.before == np.asarray(choices)[clients]))
    return out


def diagnostics_summary(history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean over rounds of each grouping diagnostic present (summary.json)."""
    out = {}
    for key in GROUPING_DIAGNOSTICS:
        vals = [float(r[key]) for r in history if r.get(key) is not None]
        if vals:
            out[key] = float(np.mean(vals))
    return out


def held_out_clients(cfg: ExperimentConfig, num_clients: int) -> np.ndarray | None:
    """The clients ``training.held_out_clients`` keeps out of training, sorted (None: none).
    Drawn once from the run's seed, whatever the clients' data (the server's draw: who is held
    out is public), so holding them out is a thinning of every planned cohort, as dropout is."""
    from raysim.config import held_out_count

    share = cfg.training.held_out_clients
    if share is None:
        return None
    rng = numpy_rng(cfg.seed, 0, SERVER, "held_out")
    return np.sort(rng.choice(num_clients, size=held_out_count(share, num_clients), replace=False))


def evaluation_cohort(cfg: ExperimentConfig, num_clients: int) -> np.ndarray | None:
    """The clients every evaluation judges, sorted: the held-out clients where there are some
    (``training.held_out_clients``), else the population; of those, ``training.eval_clients``
    drawn once, so that evaluations compare (early stopping) on the same clients. None: every
    client. Drawn from the run's seed (the server's: who is judged is public)."""
    held_out = held_out_clients(cfg, num_clients)
    pool = held_out if held_out is not None else np.arange(num_clients)
    wanted = cfg.training.eval_clients
    if wanted is None or wanted >= len(pool):
        return held_out
    rng = numpy_rng(cfg.seed, 0, SERVER, "eval_cohort")
    return np.sort(rng.choice(pool, size=wanted, replace=False))


def sample_mean_ci95(values: np.ndarray, population: int) -> float:
    """Half-width of the normal 95% confidence interval of the population's mean from a simple
    random sample of it (without replacement: the finite-population correction)."""
    m = len(values)
    if m < 2:
        return float("nan")
    fpc = (population - m) / (population - 1)
    return float(1.959963984540054 * np.std(values, ddof=1) / np.sqrt(m) * np.sqrt(fpc))


def round_metrics(reports: Sequence[EvalReport], true_clusters: np.ndarray) -> dict[str, Any]:
    acc = np.array([r.accuracy for r in reports], dtype=float)
    loss = np.array([r.loss for r in reports], dtype=float)
    truth = true_clusters[[r.client_id for r in reports]]
    out: dict[str, Any] = {
        "accuracy": float(np.mean(acc)),
        "loss": float(np.mean(loss)),
        "accuracy_min": float(np.min(acc)),
        "accuracy_disparity": float(np.max(acc) - np.min(acc)),
        "loss_disparity": float(np.max(loss) - np.min(loss)),
    }
    if len(reports) < len(true_clusters):  # a cohort: training.eval_clients, held_out_clients
        out["evaluated_clients"] = len(reports)
        out["accuracy_ci95"] = sample_mean_ci95(acc, len(true_clusters))
    for k in np.unique(truth):
        out[f"accuracy_cluster_{k}"] = float(np.mean(acc[truth == k]))
        out[f"loss_cluster_{k}"] = float(np.mean(loss[truth == k]))
    minority = minority_cluster(true_clusters)
    if minority is not None:
        out["accuracy_minority"] = float(np.mean(acc[truth == minority]))
        out["accuracy_majority"] = float(np.mean(acc[truth != minority]))
    return out


@dataclass
class Judge:
    """The experimenter's reading of an evaluation: its metrics against the truth, and
    ``training.early_stop_patience``'s count of evaluations without a lower mean test loss.
    Where the server is trusted it is the round loop's; where it is not, the clients' side's
    (``runtime.client_side``): no client's score then reaches the server's process, and the
    stop is the experimenter's, not the server's."""

    truth: np.ndarray
    patience: int | None
    best_loss: float = math.inf
    stale: int = 0
    last: list[EvalReport] = field(default_factory=list)  # the latest evaluation's reports
    cohort: np.ndarray | None = None  # the clients it judges (None: all; evaluation_cohort)

    @classmethod
    def of_run(cls, truth: np.ndarray, cfg: ExperimentConfig) -> Judge:
        """The judge of a run: its patience, and the clients ``training.eval_clients`` draws."""
        truth = np.asarray(truth)
        cohort = evaluation_cohort(cfg, len(truth))
        return cls(truth, cfg.training.early_stop_patience, cohort=cohort)

    def unjudged(self, scored: Sequence[int]) -> list[int]:
        """The clients to judge that ``scored`` lacks: an evaluation over fewer, or others, would
        be over clients the server chose."""
        wanted = range(len(self.truth)) if self.cohort is None else self.cohort.tolist()
        have = set(scored)
        return [c for c in wanted if c not in have] + sorted(have.difference(wanted))

    def __call__(self, reports: Sequence[EvalReport]) -> dict[str, Any]:
        """The evaluation's metrics row (``early_stopped`` where the patience has run out)."""
        self.last = sorted(reports, key=lambda r: r.client_id)
        row = round_metrics(self.last, np.asarray(self.truth))
        if row["loss"] < self.best_loss:
            self.best_loss, self.stale = row["loss"], 0
        else:
            self.stale += 1
        if self.patience is not None and self.stale >= self.patience:
            row["early_stopped"] = True
        return row
