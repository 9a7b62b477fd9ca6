"""The Coordinator runs the rounds (DESIGN.md, "One round, as data flows").

It is a plain class so it can be unit-tested; `runtime.session` runs it inside a Ray actor. It
owns the server state, the clients' persistent state and the privacy ledger; the workers own the
data and the arithmetic.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from raysim.config import ExperimentConfig
from raysim.metrics.evaluation import round_metrics
from raysim.privacy import PrivacyLedger
from raysim.protocol import EvalReport, RoundPlan
from raysim.runtime.pool import WorkerPool, balance_groups, client_groups, group_size
from raysim.runtime.worker import ClientWorker
from raysim.seeding import SERVER, numpy_rng

CHECKPOINT_FIELDS = (
    "round",
    "state",
    "client_states",
    "ledger",
    "history",
    "last_eval",
    "algorithm",
)


def worker_placement() -> dict[str, Any]:
    """Spread workers over the nodes, unless a placement group (a Tune trial) already decides."""
    try:
        if ray.util.get_current_placement_group() is not None:
            return {}
    except Exception:  # outside Ray (unit tests)
        return {}
    return {"scheduling_strategy": "SPREAD"}


def worker_factory(
    cfg: ExperimentConfig, algorithm: Any, data_ref: Any, num_gpus_per_worker: float
) -> Callable[[int], Any]:
    """Starts ClientWorker actor i (used by the driver at start-up and by the pool to replace a
    lost worker)."""
    rt = cfg.runtime
    actor = ray.remote(ClientWorker).options(
        num_cpus=rt.cpus_per_worker,
        num_gpus=num_gpus_per_worker,
        max_restarts=-1,
        **worker_placement(),
    )
    model_kwargs = {"hidden": cfg.model.hidden} if cfg.model.name == "mlp" else {}

    def make_worker(i: int) -> Any:
        return actor.remote(
            algorithm,
            [data_ref],
            cfg.model.name,
            model_kwargs,
            cfg.seed,
            rt.threads_per_worker,
            num_gpus_per_worker,
            rt.vectorize,
        )

    return make_worker


class Coordinator:
    def __init__(
        self,
        cfg: ExperimentConfig,
        algorithm: Any,
        dataset_box: list[Any],
        true_clusters: np.ndarray,
        num_gpus_per_worker: float,
        workers: list[Any] | None = None,
    ) -> None:
        """`workers`: ClientWorker actors the driver already started (in parallel with this
        actor, docs/speed.md); None: start them here."""
        self.cfg = cfg
        self.algorithm = algorithm
        self.true_clusters = true_clusters
        self.round = 0
        self.state = algorithm.init_state(numpy_rng(cfg.seed, 0, SERVER, "init"))
        self.client_states: dict[int, Any] = {}
        p = cfg.privacy
        budget = p.epsilon if p.mode != "none" else None
        self.ledger = PrivacyLedger(
            delta=p.delta, accountant=p.accountant, budget=budget, num_clients=len(true_clusters)
        )
        self.history: list[dict[str, Any]] = []
        self.last_eval: list[EvalReport] = []
        rt = cfg.runtime
        make_worker = worker_factory(cfg, algorithm, dataset_box[0], num_gpus_per_worker)
        self.group_size = group_size(rt.client_group_size, num_gpus_per_worker)
        size = len(true_clusters) if rt.actor_per_client else rt.num_workers
        self.pool = WorkerPool(make_worker, size, rt.round_timeout_s, workers)

    # -- helpers -------------------------------------------------------------------------------
    def _shards(self, plan: RoundPlan) -> list[tuple[int, list[Any]]]:
        if self.cfg.runtime.actor_per_client:  # each client pinned to its own actor
            return [(t.client_id, [[t]]) for t in plan.tasks]
        groups = client_groups(plan.tasks, self.group_size)
        return list(enumerate(balance_groups(groups, len(self.pool.workers))))

    def _execute(self, kind: str, plan: RoundPlan) -> list[Any]:
        for t in plan.tasks:  # client state lives here and travels with the task
            if t.state is None and t.client_id in self.client_states:
                t.state = self.client_states[t.client_id]
        models = np.stack([m.numpy() for m in plan.models]) if plan.models else np.zeros((0, 0))
        models_ref = ray.put(models)  # once per round, never per client
        return self.pool.run(kind, self.round, models_ref, self._shards(plan))

    # -- API -----------------------------------------------------------------------------------
    def info(self) -> list[dict[str, Any]]:
        return self.pool.ready()

    def step(self) -> dict[str, Any]:
        """Run one round; returns its metrics row."""
        start = time.perf_counter()
        self.round += 1
        r, seed = self.round, self.cfg.seed
        plan = self.algorithm.plan_round(self.state, r, numpy_rng(seed, r, SERVER, "plan"))
        plan.round = r
        reports = self._execute("train", plan)
        reports.sort(key=lambda rep: rep.client_id)
        for rep in reports:
            if rep.state is not None:
                self.client_states[rep.client_id] = rep.state
        result = self.algorithm.server_step(
            self.state, plan, reports, numpy_rng(seed, r, SERVER, "server")
        )
        for charge in result.charges:
            self.ledger.charge(r, charge.clients, charge.mechanism, charge.event, charge.params)
        self.ledger.check_budget()  # never continue past the budget
        self.state = result.state
        row: dict[str, Any] = {"round": r, "participants": len(reports)}
        row.update(result.metrics)
        if r % self.cfg.training.eval_every == 0 or r == self.cfg.rounds:
            self.last_eval = self.evaluate()
            row.update(
                round_metrics(
                    self.last_eval,
                    self.true_clusters,
                    self.algorithm.assignments(self.state),
                )
            )
        row["epsilon"] = self.ledger.summary()["max_epsilon"]
        row["round_seconds"] = time.perf_counter() - start
        self.history.append(row)
        return row

    def evaluate(self) -> list[EvalReport]:
        plan = self.algorithm.plan_evaluation(self.state)
        reports = self._execute("evaluate", plan)
        return sorted(reports, key=lambda rep: rep.client_id)

    def snapshot(self) -> bytes:
        """A checkpoint: everything that changes between rounds. Random generators need no saving:
        every draw is keyed by (seed, round, client, purpose), so round r+1 after a restore draws
        exactly what it would have drawn in an uninterrupted run."""
        return pickle.dumps({k: getattr(self, k) for k in CHECKPOINT_FIELDS})

    def restore(self, blob: bytes) -> tuple[int, list[dict[str, Any]]]:
        """Continue from a snapshot; returns the last completed round and the history so far."""
        saved = pickle.loads(blob)
        for k in CHECKPOINT_FIELDS:
            setattr(self, k, saved[k])
        return self.round, list(self.history)

    def results(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "eval": self.last_eval,
            "assignments": self.algorithm.assignments(self.state),
            "ledger_rows": self.ledger.rows(),
            "client_epsilon": [self.ledger.epsilon(c) for c in range(len(self.true_clusters))],
            "ledger_summary": self.ledger.summary(),
            "workers_replaced": self.pool.replaced,
        }

    def shutdown(self) -> None:
        self.pool.shutdown()
