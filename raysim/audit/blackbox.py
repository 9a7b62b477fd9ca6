"""The black-box audit: the adversary sees only the final models of real training runs.

``sample`` mode (and ``none``, where it shows the leak): input-space canaries, each a seeded
random input with a seeded label (mislabelled: nothing in the data predicts it), each included
with probability 1/2 (seeded by (seed, canary, purpose)) in the train set of a client (spread
over the clients, round robin over a seeded order). The configured experiment then trains
through the engine's own in-process loop (``raysim.runtime.inline.inline_loop``: the
algorithm's client step, DP-SGD through Opacus at the mode's calibrated noise, the mode's
``admit`` and the server step), its noise calibrated for the train sets as they are. Each canary
is scored by minus the loss of its label under the final model its client is judged on (the
model the server would hand it: the released model). The claim is the largest epsilon the run's
own ledger charged any client: each canary is one example of one client, so each is protected
at least that well.

``client`` and ``distributed`` are audited with canary CLIENTS instead, and ``dprivacy`` with
canary clients that release one of a pair of updates at a known distance
(``raysim.audit.clients``).

Two statistics over the same canaries and scores (``blackbox_audit``): ``runs == 1``, one
training with ``m`` canaries and the one-run bound of Steinke, Nasr and Jagielski (2023);
``runs > 1``, ``runs`` trainings with one canary each, in with probability 1/2, each training's
seeds drawn from (audit seed, run, purpose), and the multi-run bound (Clopper-Pearson on the
best threshold).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim.config import ConfigError
from raysim.data.federated import FederatedDataset, make_table
from raysim.data.sources import PIXEL_SCALE
from raysim.seeding import SERVER, numpy_rng

MODES = ("sample", "none")  # input-space canaries
CLIENT_MODES = ("client", "distributed")  # canary clients (raysim.audit.clients)
PAIR_MODES = ("dprivacy",)  # canary clients releasing one of a pair (raysim.audit.clients)
VIEW = "final models (black-box: the model each canary's client is judged on)"
CANARIES = 500  # default canaries, capped at half the population's train rows
CLAIM_NOTE = "the largest epsilon the run's ledger charged a client"


def check_request(mode: str, runs: int, participation: str) -> None:
    """Refuse what the black-box audit does not run, naming the flag or the field."""
    known = MODES + CLIENT_MODES + PAIR_MODES
    if mode not in known:
        raise ConfigError(
            f"privacy.mode: --adversary black-box audits {', '.join(known)}, not {mode!r}"
        )
    if runs < 1:
        raise ConfigError(f"--runs: a whole number >= 1, got {runs}")
    if participation != "hidden":
        raise ConfigError(
            "--participation: the black-box adversary sees the final models only, never who "
            "took part: leave --participation hidden with --adversary black-box"
        )


def default_canaries(ds: FederatedDataset) -> int:
    return int(min(CANARIES, int(np.sum(ds.train_sizes)) // 2))


def canary_inputs(ds: FederatedDataset, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``m`` random inputs as the population stores them (uint8 pixels or float32 features),
    each with a random label: mislabelled examples, memorised only where they were trained on."""
    if ds.task != "classification":
        raise ConfigError(
            f"data.dataset: the black-box audit's canaries are mislabelled examples; "
            f"{ds.dataset} is a {ds.task} task"
        )
    rng = numpy_rng(seed, 0, SERVER, "audit_canary_inputs")
    shape = (m, *ds.feature_shape)
    if ds.pixels is not None:
        top = ds.pixels.scale or PIXEL_SCALE[ds.pixels.dataset]
        # black-and-white noise: the largest spread the pixels allow, so the most to memorise
        x = (rng.integers(0, 2, size=shape) * int(top)).astype(np.uint8)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    y = rng.integers(0, ds.num_classes, size=m)
    return x, y


