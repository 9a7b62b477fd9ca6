"""Privacy accounting on Google's ``dp_accounting``: DpEvents for each mechanism and epsilon.

Mechanisms are described as ``DpEvent`` trees (composition, subsampling, Gaussian noise) and a
single function turns a tree into (epsilon, delta) with either the RDP or the PLD accountant.

Neighbouring relations (what "one unit of privacy" means):

* Poisson sampling (DP-SGD batches, client sampling at rate q) is accounted under
  ADD_OR_REMOVE_ONE: the neighbouring dataset has one record (sample or client) more or less.
  This is the relation of Opacus and of the TF-privacy RDP accountant R-DPCFL uses.
* Fixed-size client sampling without replacement (RR-Cluster Theorem 1, amplification of Wang,
  Balle and Kasiviswanathan 2019) is only valid under REPLACE_ONE: the population size is public
  and a neighbour swaps one client for another. dp_accounting enforces this, so noise multipliers
  for such events must be std / (replace-one sensitivity).
* Events without sampling take the relation of the tree they are in (ADD_OR_REMOVE_ONE alone).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from typing import Any, Literal

import attr
import numpy as np
from dp_accounting import privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from raysim.privacy.errors import PrivacyConfigError
from raysim.privacy.events import BoundedRangeDpEvent, dp_event, dpsgd_event, selection_event
from raysim.privacy.events import gaussian as _gaussian
from raysim.privacy.phase import Phase

# BoundedRangeDpEvent, dpsgd_event and selection_event live in raysim.privacy.events (workers
# build them without loading the accountants below); they are re-exported here.


class _QuietNonConvergence(logging.Filter):
    """dp_accounting warns when a fractional RDP order fails to converge and drops that order:
    the bound stays valid (other orders remain), and calibration probes many such points."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in str(record.msg)


logging.getLogger("absl").addFilter(_QuietNonConvergence())

__all__ = [
    "AccountantKind",
    "BoundedRangeDpEvent",
    "Phase",
    "central_event",
    "central_round_event",
    "d_privacy_leakage",
    "delta_for",
    "dpsgd_event",
    "epsilon",
    "make_accountant",
    "neighboring_relation",
    "rdpcfl_phases",
    "selection_event",
]

AccountantKind = Literal["rdp", "pld"]
NeighborRel = privacy_accountant.NeighboringRelation

# PLD discretization: 1e-4 is dp_accounting's default; errors stay pessimistic (upper bounds).
PLD_DISCRETIZATION = 1e-4


class _RdpAccountant(rdp_privacy_accountant.RdpAccountant):
    """dp_accounting's RDP accountant that also understands :class:`BoundedRangeDpEvent`."""

    def _maybe_compose(self, event, count, do_compose):
        if isinstance(event, BoundedRangeDpEvent):
            if do_compose:
                eps = event.epsilon
                self._rdp += count * np.minimum(self._orders * eps * eps / 8.0, eps)
            return None
        if isinstance(event, dp_event.ComposedDpEvent) and do_compose:
            # RDP adds up under composition, so k identical events (e.g. the same DP-SGD round
            # charged every round) cost k times one: computing each distinct event once makes
            # calibration and `raysim privacy` an order of magnitude faster, with equal numbers.
            try:
                distinct = collections.Counter(event.events)
            except TypeError:  # an unhashable event: compose one by one
                distinct = None
            if distinct is not None:
                for e, k in distinct.items():
                    if (err := self._maybe_compose(e, count * k, do_compose)) is not None:
                        return err
                return None
        return super()._maybe_compose(event, count, do_compose)


def _walk(event: dp_event.DpEvent):
    yield event
    if isinstance(event, dp_event.ComposedDpEvent):
        for e in event.events:
            yield from _walk(e)
    elif hasattr(event, "event"):
        yield from _walk(event.event)


