"""Per-client privacy ledger: what each client has spent, and refusal to go past a budget.

Clients are grouped by their history of charged events: a history is a node in a trie whose edges
are events, so clients charged the same events share one node and one accounting computation
(1000 clients charged alike cost one accountant call per round, not 1000). Each distinct event's
RDP curve or PLD is computed once and cached; a node's state is its parent's state composed with
that event, and its epsilon is computed at most once.

The accountant (with scipy) loads on the first charge, not with the ledger: every run keeps a
ledger, and a run without DP, which charges nothing, never needs it. The event classes are
cheap (``raysim.privacy.on_demand``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
from dp_accounting import dp_event

from raysim.privacy.errors import BudgetError, PrivacyConfigError

if TYPE_CHECKING:
    from raysim.privacy.accounting import AccountantKind, NeighborRel

__all__ = ["PrivacyLedger"]

# Relative slack on the budget: absorbs float rounding between a calibration that composed a
# whole schedule at once and the ledger composing it round by round (measured: ~1e-15 relative
# for RDP, ~1e-10 for PLD). A 1e-6 relative overspend is immaterial.
BUDGET_RTOL = 1e-6


def _median_of_counts(values: list[tuple[float, int]]) -> float:
    """``statistics.median`` of the list holding each value ``count`` times, without it."""
    ordered = sorted(values)
    total = sum(k for _, k in ordered)

    def kth(k: int) -> float:  # the k-th smallest, from 0
        seen = 0
        for value, count in ordered:
            seen += count
            if k < seen:
                return value
        raise IndexError(k)

    if total % 2:
        return kth(total // 2)
    return (kth(total // 2 - 1) + kth(total // 2)) / 2


class _RdpStates:
    """States are RDP curves over dp_accounting's default orders; composition adds them."""

    def __init__(self, delta: float) -> None:
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        self.delta = delta
        self.orders = np.array(rdp_lib.DEFAULT_RDP_ORDERS, dtype=np.float64)

    def root(self) -> np.ndarray:
        return np.zeros_like(self.orders)

    def of_event(self, event: dp_event.DpEvent) -> np.ndarray:
        from raysim.privacy import accounting

        acc = accounting.make_accountant("rdp", accounting.neighboring_relation(event))
        return acc.compose(event).rdp

    def compose(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def epsilon(self, state: np.ndarray) -> float:
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        return float(rdp_lib.compute_epsilon(self.orders, state, self.delta)[0])


class _PldStates:
    """States are privacy loss distributions (None once a non-private event was charged)."""

    def __init__(self, delta: float) -> None:
        self.delta = delta

    def root(self):
        from dp_accounting.pld import privacy_loss_distribution as pld_lib

        from raysim.privacy.accounting import PLD_DISCRETIZATION

        return pld_lib.identity(PLD_DISCRETIZATION)

    def of_event(self, event: dp_event.DpEvent):
        from raysim.privacy import accounting

        acc = accounting.make_accountant("pld", accounting.neighboring_relation(event))
        return acc.compose(event).privacy_loss_distribution()

    def compose(self, a, b):
        return None if a is None or b is None else a.compose(b)

    def epsilon(self, state) -> float:
        return math.inf if state is None else float(state.get_epsilon_for_delta(self.delta))


@dataclass
class _Node:
    parent: int | None
    key: str | None  # the event on the edge from the parent
    state: Any  # None once dropped; recomputed from the parent chain if needed again
    epsilon: float | None = None
    refs: int = 0  # accounts currently on this node


def _sampling_relation(event: dp_event.DpEvent) -> NeighborRel | None:
    """The relation a sampling event fixes, or None when the event has no sampling."""
    from raysim.privacy import accounting

    kinds = {type(e) for e in accounting._walk(event)}  # noqa: SLF001 (same package)
    if kinds & {dp_event.PoissonSampledDpEvent, dp_event.SampledWithoutReplacementDpEvent}:
        return accounting.neighboring_relation(event)
    return None


class PrivacyLedger:
    """Charges DpEvents to clients and reports epsilon at a fixed ``delta``.

    ``clients=None`` in :meth:`charge` is a population-wide charge (central, client-level DP):
    it applies to every client, including those never charged individually. A client-level
    guarantee also bounds the sample-level loss of the same client, so composing it into a
    client's sample-level account is conservative. ``budget`` (epsilon at ``delta``) makes every
    charge that would exceed it raise :class:`BudgetError` before anything is recorded.

    With ``accountant="pld"`` each distinct history costs a PLD composition (about 0.1-1 s per
    round): fine for tens of distinct histories, slow for a thousand heterogeneous clients, where
    RDP (a vector addition per history) is the practical choice.
    """

    def __init__(
        self,
        delta: float,
        accountant: AccountantKind = "rdp",
        budget: float | None = None,
        num_clients: int | None = None,
        budget_rtol: float = BUDGET_RTOL,
    ) -> None:
        if not 0 < delta < 1:
            raise PrivacyConfigError(f"delta must be in (0, 1), got {delta}")
        if budget is not None and not budget > 0:
            raise PrivacyConfigError(f"budget must be > 0, got {budget}")
        if accountant not in ("rdp", "pld"):
            raise PrivacyConfigError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
        self.delta, self.accountant, self.budget = delta, accountant, budget
        self.num_clients, self.budget_rtol = num_clients, budget_rtol
        # the root (nothing charged) gets its state when a child first needs it
        self._nodes = [_Node(parent=None, key=None, state=None, epsilon=0.0, refs=1)]
        self._children: dict[tuple[int, str], int] = {}
        self._event_states: dict[str, Any] = {}
        self._population = 0  # node of the population-only history
        self._client_node: dict[int, int] = {}
        self._rows: list[tuple[int | None, int, str, str, int]] = []
        self._relation: NeighborRel | None = None

    # -- accounting -----------------------------------------------------------------------
    @cached_property
    def _states(self) -> _RdpStates | _PldStates:
        """Built on the first charge (this loads dp_accounting)."""
        return _RdpStates(self.delta) if self.accountant == "rdp" else _PldStates(self.delta)

    def _child(self, node: int, event: dp_event.DpEvent, key: str) -> int:
        child = self._children.get((node, key))
        if child is None:
            if key not in self._event_states:
                self._event_states[key] = self._states.of_event(event)
            child = len(self._nodes)
            self._nodes.append(_Node(parent=node, key=key, state=None))
            self._children[(node, key)] = child
        return child

    def _state(self, node: int) -> Any:
        """A node's state, composing it from the nearest ancestor that still holds one."""
        chain = []
        while self._nodes[node].state is None and self._nodes[node].parent is not None:
            chain.append(node)
            node = self._nodes[node].parent
        state = self._nodes[node].state
        if state is None:  # the root
            state = self._nodes[node].state = self._states.root()
        for n in reversed(chain):
            state = self._states.compose(state, self._event_states[self._nodes[n].key])
            self._nodes[n].state = state
        return state

    def _epsilon_of(self, node: int) -> float:
        n = self._nodes[node]
        if n.epsilon is None:
            n.epsilon = self._states.epsilon(self._state(node))
        return n.epsilon

    def _targets(self, clients: Sequence[int] | None) -> dict[int | None, int]:
        """Current node of every account a charge touches (None: the population account)."""
        if clients is None:
            out: dict[int | None, int] = {None: self._population}
            out.update(self._client_node)
            return out
        return {
            int(c): self._client_node.get(int(c), self._population) for c in dict.fromkeys(clients)
        }

    def _over_budget(self, eps: float) -> bool:
        return self.budget is not None and eps > self.budget * (1 + self.budget_rtol)

    def _check_relation(self, event: dp_event.DpEvent) -> None:
        relation = _sampling_relation(event)
        if relation is not None and self._relation not in (None, relation):
            raise PrivacyConfigError(
                f"this ledger accounts under {self._relation.name}; an event needing "
                f"{relation.name} cannot be composed with it"
            )

    # -- public API -----------------------------------------------------------------------
    def would_exceed(self, clients: Sequence[int] | None, event: dp_event.DpEvent) -> bool:
        """Whether charging ``event`` to ``clients`` would take any of them over the budget."""
        if self.budget is None:
            return False
        key = repr(event)
        nodes = set(self._targets(clients).values())
        return any(self._over_budget(self._epsilon_of(self._child(n, event, key))) for n in nodes)

    def charge(
        self,
        round: int,  # noqa: A002 (the engine's name for it)
        clients: Sequence[int] | None,
        mechanism: str,
        event: dp_event.DpEvent,
        params: dict | None = None,
    ) -> None:
        """Record that ``clients`` (None: the whole population) were charged ``event``.

        Raises BudgetError, recording nothing, if a budget is set and would be exceeded.
        """
        if not isinstance(event, dp_event.DpEvent):
            raise TypeError(f"event must be a dp_accounting DpEvent, got {type(event)}")
        self._check_relation(event)
        key = repr(event)
        targets = self._targets(clients)
        moves = {n: self._child(n, event, key) for n in set(targets.values())}
        if self.budget is not None:
            over = {
                acc: self._epsilon_of(moves[n])
                for acc, n in targets.items()
                if self._over_budget(self._epsilon_of(moves[n]))
            }
            if over:
                worst = max(over, key=lambda a: over[a])
                who = "the population" if worst is None else f"client {worst}"
                raise BudgetError(
                    f"round {round}: charging {mechanism} would exceed the privacy budget "
                    f"epsilon={self.budget} at delta={self.delta} for {len(over)} account(s); "
                    f"{who} would reach epsilon={over[worst]:.4g}. Nothing was charged"
                )
        self._relation = self._relation or _sampling_relation(event)
        params_json = json.dumps(params or {}, sort_keys=True, default=str)
        for new in moves.values():
            self._state(new)  # compose while the parents' states are still held
        for acc, old in targets.items():
            new = moves[old]
            explicit = acc is None or acc in self._client_node
            if acc is None:
                self._population = new
            else:
                self._client_node[acc] = new
            self._nodes[new].refs += 1
            if explicit:
                self._nodes[old].refs -= 1
            self._rows.append((acc, int(round), mechanism, params_json, new))
        for old in moves:
            self._release(old)

    def _release(self, node: int) -> None:
        """Drop a node's state once no account sits on it (its epsilon is kept for rows)."""
        n = self._nodes[node]
        if node != 0 and n.refs <= 0 and n.state is not None:
            self._epsilon_of(node)
            n.state = None

    def epsilon(self, client: int | None = None) -> float:
        """Epsilon spent so far by ``client`` (None: the population-wide account)."""
        node = self._population if client is None else self._client_node.get(client)
        return self._epsilon_of(self._population if node is None else node)

    def check_budget(self) -> None:
        """Raise BudgetError if any account is over the budget (a no-op without a budget)."""
        if self.budget is None:
            return
        for acc, node in self._targets(None).items():
            eps = self._epsilon_of(node)
            if self._over_budget(eps):
                who = "the population" if acc is None else f"client {acc}"
                raise BudgetError(
                    f"{who} has spent epsilon={eps:.4g} > budget {self.budget} at "
                    f"delta={self.delta}"
                )

    def count(self, mechanism: str, population: bool = True) -> int:
        """How many times ``mechanism`` was charged: population-wide charges (``population``),
        or else the rows of charges to named clients."""
        return sum(
            1
            for acc, _, mech, _, _ in self._rows
            if mech == mechanism and (acc is None) == population
        )

    def rows(self) -> list[dict]:
        """One row per (client, charge): client (None: population), round, mechanism, params
        (JSON), epsilon spent by that account after the charge."""
        return [
            {
                "client": client,
                "round": rnd,
                "mechanism": mech,
                "params": params,
                "epsilon": self._epsilon_of(node),
            }
            for client, rnd, mech, params, node in self._rows
        ]

    def epsilons(self) -> np.ndarray:
        """Epsilon spent by each client 0..num_clients-1: the clients never charged apart share
        the population's account, so this costs one accountant reading per distinct history."""
        if not self.num_clients:
            raise ValueError("epsilons() needs the ledger's num_clients")
        out = np.full(self.num_clients, self.epsilon(None), dtype=np.float64)
        if self._client_node:
            ids = np.fromiter(self._client_node, dtype=np.int64, count=len(self._client_node))
            nodes = np.fromiter(self._client_node.values(), dtype=np.int64, count=len(ids))
            distinct, index = np.unique(nodes, return_inverse=True)
            out[ids] = np.array([self._epsilon_of(int(n)) for n in distinct])[index]
        return out

    def summary(self) -> dict:
        """Max and median epsilon over clients (0..num_clients-1 if given, else those charged),
        from the distinct histories and how many clients share each: O(clients charged)."""
        if self.num_clients:
            nodes = list(self._client_node.values())
            rest = self.num_clients - len(nodes)
            clients = self.num_clients
        else:
            nodes, rest, clients = list(self._client_node.values()), 0, len(self._client_node)
        counts: dict[int, int] = {}
        for n in nodes:
            counts[n] = counts.get(n, 0) + 1
        if rest or not counts:
            counts[self._population] = counts.get(self._population, 0) + max(rest, 1)
        eps = [(self._epsilon_of(n), k) for n, k in counts.items()]
        return {
            "accountant": self.accountant,
            "delta": self.delta,
            "budget": self.budget,
            "clients": clients,
            "max_epsilon": max(e for e, _ in eps),
            "median_epsilon": _median_of_counts(eps),
            "population_epsilon": self.epsilon(None),
        }
