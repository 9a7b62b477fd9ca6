"""Canaries and the adversary's view, per privacy mode: each target runs the mode's own release
path (``release_update``, ``admit``, ``noisy_sum``, Opacus' DP-SGD step at the mode's noise) on
a cohort with and without canaries, and scores every canary from what the mode lets the server
see, nothing else.

The white-box adversary knows everything but the canaries' inclusion: the other clients'
updates (synthetic vectors of the model's dimension, seeded, some above the clip), the canary
directions, the mechanism. Scores are oriented so that a higher score means "included":

* ``client``: a canary client sends ``BOOST`` times the clip along its direction (the mode's
  clipping brings it to C); the view is the released noisy sum (``noisy_sum``); score: its
  projection on the direction, less the others' known clipped sum, in units of C.
* ``distributed``: the same canary client, through ``release_update`` (its secure slot) and
  ``admit``; the view is what ``admit`` returns (``SecureReports``: the slot's noisy sum; a list of
  messages, if a mode let them through: their sum).
* ``sample``: a per-sample gradient canary of ``BOOST`` C along its direction, added to a
  client's DP-SGD steps (each step w.p. the client's Poisson rate) before Opacus' per-sample
  clipping; the view is every step's noisy summed gradient (Opacus ``clip_and_accumulate`` and
  ``add_noise`` at the mode's multiplier and clip); score: the sum over steps of its projection.
* ``dprivacy``: two inputs of one norm r at a known distance; the client's release of one or
  the other (``release_update``); score: the log-likelihood-ratio statistic
  ``||y - x_out|| - ||y - x_in||``.
* ``none``: the canary client's raw update, as admitted.

Participation: under client sampling a canary that is "in" takes part in a round with the
engine's sampling probability (``hidden``: the adversary is not told, so amplification applies)
or always (``told``: it is told who took part, and the claim is the unamplified one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from raysim.privacy import PrivacyLedger, clip_l2
from raysim.privacy.view import SecureReports
from raysim.protocol import ClientReport, ClientTask, Message, RoundPlan
from raysim.seeding import SERVER, numpy_rng, torch_generator

BOOST = 2.0  # a canary's raw norm, in clips: what the mode's clipping must bring down to C
OTHERS = 8  # the cohort's other clients (their updates are known to the white-box adversary)
ROUND = 1  # the release audited: the run's first


def directions(dim: int, m: int, seed: int) -> np.ndarray:
    """``m`` orthonormal canary directions in R^dim (columns), seeded: orthogonal, so that one
    canary's inclusion moves no other canary's score."""
    if m > dim:
        raise ValueError(f"{m} orthogonal canaries need a model of dimension >= {m}, got {dim}")
    g = numpy_rng(seed, 0, SERVER, "audit_directions").standard_normal((dim, m))
    q, _ = np.linalg.qr(g)
    return q[:, :m]


@dataclass
class Target:
    """One mode's mechanism as the audit drives it: ``scores(included, run)`` makes one release
    with canary i included where ``included[i]`` and returns every canary's score; ``claimed``
    is the ledger's epsilon for that release (from the mode's own charges)."""

    mode: Any
    dim: int
    seed: int
    participation: str = "hidden"
    view: str = ""
    claim_note: str = ""
    charges: list = field(default_factory=list)

    def rng(self, run: int, purpose: str) -> np.random.Generator:
        return numpy_rng(self.seed, run, SERVER, f"audit_{purpose}")

    def takes_part(self, included: np.ndarray, rate: float, run: int) -> np.ndarray:
        if self.participation == "told" or rate >= 1:
            return included
        return included & (self.rng(run, "participation").random(len(included)) < rate)

    def ledger_epsilon(self) -> float:
        p = self.mode.privacy
        ledger = PrivacyLedger(delta=p.delta, accountant=p.accountant)
        for c in self.charges:
            ledger.charge(ROUND, c.clients, c.mechanism, c.event, c.params)
        clients = [c.clients for c in self.charges if c.clients]
        return ledger.epsilon(clients[0][0] if clients else None)

    def unamplified(self, multiplier: float) -> float:
        """The eps of one Gaussian release at ``multiplier`` (std over sensitivity), from the
        library's accountant: what an adversary told who took part faces."""
        from raysim import privacy as privacy_lib
        from raysim.privacy.events import dp_event

        p = self.mode.privacy
        return privacy_lib.epsilon(dp_event.GaussianDpEvent(multiplier), p.delta, p.accountant)