def neighboring_relation(event: dp_event.DpEvent) -> NeighborRel:
    """The relation an event must be accounted under (see module docstring)."""
    kinds = {type(e) for e in _walk(event)}
    if dp_event.SampledWithoutReplacementDpEvent in kinds:
        if dp_event.PoissonSampledDpEvent in kinds:
            raise PrivacyConfigError(
                "an event mixes Poisson sampling (add/remove-one relation) with fixed-size "
                "sampling without replacement (replace-one relation); account them separately"
            )
        return NeighborRel.REPLACE_ONE
    return NeighborRel.ADD_OR_REMOVE_ONE


def make_accountant(
    kind: AccountantKind = "rdp", relation: NeighborRel = NeighborRel.ADD_OR_REMOVE_ONE
) -> privacy_accountant.PrivacyAccountant:
    """A fresh accountant of ``kind`` ("rdp" with dp_accounting's default orders, or "pld")."""
    if kind == "rdp":
        return _RdpAccountant(neighboring_relation=relation)
    if kind == "pld":
        from raysim.privacy.pld import PldAccountant

        return PldAccountant(relation, value_discretization_interval=PLD_DISCRETIZATION)
    raise PrivacyConfigError(f"accountant must be 'rdp' or 'pld', got {kind!r}")


def _accountant_for(
    event: dp_event.DpEvent, kind: AccountantKind
) -> privacy_accountant.PrivacyAccountant:
    accountant = make_accountant(kind, neighboring_relation(event))
    try:
        return accountant.compose(event)
    except privacy_accountant.UnsupportedEventError as err:
        raise PrivacyConfigError(f"the {kind} accountant cannot account this event: {err}") from err


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise PrivacyConfigError(f"delta must be in (0, 1), got {delta}")


def epsilon(event: dp_event.DpEvent, delta: float, accountant: AccountantKind = "rdp") -> float:
    """Epsilon of ``event`` at ``delta`` (an upper bound for both accountants). Remembered for
    the process: the same event is asked for again and again (every run of `raysim compare`
    that calibrates one schedule probes the same noise multipliers; one RDP answer on the default
    orders costs 0.1-0.6 s of pure Python)."""
    _check_delta(delta)
    try:
        key = _ByValue(event)
    except TypeError:  # contents that do not hash (no event of raysim's): asked anew
        return float(_accountant_for(event, accountant).get_epsilon(delta))
    return _epsilon(key, float(delta), accountant)


@functools.lru_cache(maxsize=4096)
def _epsilon(event: _ByValue, delta: float, accountant: AccountantKind) -> float:
    return float(_accountant_for(event.event, accountant).get_epsilon(delta))


class _ByValue:
    """A DpEvent compared and hashed by its contents: dp_accounting's events are frozen attrs
    classes, but a composition holds a list, so they do not hash."""

    __slots__ = ("event", "key", "_hash")

    def __init__(self, event: dp_event.DpEvent) -> None:
        self.event = event
        self.key = _contents(event)
        self._hash = hash(self.key)  # TypeError here, not inside the cache

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self.key == other.key


def _contents(value: Any) -> Any:
    """A hashable, exact description: the class and every field, recursively."""
    if attr.has(type(value)):
        fields = attr.fields(type(value))
        return (type(value), *(_contents(getattr(value, f.name)) for f in fields))
    if isinstance(value, (list, tuple)):
        return (type(value), *map(_contents, value))
    return (type(value), value)


def delta_for(event: dp_event.DpEvent, epsilon: float, accountant: AccountantKind = "rdp") -> float:
    """Delta of ``event`` at ``epsilon``."""
    if not epsilon >= 0:
        raise PrivacyConfigError(f"epsilon must be >= 0, got {epsilon}")
    return float(_accountant_for(event, accountant).get_delta(epsilon))