def membership(m: int, seed: int) -> np.ndarray:
    """Canary i is included with probability 1/2, drawn from its own (seed, i, purpose) key."""
    return np.array(
        [numpy_rng(seed, i, SERVER, "audit_canary_in").random() < 0.5 for i in range(m)]
    )


def owners(m: int, num_clients: int, seed: int) -> np.ndarray:
    """The client whose train set each canary joins: round robin over a seeded order, so every
    client holds m / num_clients of them (within one)."""
    order = numpy_rng(seed, 0, SERVER, "audit_canary_clients").permutation(m)
    out = np.empty(m, dtype=np.int64)
    out[order] = np.arange(m) % num_clients
    return out


def with_canaries(
    ds: FederatedDataset, x: np.ndarray, y: np.ndarray, included: np.ndarray, owner: np.ndarray
) -> FederatedDataset:
    """The population with each included canary appended to its owner's train rows."""
    raw_x = ds._x  # as stored: the canaries join in the same encoding
    raw_y = np.asarray(ds._y)
    source = ds.table.column("source_index").chunk(0).to_numpy(zero_copy_only=False)
    xs, ys, srcs, offsets, num_train = [], [], [], [0], []
    for c in range(ds.num_clients):
        lo, hi, n = ds.offsets[c], ds.offsets[c + 1], ds.num_train[c]
        mine = np.flatnonzero(included & (owner == c))
        xs += [raw_x[lo : lo + n], x[mine], raw_x[lo + n : hi]]
        ys += [raw_y[lo : lo + n], y[mine].astype(raw_y.dtype), raw_y[lo + n : hi]]
        srcs += [source[lo : lo + n], -1 - mine, source[lo + n : hi]]
        num_train.append(n + len(mine))
        offsets.append(offsets[-1] + (hi - lo) + len(mine))
    table = make_table(np.concatenate(xs), np.concatenate(ys), np.concatenate(srcs))
    return FederatedDataset(
        table=table,
        offsets=np.asarray(offsets),
        num_train=np.asarray(num_train),
        true_cluster=ds.true_cluster,
        feature_shape=ds.feature_shape,
        num_classes=ds.num_classes,
        task=ds.task,
        dataset=ds.dataset,
        meta=dict(ds.meta),
        pixels=ds.pixels,
    )


def final_scores(
    prep: Any, loop: Any, x: np.ndarray, y: np.ndarray, owner: np.ndarray
) -> np.ndarray:
    """Minus each canary's loss under the final model its client is judged on (a client that
    picks its model: the best of the released models), from the models alone."""
    import torch

    from raysim.models import build_from_spec, load_flat_

    ds = prep.dataset
    plan = prep.algorithm.plan_evaluation(loop.state)
    models = [m.detach().to("cpu", torch.float32) for m in plan.models]
    net = build_from_spec(prep.spec, ds.feature_shape, ds.num_classes)
    inputs = torch.from_numpy(ds.pixels.decode(x) if ds.pixels is not None else x)
    target = torch.as_tensor(y, dtype=torch.int64)
    losses = []
    with torch.no_grad():
        for weights in models:
            load_flat_(net, weights)
            net.eval()
            out = net(inputs)
            losses.append(torch.nn.functional.cross_entropy(out, target, reduction="none"))
    by_model = -torch.stack(losses).double().numpy() if losses else np.zeros((0, len(y)))
    return on_judged_models(prep, plan, by_model, owner)


def on_judged_models(prep: Any, plan: Any, by_model: np.ndarray, clients: np.ndarray) -> np.ndarray:
    """Each canary's score on the model its client is judged on (``by_model``: models x
    canaries; a client that picks its model: the best of the released models)."""
    tasks = {t.client_id: t for t in plan.tasks}
    scores = np.empty(len(clients))
    for i, c in enumerate(clients):
        task = tasks.get(int(c))
        if task is None or task.cluster is None:
            raise ConfigError(
                f"algorithm.name: {prep.cfg.algorithm.name} judges client {int(c)} on a personal "
                "model the server never holds: the black-box audit sees released models only"
            )
        scores[i] = by_model[:, i].max() if task.extra.get("select") else by_model[task.cluster, i]
    return scores