class CentralTarget(Target):
    """``client``: the trusted server's released noisy sum."""

    def __init__(self, mode, dim, seed, m, participation="hidden"):
        super().__init__(mode, dim, seed, participation)
        self.view = "released noisy sum (noisy_sum)"
        self.u = directions(dim, m, seed)
        self.clip = mode.clip
        others = numpy_rng(seed, 0, SERVER, "audit_others").standard_normal((OTHERS, dim))
        self.others = others * (self.clip * 1.5 / math.sqrt(dim))
        self.known = clip_l2(self.others, self.clip).sum(0)
        self.rate = mode.plan.sampling_rate

    def scores(self, included: np.ndarray, run: int) -> np.ndarray:
        part = self.takes_part(included, self.rate, run)
        canaries = BOOST * self.clip * self.u[:, part].T
        rows = np.concatenate([self.others, canaries])
        updates = [torch.from_numpy(r) for r in rows]
        released = self.mode.noisy_sum(
            updates, self.mode.sensitivity(), self.rng(run, "noise"), self.dim
        )
        charges = self.mode.server_charges(ROUND)
        if not self.charges:
            self.charges = charges
        return (released.double().numpy() - self.known) @ self.u / self.clip

    def claimed(self) -> float:
        if self.participation == "told" and self.rate < 1:
            self.claim_note = "Gaussian at the sum's multiplier, without amplification"
            return self.unamplified(self.mode.plan.noise)
        return self.ledger_epsilon()


class SecureTarget(Target):
    """``distributed``: what ``admit`` hands the server (the secure sums)."""

    def __init__(self, mode, dim, seed, m, participation="hidden"):
        super().__init__(mode, dim, seed, participation)
        self.view = "secure sums (admit)"
        self.u = directions(dim, m, seed)
        self.clip = mode.privacy.clip
        others = numpy_rng(seed, 0, SERVER, "audit_others").standard_normal((OTHERS, dim))
        self.others = others * (self.clip * 1.5 / math.sqrt(dim))
        self.known = clip_l2(self.others, self.clip).sum(0)
        self.rate = mode.cfg.training.sampling_rate
        self.model = torch.zeros(dim)

    def _report(self, client: int, update: np.ndarray, run: int) -> tuple[ClientReport, ClientTask]:
        task = ClientTask(client, cluster=0, clip=self.mode.clip if self.mode.adaptive else None)
        report = ClientReport(client)
        result = SimpleNamespace(update=torch.from_numpy(update))
        ctx = SimpleNamespace(
            rng=lambda purpose: numpy_rng(self.seed, run, client, purpose), models=[self.model]
        )
        self.mode.release_update(report, task, result, ctx)
        return report, task

    def scores(self, included: np.ndarray, run: int) -> np.ndarray:
        part = self.takes_part(included, self.rate, run)
        rows = list(self.others) + list(BOOST * self.clip * self.u[:, part].T)
        made = [self._report(c, r, run) for c, r in enumerate(rows)]
        plan = RoundPlan([t for _, t in made], [self.model], round=ROUND)
        reports = [r for r, _ in made]
        view = self.mode.admit("audit", plan, reports, self.rng(run, "noise"))
        charges = self.mode.charges(ROUND, reports)
        if not self.charges:
            self.charges = charges
        return (seen_sum(view, self.dim) - self.known) @ self.u / self.clip

    def claimed(self) -> float:
        if self.participation == "told":
            from raysim.privacy.modes.secure import contribution_sensitivity

            sens = contribution_sensitivity(self.clip, self.mode.adaptive)
            self.claim_note = "Gaussian at the real sum's std, without amplification"
            return self.unamplified(self.mode.std_at(self.clip) / sens)
        return self.ledger_epsilon()


def seen_sum(view: Any, dim: int) -> np.ndarray:
    """The sum of every vector the server was handed: a secure sum's slots, or messages."""
    total = np.zeros(dim)
    if isinstance(view, SecureReports):
        for s in view.sums.sums if view.sums is not None else []:
            total += s.double().numpy()
        for msg in view:
            total += np.asarray(msg.update, dtype=np.float64)[:dim]
        return total
    for msg in view:
        if isinstance(msg, Message) and msg.update is not None:
            total += torch.as_tensor(msg.update).double().numpy()
    return total


class MessageTarget(Target):
    """``none``: the canary client's update as admitted (no noise: the leak)."""

    def __init__(self, mode, dim, seed, m, participation="hidden"):
        super().__init__(mode, dim, seed, participation)
        self.view = "admitted messages (raw updates)"
        self.u = directions(dim, m, seed)
        self.clip = mode.privacy.clip

    def scores(self, included: np.ndarray, run: int) -> np.ndarray:
        reports, tasks = [], []
        for i in np.flatnonzero(included):
            report, task = ClientReport(int(i)), ClientTask(int(i), cluster=0)
            update = torch.from_numpy(self.clip * self.u[:, i])
            self.mode.release_update(report, task, SimpleNamespace(update=update), None)
            reports.append(report)
            tasks.append(task)
        view = self.mode.admit("audit", RoundPlan(tasks, [], round=ROUND), reports, None)
        return seen_sum(view, self.dim) @ self.u / self.clip

    def claimed(self) -> float:
        return math.inf


