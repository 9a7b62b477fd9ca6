"""The black-box audit: the adversary sees only the final models of real training runs.

``sample`` mode (and ``none``, where it shows the leak): input-space canaries, mislabelled
inputs in the clients' train sets (``raysim.audit.inputs``). The configured experiment then
trains through the engine's own in-process loop (``raysim.audit.training``: the algorithm's
client step, DP-SGD through Opacus at the mode's calibrated noise, the mode's ``admit`` and the
server step), its noise calibrated for the train sets as they are.

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
from typing import Any

import numpy as np

from raysim.audit import CLIENT_MODES, INPUT_MODES, PAIR_MODES
from raysim.audit.inputs import InputCanaries, default_canaries
from raysim.audit.training import membership
from raysim.config import ConfigError
from raysim.data.federated import FederatedDataset
from raysim.seeding import SERVER, numpy_rng


def check_request(mode: str, runs: int, participation: str) -> None:
    """Refuse what the black-box audit does not run, naming the flag or the field."""
    known = INPUT_MODES + CLIENT_MODES + PAIR_MODES
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


def make_canaries(
    cfg: Any, base: FederatedDataset, m: int | None, seed: int, prepare: Callable[..., Any]
) -> Any:
    """The configured mode's canaries (``m`` None: its default count): input-space canaries,
    canary clients (add/remove), or canary clients releasing one of a pair (metric DP)."""
    mode = cfg.privacy.mode
    if mode in INPUT_MODES:
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
