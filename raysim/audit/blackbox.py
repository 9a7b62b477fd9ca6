"""The black-box audit: the adversary sees only the final models of one real training run.

``sample`` mode (and ``none``, where it shows the leak): ``m`` input-space canaries, each a
seeded random input with a seeded label (mislabelled: nothing in the data predicts it), each
included with probability 1/2 (seeded by (seed, canary, purpose)) in the train set of a client
(spread over the clients, round robin over a seeded order). The configured experiment then
trains once through the engine's own in-process loop (``raysim.runtime.inline.inline_loop``: the
algorithm's client step, DP-SGD through Opacus at the mode's calibrated noise, the mode's
``admit`` and the server step), its noise calibrated for the train sets as they are. Each canary
is scored by minus the loss of its label under the final model its client is judged on (the
model the server would hand it: the released model); the one-run bound of Steinke, Nasr and
Jagielski (2023) is taken on those scores.

The claim is the largest epsilon the run's own ledger charged any client: each canary is one
example of one client, so each is protected at least that well.

``client`` and ``distributed`` are audited with canary CLIENTS instead (``raysim.audit.clients``:
an update of norm C along a fixed direction, scored by the final model's move along it).
``dprivacy`` and the multi-run black-box audit (R full trainings, one canary each) are not
built: the command refuses them (docs/audit.md says why).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from raysim.config import ConfigError
from raysim.data.federated import FederatedDataset, make_table
from raysim.data.sources import PIXEL_SCALE
from raysim.seeding import SERVER, numpy_rng

MODES = ("sample", "none")  # input-space canaries
CLIENT_MODES = ("client", "distributed")  # canary clients (raysim.audit.clients)
VIEW = "final models (black-box: the model each canary's client is judged on)"
CANARIES = 500  # default canaries, capped at half the population's train rows
CLAIM_NOTE = "the largest epsilon the run's ledger charged a client"


def check_request(mode: str, runs: int, participation: str) -> None:
    """Refuse what the black-box audit does not run, naming the flag or the field."""
    if mode not in MODES + CLIENT_MODES:
        raise ConfigError(
            f"privacy.mode: --adversary black-box audits {', '.join(MODES + CLIENT_MODES)}, "
            f"not {mode!r}: a black-box audit of metric DP needs canaries at a known distance "
            "in the final model, which is not built; use --adversary white-box for it "
            "(docs/audit.md)"
        )
    if runs != 1:
        raise ConfigError(
            f"--runs: --adversary black-box runs the one-run audit only (--runs 1), got {runs}: "
            "the multi-run black-box audit needs one full training per run (docs/audit.md)"
        )
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


def blackbox_audit(
    cfg: Any,
    prepare: Callable[[Any, FederatedDataset], Any],
    canaries: int | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    progress: Callable[[int], None] | None = None,
) -> tuple[Any, dict[str, np.ndarray], Any]:
    """Train the configured experiment once with canaries; returns (AuditResult, rows, prep).
    ``prepare(cfg, dataset)`` builds the algorithm on the population with the canaries in, so
    the mode calibrates its noise for the train sets as trained on."""
    from raysim.engine.experiment import build_dataset
    from raysim.runtime.inline import inline_loop

    check_request(cfg.privacy.mode, 1, "hidden")
    if cfg.privacy.mode in CLIENT_MODES:
        from raysim.audit.clients import canary_client_audit

        return canary_client_audit(cfg, prepare, canaries, seed, confidence, progress)
    t0 = time.perf_counter()
    base = build_dataset(cfg)
    m = default_canaries(base) if canaries is None else canaries
    if m < 2:
        raise ConfigError(f"--canaries: the one-run audit needs at least 2, got {m}")
    x, y = canary_inputs(base, m, seed)
    included, owner = membership(m, seed), owners(m, base.num_clients, seed)
    prep = prepare(cfg, with_canaries(base, x, y, included, owner))
    loop = inline_loop(prep, device="cpu", apart=False)
    for _ in range(cfg.rounds):
        row = loop.step()
        if progress:
            progress(1)
        if row.get("early_stopped"):
            break
    scores = final_scores(prep, loop, x, y, owner)
    result = one_run_result(prep, loop, scores, included, confidence, t0)
    rows = {"index": np.arange(m), "included": included, "score": scores, "client": owner}
    return result, rows, prep


def one_run_result(
    prep: Any,
    loop: Any,
    scores: np.ndarray,
    included: np.ndarray,
    confidence: float,
    started: float,
    note: str = CLAIM_NOTE,
    view: str = VIEW,
) -> Any:
    """The black-box one-run audit's result: Steinke, Nasr and Jagielski's bound on the canaries'
    ``scores`` against the largest epsilon the run's ledger charged (``note`` says so)."""
    from raysim.audit.bounds import one_run_bound
    from raysim.audit.run import AuditResult

    cfg = prep.cfg
    bound = one_run_bound(scores, included, cfg.privacy.delta, confidence)
    return AuditResult(
        mode=cfg.privacy.mode,
        method=bound.method,
        view=view,
        participation="hidden",
        claimed_epsilon=claimed_epsilon(prep, loop),
        lower_bound=bound.epsilon,
        confidence=confidence,
        delta=cfg.privacy.delta,
        canaries=len(scores),
        runs=1,
        seconds=time.perf_counter() - started,
        claim_note=note,
        guesses=bound.guesses,
        correct=bound.correct,
        adversary="black-box",
    )