class DpSgdTarget(Target):
    """``sample``: a gradient canary in one client's DP-SGD steps, through Opacus' optimizer."""

    def __init__(self, mode, dim, seed, m, participation="hidden"):
        super().__init__(mode, dim, seed, participation)
        self.view = "every DP-SGD step's noisy gradient (Opacus DPOptimizer)"
        self.u = directions(dim, m, seed)
        self.client = 0
        n = int(mode.train_sizes[self.client])
        phase = mode.needs.dpsgd_schedule(n)[ROUND - 1]
        self.rate, self.steps = phase.sampling_rate, phase.steps

    def scores(self, included: np.ndarray, run: int) -> np.ndarray:
        from opacus.optimizers import DPOptimizer

        over = self.mode.train_overrides(self.client)
        z, clip = over["dp_noise_multiplier"], over["dp_clip"]
        param = torch.nn.Parameter(torch.zeros(self.dim, dtype=torch.float64))
        gen = torch_generator(self.seed, run, SERVER, "audit_dpsgd_noise")
        opt = DPOptimizer(
            torch.optim.SGD([param], lr=1.0),
            noise_multiplier=z,
            max_grad_norm=clip,
            expected_batch_size=1,
            generator=gen,
        )
        u = torch.from_numpy(self.u)
        total = np.zeros(len(included))
        for step in range(self.steps):
            part = self.takes_part(included, self.rate, run * self.steps + step)
            rows = [BOOST * clip * u[:, i] for i in np.flatnonzero(part)]
            param.grad_sample = (
                torch.stack(rows) if rows else torch.zeros((0, self.dim), dtype=torch.float64)
            )
            opt.clip_and_accumulate()
            opt.add_noise()
            total += (param.grad.detach() @ u).numpy() / clip
            opt.zero_grad()
        return total

    def claimed(self) -> float:
        if self.participation == "told" and self.rate < 1:
            self.claim_note = "Gaussian at the multiplier, every step, without amplification"
            from raysim import privacy as privacy_lib
            from raysim.privacy.events import dp_event

            z = self.mode.train_overrides(self.client)["dp_noise_multiplier"]
            p = self.mode.privacy
            event = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(z), self.steps)
            return privacy_lib.epsilon(event, p.delta, p.accountant)
        self.charges = self.mode.planned_charges(ROUND, [self.client], [])[:1]
        return self.ledger_epsilon()


class MetricTarget(Target):
    """``dprivacy``: two inputs of norm ``radius`` at distance ``distance``; the release of one."""

    def __init__(self, mode, dim, seed, m, participation="hidden", claim: float = 2.0):
        super().__init__(mode, dim, seed, participation)
        self.view = "d-private releases (release_update)"
        self.radius = 1.0
        # the distance at which the mode's own leakage (n / nu per release, per unit of the
        # update's norm) amounts to ``claim``
        self.per_unit = mode.release_leakage(dim) / self.radius
        self.distance = min(claim / self.per_unit, 2 * self.radius)
        a = directions(dim, min(2 * m, dim), seed)
        b = a[:, m : 2 * m] if 2 * m <= dim else np.roll(a, 1, axis=1)[:, :m]
        half = self.distance / 2
        h = math.sqrt(self.radius**2 - half**2)
        self.x_out = (h * a[:, :m] - half * b).T
        self.x_in = (h * a[:, :m] + half * b).T

    def scores(self, included: np.ndarray, run: int) -> np.ndarray:
        out = np.zeros(len(included))
        for i, inc in enumerate(included):
            x = self.x_in[i] if inc else self.x_out[i]
            report = ClientReport(int(i))
            ctx = SimpleNamespace(
                rng=lambda purpose, i=i: numpy_rng(self.seed, run, int(i), purpose)
            )
            self.mode.release_update(
                report, ClientTask(int(i)), SimpleNamespace(update=torch.from_numpy(x)), ctx
            )
            (msg,) = self.mode.admit(
                "audit", RoundPlan([ClientTask(int(i))], [], round=ROUND), [report], None
            )
            y = torch.as_tensor(msg.update).double().numpy()
            out[i] = np.linalg.norm(y - self.x_out[i]) - np.linalg.norm(y - self.x_in[i])
        return out

    def claimed(self) -> float:
        self.claim_note = (
            f"metric: {self.per_unit:.4g} per unit distance (n / nu at norm {self.radius}), "
            f"inputs {self.distance:.4g} apart"
        )
        return self.per_unit * self.distance


TARGETS = {
    "client": CentralTarget,
    "distributed": SecureTarget,
    "sample": DpSgdTarget,
    "dprivacy": MetricTarget,
    "none": MessageTarget,
}
