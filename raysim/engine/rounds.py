"""The round loop (DESIGN: "One round, as data flows"), one copy for every way of running.

``RoundLoop`` owns the server state, the clients' persistent state and the privacy ledger, and
leaves the clients' arithmetic to an ``execute`` callable: the Ray coordinator passes its worker
pool (``runtime.coordinator``), ``raysim compare --inline`` an in-process worker. Nothing here
imports Ray, so the GPU machine runs the very same loop.

One round: the algorithm plans it; the unavailable clients leave the plan
(``training.client_dropout``); the clients run; their persistent state is kept here; the
privacy mode admits the reports (the only view the server step gets); the server step runs
(unless the round's secure aggregation aborted, ``privacy.shortfall``); the
ledger is charged from what was released and the budget checked; metrics against the truth are
computed here, never by the algorithm.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from raysim import privacy as privacy_lib
from raysim.config import ExperimentConfig
from raysim.metrics.evaluation import (
    Judge,
    clustering_accuracy,
    clustering_metrics,
    evaluation_cohort,
    grouping_metrics,
    held_out_clients,
)
from raysim.privacy.metric_ledger import MetricLedger
from raysim.privacy.modes.secure import secure_noise_rng
from raysim.privacy.sampling import dropout_rates, unavailable
from raysim.protocol import Aborted, ClientTask, EvalReport, RoundPlan
from raysim.seeding import SERVER, numpy_rng

# The ledger's accountant, loaded in the background while round 1 trains (once a process)
ACCOUNTING = "raysim.privacy.accounting"
_accountant_loading = threading.Event()

# execute(kind, round, models, tasks) -> one report per task ("train" or "evaluate")
Execute = Callable[[str, int, list[torch.Tensor], list[ClientTask]], list[Any]]


# Clients per vectorized group with `runtime.client_group_size: auto`. On a GPU a group of 32
# batch-16 CNN steps still underfills it; on this project's 2-core CPUs a cross-client vmap was
# measured slower than one client at a time (docs/speed.md), so there groups are single clients.
AUTO_GROUP_GPU, AUTO_GROUP_CPU = 32, 1


def group_size(setting: int | str, gpus_per_worker: float) -> int:
    if setting == "auto":
        return AUTO_GROUP_GPU if gpus_per_worker > 0 else AUTO_GROUP_CPU
    return int(setting)


def client_groups(tasks: list[ClientTask], size: int) -> list[list[ClientTask]]:
    """The units of vectorized training: the round's tasks in client-id order, cut every `size`.
    Decided from the cohort alone, never from the workers, so any number of workers computes
    the same groups and so the same bits."""
    ordered = sorted(tasks, key=lambda t: t.client_id)
    return [ordered[i : i + size] for i in range(0, len(ordered), max(size, 1))]


def task_groups(
    kind: str, tasks: list[ClientTask], train_size: int, eval_size: int
) -> list[list[ClientTask]]:
    """client_groups for a call: ``train_size`` clients per training group, ``eval_size``
    (`runtime.eval_group_size`) per evaluation group. The clients of an evaluation group judged
    on the same model share forward passes (Algorithm.client_evaluations): W's last round judged
    1,000 clients of 10 test images one at a time, ~2 ms each, mostly overhead."""
    return client_groups(tasks, eval_size if kind == "evaluate" else train_size)


CHECKPOINT_FIELDS = (
    "round",
    "state",
    "client_states",
    "ledger",
    "metric_ledger",
    "history",
    "judge",
    "algorithm",
    "mode",
    "rounds_reported",
    "unavailable",
    "assignment_history",
)
# fields a checkpoint made before they existed lacks: they keep their initial value
LATER_FIELDS = ("rounds_reported", "unavailable", "judge", "assignment_history", "mode")
# each round's assignment is kept for populations up to this size (int32 a client a round)
MAX_RECORDED_ASSIGNMENTS = 20_000


class RoundLoop:
    def __init__(
        self,
        cfg: ExperimentConfig,
        algorithm: Any,
        mode: Any,
        true_clusters: np.ndarray,
        execute: Execute,
        client_seed: int | None = None,
    ) -> None:
        """``mode``: the run's privacy mode (``raysim.privacy.modes``), the engine's: it stamps each
        plan, admits the reports and hands the server step its view. ``client_seed``: the
        clients' seed, where an untrusted server's clients run in this process (the library's
        inline loop): the secure sums' noise is drawn from it here. Elsewhere the sums come
        from the clients' side (``secure_sums``)."""
        self.cfg, self.algorithm, self.mode, self.execute = cfg, algorithm, mode, execute
        self.client_seed = client_seed
        self.true_clusters = np.asarray(true_clusters)
        rates = cfg.training.client_dropout
        self.dropout = dropout_rates(rates, self.true_clusters) if np.any(rates) else None
        self.unavailable: np.ndarray | None = None  # last round's, per client of the population
        self.round = 0
        self.state = algorithm.init_state(numpy_rng(cfg.seed, 0, SERVER, "init"))
        self.client_states: dict[int, Any] = {}
        # where the clients' secure inputs are summed when they are not on the reports (the
        # clients' side actor, set by the Ray coordinator); None: on the reports, summed here
        self.secure_sums: Any = None
        p = cfg.privacy
        self.ledger = privacy_lib.PrivacyLedger(
            delta=p.delta,
            accountant=p.accountant,
            budget=p.epsilon if mode.private else None,
            num_clients=self.num_clients,
        )
        self.metric_ledger = MetricLedger(cap=p.leakage_cap if mode.metric else None)
        self.history: list[dict[str, Any]] = []
        self.rounds_reported = np.zeros(self.num_clients, dtype=np.int64)  # per client
        # (round, each client's cluster) where the engine knows it: assignments.parquet
        self.assignment_history: list[tuple[int, np.ndarray]] = []
        # None where the clients keep their evaluations apart from the server (their side
        # judges them, runtime.client_side): the driver adds the metrics to the rows
        # training.eval_clients' cohort, drawn once: the clients every evaluation plans for
        self.held_out = held_out_clients(cfg, self.num_clients)  # never trained
        self.eval_cohort = evaluation_cohort(cfg, self.num_clients)
        patience = cfg.training.early_stop_patience
        self.judge: Judge | None = Judge(self.true_clusters, patience, cohort=self.eval_cohort)

    @property
    def num_clients(self) -> int:
        return len(self.true_clusters)

    def _run(self, kind: str, plan: RoundPlan) -> list[Any]:
        """Run the plan's tasks. Client state kept here travels with its client's task and is
        taken off again: the server step gets the plan, and never a client's state. (Where the
        server is untrusted, on Ray, the state is not here at all: runtime.client_side.)"""
        attached = [t for t in plan.tasks if t.state is None and t.client_id in self.client_states]
        for t in attached:
            t.state = self.client_states[t.client_id]
        try:
            reports = self.execute(kind, self.round, list(plan.models), plan.tasks)
        finally:
            for t in attached:
                t.state = None
        return sorted(reports, key=lambda rep: rep.client_id)

    def step(self) -> dict[str, Any]:
        """Run one round; returns its metrics row."""
        start = time.perf_counter()
        self.round += 1
        r, seed, algo, mode = self.round, self.cfg.seed, self.algorithm, self.mode
        self._load_accountant_meanwhile()
        plan = algo.plan_round(self.state, r, numpy_rng(seed, r, SERVER, "plan"))
        plan.round = r
        mode.stamp(plan)
        self._hold_out(plan)
        dropped = self._drop_out(plan)
        skipped = self._skip_over_cap(plan)
        reports = self._run("train", plan)
        np.add.at(self.rounds_reported, [rep.client_id for rep in reports], 1)
        for rep in reports:
            if rep.state is not None:
                self.client_states[rep.client_id] = rep.state
        secure_rng = None  # summed here (the library's loop): the clients' noise, from their seed
        if self.secure_sums is None and self.client_seed is not None:
            secure_rng = secure_noise_rng(self.client_seed, r)
        view = mode.admit(algo.name, plan, reports, secure_rng, secure=self.secure_sums)
        # the clients' releases are charged before the server step gets the view: one over the
        # budget never reaches the server's code (the ledger refuses, charging nothing, and the
        # run stops); the server's own releases after the step that made them
        self._charge(r, mode.charges(r, reports))
        for rep, leak in mode.leakages(reports):
            self.metric_ledger.record(rep.client_id, r, leak.dim, leak.nu, rep.cluster)
        row: dict[str, Any] = {"round": r, "participants": len(reports)}
        if not isinstance(view, Aborted):  # an aborted secure sum: the server has no step to run
            rng = numpy_rng(seed, r, SERVER, "server")
            result = algo.server_step(self.state, plan, view, rng)
            self._charge(r, mode.server_charges(r))
            self.state = result.state
            row.update(result.metrics)
        row.update(mode.round_metrics())
        if dropped is not None:
            row["dropped_out"] = dropped
        if skipped:
            row["skipped_over_cap"] = skipped
        choices = algo.choices(self.state)
        if choices is not None:
            row["clustering_accuracy"] = clustering_accuracy(self.true_clusters, choices)
        grouping = algo.round_grouping(self.state)
        if grouping is not None:
            row.update(grouping_metrics(self.true_clusters, choices, grouping))
        # Every round, not only where the clients are evaluated: the assignment is the server's
        # and costs no evaluation (R-DPCFL's "ARI = 1 after round 1" with eval_every > 1).
        assigned = algo.assignments(self.state)
        row.update(clustering_metrics(self.true_clusters, assigned))
        self._record_assignment(assigned if assigned is not None else choices)
        if self.cfg.evaluated_after(r):
            reports = self.evaluate()
            if self.judge is not None:
                row.update(self.judge(reports))
        accounted = mode.accounts_epsilon  # else missing: never 0, which would say "DP"
        row["epsilon"] = self.ledger.summary()["max_epsilon"] if accounted else float("nan")
        if accounted:  # e.g. distributed: the eps without amplification by sampling
            row.update(mode.other_epsilons(self.ledger))
        row["round_seconds"] = time.perf_counter() - start
        self.history.append(row)
        return row

    def _record_assignment(self, clusters: np.ndarray | None) -> None:
        """The round's cluster of each client (the server's assignment, or where clients choose,
        their choices: what the engine's ARI and clustering accuracy are computed from), for the
        report's assignment-per-round heatmap."""
        if clusters is not None and self.num_clients <= MAX_RECORDED_ASSIGNMENTS:
            self.assignment_history.append((self.round, np.asarray(clusters, dtype=np.int32)))

    def _charge(self, round: int, charges: list[Any]) -> None:
        for c in charges:
            self.ledger.charge(round, c.clients, c.mechanism, c.event, c.params)
        self.ledger.check_budget()  # never continue past the budget

    def _load_accountant_meanwhile(self) -> None:
        """The ledger's first charge loads dp_accounting: ~1.3 CPU-s (its PLD code loads
        scipy.signal and scipy.stats) between round 1's training and round 2, while every worker
        waits. Loaded in a thread while round 1 trains, it takes the CPU from the clients this
        process trains, and the actors take more of the round's pieces. Not for modes that
        charge nothing (none) or charge their own ledger (dprivacy)."""
        if not self.mode.accounts_epsilon or ACCOUNTING in sys.modules:
            return
        if not _accountant_loading.is_set():
            _accountant_loading.set()
            threading.Thread(
                target=importlib.import_module, args=(ACCOUNTING,), daemon=True
            ).start()

    def _hold_out(self, plan: RoundPlan) -> None:
        """``training.held_out_clients`` leave every plan, even one that waits for all: they
        are the clients the run is judged on, and never train. The held-out set is drawn
        without the data, so this thins the planned cohort and its accounting stays valid and
        conservative (as dropout's, ``privacy.sampling.unavailable``)."""
        if self.held_out is None or not plan.tasks:
            return
        ids = np.fromiter((t.client_id for t in plan.tasks), dtype=np.int64, count=len(plan.tasks))
        out = np.isin(ids, self.held_out)
        plan.tasks = [t for t, held in zip(plan.tasks, out, strict=True) if not held]

    def _drop_out(self, plan: RoundPlan) -> int | None:
        """``training.client_dropout``: the sampled clients unavailable this round leave the plan
        before anything runs (they neither train nor report, and nothing is charged to them);
        how many, or None where no client ever drops. A plan that waits for all loses none.
        Availability is drawn for the whole population every round, sampled or not, so that it
        can carry over from round to round (``training.dropout_correlation``)."""
        if self.dropout is None:
            return None
        rng = numpy_rng(self.cfg.seed, self.round, SERVER, "dropout")
        rho = self.cfg.training.dropout_correlation
        self.unavailable = unavailable(self.dropout, rng, self.unavailable, rho)  # every round
        if plan.waits_for_all or not plan.tasks:
            return 0
        keep = [t for t in plan.tasks if not self.unavailable[t.client_id]]
        dropped, plan.tasks = len(plan.tasks) - len(keep), keep
        return dropped

    def _skip_over_cap(self, plan: RoundPlan) -> int:
        """Under a leakage cap, a client whose next release would cross it sits the round out."""
        if self.metric_ledger.cap is None or not plan.models:
            return 0
        cost = self.mode.release_leakage(int(plan.models[0].numel()))
        keep = [t for t in plan.tasks if not self.metric_ledger.would_exceed(t.client_id, cost)]
        skipped, plan.tasks = len(plan.tasks) - len(keep), keep
        return skipped

    def evaluate(self) -> list[EvalReport]:
        """The clients' scores; none where they keep them apart (``judge`` is None)."""
        if self.eval_cohort is None:
            return self._run("evaluate", self.algorithm.plan_evaluation(self.state))
        plan = self.algorithm.plan_evaluation(self.state, clients=self.eval_cohort)
        return self._run("evaluate", plan)

    def snapshot(self) -> bytes:
        """A checkpoint's part: everything that changes between rounds, as data
        (``state.checkpoint.encode_state``). Random generators need no saving: every draw is
        keyed by (seed, round, client, purpose), so round r+1 after a restore draws exactly what
        it would have drawn in an uninterrupted run."""
        from raysim.state.checkpoint import encode_state

        return encode_state({k: getattr(self, k) for k in CHECKPOINT_FIELDS})

    def restore(self, blob: bytes) -> tuple[int, list[dict[str, Any]]]:
        """Continue from a snapshot; returns the last completed round and the history so far.
        Decoded under the allowlist of this run's algorithm: nothing else is loaded."""
        from raysim.state.checkpoint import decode_state

        saved = decode_state(blob, type(self.algorithm))
        judge = self.judge
        for k in CHECKPOINT_FIELDS:
            if k in saved or k not in LATER_FIELDS:
                setattr(self, k, saved[k])
        if "judge" not in saved and judge is not None:  # before the judge had a name
            judge.last, judge.best_loss = saved["last_eval"], saved["best_loss"]
            judge.stale = saved["stale_evals"]
        if "mode" not in saved and hasattr(self.algorithm, "privacy"):  # held by the algorithm
            self.mode = self.algorithm.privacy
        if judge is None:  # judged apart: a checkpoint's judge is not this server's to hold
            self.judge = None
        return self.round, list(self.history)

    def results(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "eval": [] if self.judge is None else self.judge.last,
            "assignments": self.algorithm.assignments(self.state),
            "assignment_history": self.assignment_history,
            "ledger_rows": self.ledger.rows(),
            "client_epsilon": self.ledger.epsilons(),
            "rounds_reported": self.rounds_reported.tolist(),
            "ledger_summary": self.ledger.summary(),
            "metric_ledger_rows": self.metric_ledger.rows(),
            "client_leakage": self.metric_ledger.totals_of(self.num_clients),
        }
