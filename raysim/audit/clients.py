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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from raysim.audit.blackbox import CLAIM_NOTE, membership, on_judged_models, one_run_result
from raysim.audit.canaries import directions
from raysim.config import ConfigError
from raysim.data.federated import FederatedDataset, make_table
from raysim.runtime.worker import ClientWorker
from raysim.training.config import TrainResult

MODES = ("client", "distributed")
VIEW = "final models (black-box: the move of each canary client's model along its direction)"
CANARIES = 500  # default canary clients, capped at the model's dimension (orthogonal directions)


def default_canaries(dim: int) -> int:
    return int(min(CANARIES, dim))


def check_config(cfg: Any, num_clients: int, m: int) -> None:
    """Refuse what the canary clients cannot audit soundly, naming the field."""
    if cfg.privacy.mode not in MODES:
        raise ConfigError(f"privacy.mode: canary clients audit {' and '.join(MODES)} only")
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
    prep: Any, initial: Sequence[torch.Tensor], final: Any, u: np.ndarray, ids: np.ndarray
) -> np.ndarray:
    """Each canary's cosine of its final model's move (final - initial) with its direction
    (the columns of ``u``); ``final``: the algorithm's evaluation plan after the run."""
    if len(final.models) != len(initial):
        raise ConfigError(
            f"algorithm.name: {prep.cfg.algorithm.name} ends with {len(final.models)} models "
            f"from {len(initial)}: a canary's move needs the model it started from"
        )
    moves = [
        (m.detach().double().cpu() - i.detach().double().cpu()).numpy()
        for m, i in zip(final.models, initial, strict=True)
    ]
    norms = [max(float(np.linalg.norm(v)), 1e-300) for v in moves]
    cosines = np.stack([v @ u / n for v, n in zip(moves, norms, strict=True)])  # (models, m)
    return on_judged_models(prep, final, cosines, ids)


def canary_client_audit(
    cfg: Any,
    prepare: Callable[[Any, FederatedDataset], Any],
    canaries: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    progress: Callable[[int], None] | None = None,
) -> tuple[Any, dict[str, np.ndarray], Any]:
    """Train the configured experiment once with canary clients; returns (AuditResult, rows,
    prep). ``prepare(cfg, dataset)`` builds the algorithm on the population with every canary
    slot in, so the mode calibrates for N + m clients whichever canaries are in."""
    from raysim.engine.experiment import build_dataset, initial_weights
    from raysim.runtime.inline import inline_loop

    t0 = time.perf_counter()
    base = build_dataset(cfg)
    dim = int(initial_weights(cfg, base).numel())
    m = default_canaries(dim) if canaries is None else canaries
    if m < 2:
        raise ConfigError(f"--canaries: the one-run audit needs at least 2, got {m}")
    if m > dim:
        raise ConfigError(
            f"--canaries: {m} orthogonal canary directions need a model of dimension >= {m}; "
            f"this one has {dim}"
        )
    n = base.num_clients
    check_config(cfg, n + m, m)
    included = membership(m, seed)
    ids = np.arange(n, n + m)
    u = directions(dim, m, seed)
    clip = cfg.privacy.clip
    updates = {
        int(c): torch.from_numpy(clip * u[:, i]).float() for i, c in enumerate(ids) if included[i]
    }
    prep = prepare(cfg, with_canary_clients(base, m))

    def make_worker(*args: Any) -> CanaryWorker:
        return CanaryWorker(*args, canaries=updates)

    loop = inline_loop(prep, device="cpu", apart=False, make_worker=make_worker)
    absent = np.zeros(loop.num_clients)
    absent[ids[~included]] = 1.0
    # the excluded canaries are unavailable every round: they leave each plan before it runs
    loop.dropout = absent if loop.dropout is None else np.maximum(loop.dropout, absent)
    initial = [w.detach().clone() for w in prep.algorithm.plan_evaluation(loop.state).models]
    for _ in range(cfg.rounds):
        row = loop.step()
        if progress:
            progress(1)
        if row.get("early_stopped"):
            break
    took_part = loop.rounds_reported[ids]
    if np.any(took_part[~included]) or not np.any(took_part[included]):
        raise ConfigError(
            f"algorithm.name: {cfg.algorithm.name} did not leave the excluded canary clients out "
            "of its rounds (or took no included one): its plans wait for every client"
        )
    final = prep.algorithm.plan_evaluation(loop.state)
    scores = final_scores(prep, initial, final, u, ids)
    note = CLAIM_NOTE
    if cfg.privacy.mode == "distributed":
        note += " (amplified by sampling: the final models do not show who took part)"
    result = one_run_result(prep, loop, scores, included, confidence, t0, note, VIEW)
    rows = {"index": np.arange(m), "included": included, "score": scores, "client": ids}
    return result, rows, prep