def claimed_epsilon(prep: Any, loop: Any) -> float:
    """The largest epsilon the run's ledger charged a client (inf where nothing is accounted)."""
    if not prep.mode.accounts_epsilon:
        return float("inf")
    return float(max(loop.ledger.epsilon(c) for c in range(loop.num_clients)))


@dataclass
class Trained:
    """One training with canaries: every canary's score, the claim the run's ledger makes for
    each canary, and what the rows add (``client``: the client each canary is or joins)."""

    scores: np.ndarray
    claimed: float
    prep: Any
    clients: np.ndarray


class InputCanaries:
    """``sample``, ``none``: ``m`` mislabelled inputs, each joining its owner's train rows where
    included; ``train`` runs one training with those included and scores every canary."""

    view = VIEW
    note = CLAIM_NOTE

    def __init__(
        self, base: FederatedDataset, m: int, seed: int, prepare: Callable[..., Any]
    ) -> None:
        self.base, self.prepare, self.m = base, prepare, m
        self.x, self.y = canary_inputs(base, m, seed)
        self.owner = owners(m, base.num_clients, seed)

    def train(
        self, cfg: Any, included: np.ndarray, progress: Callable[[int], None] | None
    ) -> Trained:
        ds = with_canaries(self.base, self.x, self.y, included, self.owner)
        prep = self.prepare(cfg, ds)
        loop = run_rounds(start_loop(prep), prep.cfg.rounds, progress)
        scores = final_scores(prep, loop, self.x, self.y, self.owner)
        return Trained(scores, claimed_epsilon(prep, loop), prep, self.owner)


def start_loop(
    prep: Any, make_worker: Callable[..., Any] | None = None, absent: np.ndarray | None = None
) -> Any:
    """The engine's in-process round loop for ``prep`` (``absent``: the clients unavailable
    every round, who leave each plan before it runs, the engine's path for a dropped client)."""
    from raysim.runtime.inline import inline_loop

    loop = inline_loop(prep, device="cpu", apart=False, make_worker=make_worker)
    if absent is not None:
        loop.dropout = absent if loop.dropout is None else np.maximum(loop.dropout, absent)
    return loop


def run_rounds(loop: Any, rounds: int, progress: Callable[[int], None] | None) -> Any:
    """The configured rounds (to an early stop); returns the loop."""
    for _ in range(rounds):
        row = loop.step()
        if progress:
            progress(1)
        if row.get("early_stopped"):
            break
    return loop


def make_canaries(
    cfg: Any, base: FederatedDataset, m: int | None, seed: int, prepare: Callable[..., Any]
) -> Any:
    """The configured mode's canaries (``m`` None: its default count): input-space canaries,
    canary clients (add/remove), or canary clients releasing one of a pair (metric DP)."""
    mode = cfg.privacy.mode
    if mode in MODES:
        return InputCanaries(base, default_canaries(base) if m is None else m, seed, prepare)
    from raysim.audit.clients import CanaryClients, PairCanaryClients

    cls = CanaryClients if mode in CLIENT_MODES else PairCanaryClients
    return cls(cfg, base, m, seed, prepare)


def run_config(cfg: Any, seed: int, run: int) -> Any:
    """Run ``run``'s config of the multi-run audit: the run's seed (the server's draws: sampling,
    initialisation, the central noise) and, where the server is untrusted, the clients' seed
    (their DP-SGD noise and batches, noise shares, d-private noise), each from (audit seed, run,
    purpose) in place of the config's, so that the runs are independent."""
    from raysim.config import with_client_seed
    from raysim.privacy.modes import mode_class

    run_seed = int(numpy_rng(seed, run, SERVER, "audit_run_seed").integers(2**31))
    out = cfg.model_copy(update={"seed": run_seed})
    clients = None
    if not mode_class(cfg.privacy.mode).trusted_server:
        clients = int(numpy_rng(seed, run, SERVER, "audit_run_client_seed").integers(2**63))
    return with_client_seed(out, clients)


