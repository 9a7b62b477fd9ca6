"""The black-box audit of the client-level modes (``client``, ``distributed``): canary CLIENTS in
one real training run, scored from the final models only (Andrew et al. 2024, "One-shot
empirical privacy estimation for federated learning"; the bound of Steinke, Nasr and Jagielski
2023).

Canaries. ``m`` canary clients; canary i owns a direction u_i (``m`` orthonormal directions of
the model's parameter space from the audit's seed, ``canaries.directions``: isotropic, and
orthogonal so that no canary moves another's score). In every round it takes part in, a canary
client's update is ``privacy.clip * u_i``, whatever model it was sent: its local training is
replaced by that vector (``CanaryWorker``, in the worker, before the mode sees it), and the mode
releases it like any client's (``client``: sent, clipped by the server, summed under its noise;
``distributed``: clipped into its secure slot, with its noise share). An update of norm C along
a fixed direction moves the model as far as any client may, every round the same way: the
strongest canary a model-only adversary has (Nasr et al. 2023; Andrew et al. 2024).

Population. The mode calibrates for the config's N clients plus all ``m`` canary slots, before
the run: the noise multiplier, the sampling rate, the noise cohort (``distributed``: the
population N + m unless ``privacy.population`` says more) and FedAvg's divisor (q (N + m)) are
fixed whichever canaries are in. Canary i is in with probability 1/2, from its own (seed, i,
purpose) key (``blackbox.membership``). An excluded canary never takes part: it leaves every
round's plan before anything runs, the engine's path for an unavailable client
(``training.client_dropout``, at rate 1 for it): it trains nothing, sends nothing, adds no
noise share, and nothing is charged to it. With the mechanism's parameters fixed, a client that
never takes part and one that does not exist give every release the same distribution, so the
runs with and without canary i are neighbours under add/remove of one client, the relation the
modes account Poisson sampling under. A fixed-size cohort (``training.sampling:
without_replacement``) is accounted under replace-one, for which an absent canary is not a
neighbour: refused.

Score: the cosine of the move of the canary's final model (final - initial, the model its
client is judged on; a client that picks its model: the largest over the released models) with
u_i. The one-run bound is taken on those scores, as for the input-space canaries.

Claim: the largest epsilon the run's ledger charged a client (every client, canaries included,
is charged the same population-wide events). The adversary sees the final models, never who
took part: under ``distributed`` that is the eps amplified by sampling, as the ledger charges.

Metric DP (``dprivacy``, ``PairCanaryClients``): the leakage is eps per unit distance between two
updates of one norm r (the mode's noise scale follows the update's norm: n / (nu r) per release),
so there is no absent neighbour to compare with. Canary i owns a pair u0_i, u1_i of norm r at a
known distance d (from 2m orthonormal directions a_i, b_i: h a_i -+ (d / 2) b_i), takes part like
any client, and releases u1_i (its bit: "in") or u0_i (with probability 1/2 each, from its own
key) through the mode every round it takes part; score: the final model's move projected on
(u1_i - u0_i) / d = b_i. The claim is the metric ledger's leakage for the canary, per unit of its
norm, times d (as the white-box target scales it); d is chosen so that the claim is the config's
``privacy.epsilon`` over the rounds planned (at most 2r). Since d / r is fixed by the claim, the
norm r only scales the canaries against the other clients: ``RADIUS`` makes them dwarf the other
clients' updates, the strongest pair a model-only adversary has.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from raysim.audit import CLIENT_MODES, PAIR_MODES
from raysim.audit.canaries import directions
from raysim.audit.training import (
    CLAIM_NOTE,
    Trained,
    claimed_epsilon,
    on_judged_models,
    run_rounds,
    start_loop,
)
from raysim.config import ConfigError
from raysim.data.federated import FederatedDataset, make_table
from raysim.runtime.worker import ClientWorker
from raysim.training.config import TrainResult

VIEW = "final models (black-box: the move of each canary client's model along its direction)"
PAIR_VIEW = (
    "final models (black-box: the move of each canary client's model along the difference of "
    "its pair)"
)
CANARIES = 500  # default canary clients, capped at what orthogonal directions the model fits
RADIUS = 1e6  # the pair canaries' norm: the distance scales with it, the others' updates do not
DEFAULT_CLAIM = 2.0  # the pair canaries' claim where privacy.epsilon is not set (as white-box)


def check_config(cfg: Any, num_clients: int, m: int) -> None:
    """Refuse what the canary clients cannot audit soundly, naming the field."""
    if cfg.privacy.mode not in CLIENT_MODES:
        raise ConfigError(f"privacy.mode: canary clients audit {' and '.join(CLIENT_MODES)} only")
    if cfg.training.sampling != "poisson":
        raise ConfigError(
            "training.sampling: the canary-client audit includes or leaves out whole clients "
            "(add/remove); a fixed cohort (without_replacement) is accounted under replace-one: "
            "use poisson"
        )
    population = cfg.privacy.population
    if cfg.privacy.mode == "distributed" and population is not None and population < num_clients:
        raise ConfigError(
            f"privacy.population={population}: the audit adds {m} canary clients to the "
            f"config's {num_clients - m}; set it to at least {num_clients} or leave it out"
        )


def with_canary_clients(ds: FederatedDataset, m: int) -> FederatedDataset:
    """The population with ``m`` canary clients appended (ids N .. N + m - 1). Canary j holds a
    copy of one train row and one test row of real client j mod N (its training is replaced,
    so its rows only give it a size and something to be evaluated on) and that client's true
    cluster."""
    raw_x, raw_y = ds._x, np.asarray(ds._y)  # as stored: the copies keep the encoding
    source = ds.table.column("source_index").chunk(0).to_numpy(zero_copy_only=False)
    n = ds.num_clients
    rows, num_train, truth = [], [], []
    for j in range(m):
        c = j % n
        lo, hi, k = int(ds.offsets[c]), int(ds.offsets[c + 1]), int(ds.num_train[c])
        if k == 0:
            raise ConfigError(f"data: client {c} has no train rows to give a canary client")
        picked = [lo] + ([lo + k] if hi > lo + k else [])
        rows.append(picked)
        num_train.append(1)
        truth.append(int(ds.true_cluster[c]))
    extra = np.asarray([r for picked in rows for r in picked], dtype=np.int64)
    sizes = np.asarray([len(p) for p in rows], dtype=np.int64)
    table = make_table(
        np.concatenate([raw_x, raw_x[extra]]),
        np.concatenate([raw_y, raw_y[extra]]),
        np.concatenate([source, source[extra]]),
    )
    return FederatedDataset(
        table=table,
        offsets=np.concatenate([ds.offsets, ds.offsets[-1] + np.cumsum(sizes)]),
        num_train=np.concatenate([ds.num_train, np.asarray(num_train, dtype=np.int64)]),
        true_cluster=np.concatenate([ds.true_cluster, np.asarray(truth, dtype=np.int64)]),
        feature_shape=ds.feature_shape,
        num_classes=ds.num_classes,
        task=ds.task,
        dataset=ds.dataset,
        meta=dict(ds.meta),
        pixels=ds.pixels,
    )


class CanaryTrainer:
    """A worker's trainer as one canary client sees it: every training returns the canary's
    fixed update (evaluation and everything else: the worker's own trainer)."""

    def __init__(self, inner: Any, update: torch.Tensor) -> None:
        self._inner, self._update = inner, update

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _result(self, x: np.ndarray) -> TrainResult:
        update = self._update.clone()
        return TrainResult(update, len(x), 0, float("nan"), float(update.norm()))

    def train(self, weights: Any, x: np.ndarray, y: np.ndarray, *args: Any, **kw: Any) -> Any:
        return self._result(x)

    def train_one(self, weights: Any, x: np.ndarray, y: np.ndarray, *args: Any) -> Any:
        return self._result(x)

    def train_many(
        self, weights: Sequence[Any], data: Sequence[tuple[np.ndarray, np.ndarray]], *args: Any
    ) -> list[TrainResult]:
        return [self._result(x) for x, _ in data]


class CanaryWorker(ClientWorker):
    """The in-process worker with canary clients: each canary client runs the algorithm's own
    client step alone, on a trainer that returns its fixed update, so the mode releases that
    update as it releases any client's; the other clients run as on any worker."""

    def __init__(self, *args: Any, canaries: dict[int, torch.Tensor]) -> None:
        super().__init__(*args)
        self.canaries = canaries

    def _run(self, kind: str, round: int, broadcast: list[Any], groups: list[list[Any]]) -> list:
        if kind != "train":
            return super()._run(kind, round, broadcast, groups)
        out: list[Any] = []
        for group in groups:
            plain = [t for t in group if t.client_id not in self.canaries]
            if plain:
                out.extend(super()._run(kind, round, broadcast, [plain]))
            for t in group:
                if t.client_id not in self.canaries:
                    continue
                own = self.trainer
                self.trainer = CanaryTrainer(own, self.canaries[t.client_id])
                try:
                    out.extend(super()._run(kind, round, broadcast, [[t]]))
                finally:
                    self.trainer = own
        return out


def final_scores(
    prep: Any,
    initial: Sequence[torch.Tensor],
    final: Any,
    u: np.ndarray,
    ids: np.ndarray,
    cosine: bool = True,
) -> np.ndarray:
    """Each canary's cosine (``cosine``; else the projection) of its final model's move (final -
    initial) with its direction (the columns of ``u``); ``final``: the algorithm's evaluation
    plan after the run."""
    if len(final.models) != len(initial):
        raise ConfigError(
            f"algorithm.name: {prep.cfg.algorithm.name} ends with {len(final.models)} models "
            f"from {len(initial)}: a canary's move needs the model it started from"
        )
    moves = [
        (m.detach().double().cpu() - i.detach().double().cpu()).numpy()
        for m, i in zip(final.models, initial, strict=True)
    ]
    norms = [max(float(np.linalg.norm(v)), 1e-300) if cosine else 1.0 for v in moves]
    scores = np.stack([v @ u / n for v, n in zip(moves, norms, strict=True)])  # (models, m)
    return on_judged_models(prep, final, scores, ids)


class CanaryClients:
    """``client``, ``distributed``: ``m`` canary clients (ids N .. N + m - 1) in a population
    calibrated for N + m; ``train`` runs one training with the included ones taking part and
    the others absent, and scores each by the cosine of its model's move with its direction."""

    view = VIEW
    note = CLAIM_NOTE
    limit = 1  # canaries per dimension: one direction each

    def __init__(
        self,
        cfg: Any,
        base: FederatedDataset,
        m: int | None,
        seed: int,
        prepare: Callable[[Any, FederatedDataset], Any],
    ) -> None:
        from raysim.engine.experiment import initial_weights

        dim = int(initial_weights(cfg, base).numel())
        most = dim // self.limit
        self.m = int(min(CANARIES, most)) if m is None else m
        if self.m > most:
            raise ConfigError(
                f"--canaries: {self.m} canary clients need {self.limit * self.m} orthogonal "
                f"directions, more than this model's dimension ({dim})"
            )
        n = base.num_clients
        self.check(cfg, n + self.m)
        self.prepare, self.seed, self.dim = prepare, seed, dim
        self.clients = np.arange(n, n + self.m)
        self.population = with_canary_clients(base, self.m)
        self.u = directions(dim, self.limit * self.m, seed)

    def check(self, cfg: Any, num_clients: int) -> None:
        check_config(cfg, num_clients, self.m)

    def updates(self, cfg: Any, prep: Any, included: np.ndarray) -> dict[int, torch.Tensor]:
        """Each taking-part canary client's fixed update: C along its direction."""
        clip = cfg.privacy.clip
        return {
            int(c): torch.from_numpy(clip * self.u[:, i]).float()
            for i, c in enumerate(self.clients)
            if included[i]
        }

    def train(
        self, cfg: Any, included: np.ndarray, progress: Callable[[int], None] | None
    ) -> Trained:
        ids = self.clients
        prep = self.prepare(cfg, self.population)
        loop, initial = self.run(prep, self.updates(cfg, prep, included), ids[~included], progress)
        took_part = loop.rounds_reported[ids]
        if np.any(took_part[~included]) or (np.any(included) and not np.any(took_part[included])):
            raise ConfigError(
                f"algorithm.name: {cfg.algorithm.name} did not leave the excluded canary clients "
                "out of its rounds (or took no included one): its plans wait for every client"
            )
        scores = final_scores(
            prep, initial, prep.algorithm.plan_evaluation(loop.state), self.u, ids
        )
        return Trained(scores, claimed_epsilon(prep, loop), prep, ids)

    def run(
        self,
        prep: Any,
        updates: dict[int, torch.Tensor],
        absent: np.ndarray,
        progress: Callable[[int], None] | None,
    ) -> tuple[Any, list[torch.Tensor]]:
        """The configured rounds with the canary clients' updates, ``absent`` left out of every
        round; returns the loop and the models the run started from."""

        def make_worker(*args: Any) -> CanaryWorker:
            return CanaryWorker(*args, canaries=updates)

        gone = np.zeros(prep.dataset.num_clients)
        gone[absent] = 1.0
        loop = start_loop(prep, make_worker, gone if len(absent) else None)
        initial = [w.detach().clone() for w in prep.algorithm.plan_evaluation(loop.state).models]
        return run_rounds(loop, prep.cfg.rounds, progress), initial


class PairCanaryClients(CanaryClients):
    """``dprivacy``: ``m`` canary clients, each releasing u1 (its bit set) or u0 of its pair
    every round it takes part; scored by the final model's move projected on (u1 - u0) / d."""

    view = PAIR_VIEW
    limit = 2  # canaries per dimension: two directions each (a_i, b_i)

    def check(self, cfg: Any, num_clients: int) -> None:
        if cfg.privacy.mode not in PAIR_MODES:
            raise ConfigError(f"privacy.mode: pair canaries audit {' and '.join(PAIR_MODES)} only")

    def distance(self, cfg: Any, prep: Any) -> float:
        """The distance at which the planned leakage (n / nu per release at norm ``RADIUS``,
        over the releases a client makes) is ``privacy.epsilon``; at most the diameter 2r."""
        mode = prep.mode
        releases = mode.releases_per_client(self.dim) or cfg.rounds
        per_unit = releases * mode.release_leakage(self.dim) / RADIUS
        return min((cfg.privacy.epsilon or DEFAULT_CLAIM) / per_unit, 2 * RADIUS)

    def updates(self, cfg: Any, prep: Any, included: np.ndarray) -> dict[int, torch.Tensor]:
        """Canary i's update: h a_i + (d / 2) b_i where its bit is set, h a_i - (d / 2) b_i where
        not (both of norm r = ``RADIUS``)."""
        d = self.distance(cfg, prep)
        h = math.sqrt(RADIUS**2 - (d / 2) ** 2)
        a, b = self.u[:, : self.m], self.u[:, self.m :]
        sign = np.where(included, 1.0, -1.0)
        pairs = h * a + (d / 2) * sign * b
        return {int(c): torch.from_numpy(pairs[:, i]).float() for i, c in enumerate(self.clients)}

    def train(
        self, cfg: Any, included: np.ndarray, progress: Callable[[int], None] | None
    ) -> Trained:
        ids = self.clients
        prep = self.prepare(cfg, self.population)
        loop, initial = self.run(prep, self.updates(cfg, prep, included), ids[:0], progress)
        final = prep.algorithm.plan_evaluation(loop.state)
        scores = final_scores(prep, initial, final, self.u[:, self.m :], ids, cosine=False)
        d = self.distance(cfg, prep)
        leakage = max(loop.metric_ledger.total(int(c)) for c in ids)
        self.note = (
            f"metric: the canary clients' largest ledger leakage ({leakage:.4g}) per unit of "
            f"their updates' norm ({RADIUS:g}), times their distance ({d:.4g})"
        )
        return Trained(scores, leakage / RADIUS * d, prep, ids)