def rdpcfl_phases(
    dataset_size: int,
    batch_size: int,
    local_epochs: int,
    rounds: int,
    full_first_round: bool = True,
) -> list[Phase]:
    """R-DPCFL's schedule for one client (Alg. 1): round 1 full batch, then Poisson batches.

    Round 1 takes ``local_epochs`` full-batch steps (q = 1); each later round takes
    ``local_epochs * ceil(N / b)`` steps at rate b / N (expected batch b), Opacus' convention.
    """
    if dataset_size < 1 or batch_size < 1 or local_epochs < 0 or rounds < 0:
        raise PrivacyConfigError(
            f"invalid schedule: N={dataset_size}, b={batch_size}, K={local_epochs}, E={rounds}"
        )
    q = min(1.0, batch_size / dataset_size)
    per_round = local_epochs * math.ceil(dataset_size / batch_size)
    if not full_first_round:
        return [Phase(q, per_round * rounds)]
    return [Phase(1.0, local_epochs * min(rounds, 1)), Phase(q, per_round * max(rounds - 1, 0))]


def central_round_event(
    sampling_rate: float,
    model_noise_multiplier: float,
    id_noise_multiplier: float | None = None,
    sampling: Literal["poisson", "without_replacement"] = "poisson",
    population: int | None = None,
    cohort: int | None = None,
) -> dp_event.DpEvent:
    """One round of client-level central DP (RR-Cluster, Theorem 1).

    The round releases the identifier Gaussian (if any) and the per-cluster model Gaussian on the
    same sampled clients; multipliers are noise std / sensitivity (the model one already includes
    the 2*C_theta rebalancing sensitivity). Both are amplified by the client sampling:
    ``"poisson"`` (rate q, add/remove-one client) or ``"without_replacement"`` (fixed ``cohort``
    out of ``population``, replace-one client; cohort defaults to round(q * population)).
    """
    inner: dp_event.DpEvent = _gaussian(model_noise_multiplier)
    if id_noise_multiplier is not None:
        inner = dp_event.ComposedDpEvent([_gaussian(id_noise_multiplier), inner])
    if sampling == "poisson":
        if not 0 < sampling_rate <= 1:
            raise PrivacyConfigError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        return inner if sampling_rate == 1 else dp_event.PoissonSampledDpEvent(sampling_rate, inner)
    if sampling == "without_replacement":
        if population is None or population < 1:
            raise PrivacyConfigError("sampling without replacement needs the population size")
        if cohort is None:
            cohort = round(sampling_rate * population)
        if not 1 <= cohort <= population:
            raise PrivacyConfigError(f"cohort must be in [1, {population}], got {cohort}")
        return dp_event.SampledWithoutReplacementDpEvent(int(population), int(cohort), inner)
    raise PrivacyConfigError(
        f"sampling must be 'poisson' or 'without_replacement', got {sampling!r}"
    )


def central_event(
    rounds: int,
    sampling_rate: float,
    model_noise_multiplier: float,
    id_noise_multiplier: float | None = None,
    sampling: Literal["poisson", "without_replacement"] = "poisson",
    population: int | None = None,
    cohort: int | None = None,
) -> dp_event.DpEvent:
    """``rounds`` adaptive compositions of :func:`central_round_event` (Theorem 1's factor T)."""
    if rounds < 0:
        raise PrivacyConfigError(f"rounds must be >= 0, got {rounds}")
    one = central_round_event(
        sampling_rate, model_noise_multiplier, id_noise_multiplier, sampling, population, cohort
    )
    return dp_event.SelfComposedDpEvent(one, int(rounds)) if rounds else dp_event.NoOpDpEvent()


def d_privacy_leakage(epsilon_per_round: float, radius: float, rounds_participated: int) -> float:
    """Total d-privacy leakage of a client (Galli et al., Theorem 3.1): sum of eps*||delta||.

    Each release is eps-d-private, i.e. points within ``radius`` are (eps*radius)-DP
    indistinguishable; independent releases compose additively. With eps = n/(nu*radius) each
    round leaks n/nu.
    """
    if epsilon_per_round < 0 or radius < 0 or rounds_participated < 0:
        raise PrivacyConfigError("d-privacy leakage needs non-negative arguments")
    return float(epsilon_per_round * radius * rounds_participated)