def run_membership(runs: int, seed: int) -> np.ndarray:
    """Run r of the multi-run audit has its canary in with probability 1/2, from its own (seed,
    r, purpose) key."""
    return np.array(
        [numpy_rng(seed, r, SERVER, "audit_run_in").random() < 0.5 for r in range(runs)]
    )


def blackbox_audit(
    cfg: Any,
    prepare: Callable[[Any, FederatedDataset], Any],
    canaries: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    progress: Callable[[int], None] | None = None,
    runs: int = 1,
) -> tuple[Any, dict[str, np.ndarray], Any]:
    """The black-box audit; returns (AuditResult, rows, prep of the last training).
    ``runs == 1``: one training with ``canaries`` canaries (``progress`` per round);
    ``runs > 1``: ``runs`` trainings with one canary each (``progress`` per run).
    ``prepare(cfg, dataset)`` builds the algorithm on the population with the canaries in, so
    the mode calibrates its noise for the population as trained on."""
    from raysim.audit.bounds import multi_run_bound, one_run_bound
    from raysim.engine.experiment import build_dataset

    check_request(cfg.privacy.mode, runs, "hidden")
    t0 = time.perf_counter()
    if runs > 1 and canaries not in (None, 1):
        raise ConfigError(
            f"--canaries: the multi-run audit (--runs > 1) puts 1 canary in each run, got "
            f"{canaries}"
        )
    if runs == 1 and canaries is not None and canaries < 2:
        raise ConfigError(f"--canaries: the one-run audit needs at least 2, got {canaries}")
    base = build_dataset(cfg)
    delta = cfg.privacy.delta
    if runs == 1:
        made = make_canaries(cfg, base, canaries, seed, prepare)
        included = membership(made.m, seed)
        trained = made.train(cfg, included, progress)
        scores, claimed, prep = trained.scores, trained.claimed, trained.prep
        bound = one_run_bound(scores, included, delta, confidence)
        rows = {"index": np.arange(len(scores)), "included": included, "score": scores}
        rows["client"] = trained.clients
    else:
        made = make_canaries(cfg, base, 1, seed, prepare)
        included = run_membership(runs, seed)
        if included.all() or not included.any():
            raise ConfigError(f"--runs: {runs} runs gave no run without (or with) the canary")
        scores, claims = np.empty(runs), np.empty(runs)
        for r in range(runs):
            trained = made.train(run_config(cfg, seed, r), included[r : r + 1], None)
            scores[r], claims[r], prep = trained.scores[0], trained.claimed, trained.prep
            if progress:
                progress(1)
        claimed = float(claims.max())
        bound = multi_run_bound(scores[included], scores[~included], delta, confidence)
        rows = {"index": np.arange(runs), "included": included, "score": scores}
    return result_of(prep, made, bound, claimed, runs, made.m, t0), rows, prep


def result_of(
    prep: Any, made: Any, bound: Any, claimed: float, runs: int, canaries: int, started: float
) -> Any:
    """The black-box audit's result: the bound on the canaries' scores against the claim the
    runs' ledgers made (``made.note`` says which), seen as ``made.view``."""
    from raysim.audit.run import AuditResult

    cfg = prep.cfg
    return AuditResult(
        mode=cfg.privacy.mode,
        method=bound.method,
        view=made.view,
        participation="hidden",
        claimed_epsilon=claimed,
        lower_bound=bound.epsilon,
        confidence=bound.confidence,
        delta=bound.delta,
        canaries=canaries,
        runs=runs,
        seconds=time.perf_counter() - started,
        claim_note=made.note,
        threshold=bound.threshold,
        guesses=bound.guesses,
        correct=bound.correct,
        adversary="black-box",
    )
