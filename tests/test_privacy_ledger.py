"""The ledger reports what direct accounting gives, refuses to overspend, and scales."""

import json
import time

import dp_accounting as dpa
import pytest

from raysim.privacy import (
    BudgetError,
    Phase,
    PrivacyConfigError,
    PrivacyLedger,
    central_round_event,
    dpsgd_event,
    epsilon,
    selection_event,
)

DELTA = 1e-5


def round_event(dataset_size: int, z: float = 1.0) -> dpa.DpEvent:
    return dpsgd_event([Phase(32 / dataset_size, dataset_size // 32)], z)


def run_schedule(ledger: PrivacyLedger, sizes: dict[int, int], rounds: int) -> dict[int, list]:
    """Clients take DP-SGD rounds; odd clients also make a selection from round 2; every second
    round only clients 0..2 train (client sampling). Returns each client's charged events."""
    history: dict[int, list] = {c: [] for c in sizes}
    for r in range(rounds):
        active = list(sizes) if r % 2 == 0 else [0, 1, 2]
        for size in set(sizes.values()):
            group = [c for c in active if sizes[c] == size]
            if group:
                event = round_event(size)
                ledger.charge(r, group, "dpsgd", event, {"q": 32 / size, "z": 1.0})
                for c in group:
                    history[c].append(event)
        picked = [c for c in active if c % 2 == 1 and r >= 2]
        if picked:
            ledger.charge(r, picked, "select", selection_event(0.3, 1), {"epsilon": 0.3})
            for c in picked:
                history[c].append(selection_event(0.3, 1))
    return history


@pytest.mark.parametrize("accountant,rel", [("rdp", 1e-9), ("pld", 1e-6)])
def test_per_client_epsilon_equals_direct_accounting(accountant, rel):
    sizes = {0: 640, 1: 640, 2: 1280, 3: 1280, 4: 640}
    rounds = 6 if accountant == "rdp" else 3
    ledger = PrivacyLedger(DELTA, accountant, num_clients=len(sizes))
    history = run_schedule(ledger, sizes, rounds)
    for client, events in history.items():
        direct = epsilon(dpa.ComposedDpEvent(events), DELTA, accountant)
        # PLD: the ledger composes round by round, the direct call in one go (same discretised
        # PLDs, composed in another order: equal up to FFT rounding, ~1e-11 measured)
        assert ledger.epsilon(client) == pytest.approx(direct, rel=rel)
    assert ledger.epsilon(99) == 0.0  # never charged


def test_population_charges_apply_to_every_client():
    ledger = PrivacyLedger(DELTA, num_clients=4)
    central = central_round_event(0.1, 1.0, 3.0)
    ledger.charge(0, [1], "select", selection_event(0.5, 1))
    ledger.charge(0, None, "central", central, {"q": 0.1})
    ledger.charge(1, None, "central", central, {"q": 0.1})
    both = epsilon(dpa.SelfComposedDpEvent(central, 2), DELTA)
    assert ledger.epsilon(None) == pytest.approx(both)
    assert ledger.epsilon(3) == pytest.approx(both)  # never charged alone
    with_selection = dpa.ComposedDpEvent([selection_event(0.5, 1), central, central])
    assert ledger.epsilon(1) == pytest.approx(epsilon(with_selection, DELTA))
    summary = ledger.summary()
    assert summary["max_epsilon"] == pytest.approx(ledger.epsilon(1))
    assert summary["median_epsilon"] == pytest.approx(both)
    assert summary["clients"] == 4


def test_budget_refusal_records_nothing():
    event = round_event(640)
    one = epsilon(event, DELTA)
    two, three = (epsilon(dpa.SelfComposedDpEvent(event, k), DELTA) for k in (2, 3))
    ledger = PrivacyLedger(DELTA, budget=(two + three) / 2)  # room for two charges, not three
    ledger.charge(0, [0, 1], "dpsgd", event)
    ledger.charge(1, [0], "dpsgd", event)
    assert not ledger.would_exceed([1], event)
    assert ledger.would_exceed([0], event)
    before = (ledger.rows(), ledger.epsilon(0), ledger.epsilon(1))
    with pytest.raises(BudgetError, match=r"round 2: charging dpsgd would exceed .*client 0"):
        ledger.charge(2, [0, 1], "dpsgd", event)
    assert (ledger.rows(), ledger.epsilon(0), ledger.epsilon(1)) == before
    ledger.charge(2, [1], "dpsgd", event)  # client 1 still has room
    ledger.check_budget()
    tight = PrivacyLedger(DELTA, budget=10 * one)
    tight.charge(0, [0], "dpsgd", event)
    tight.budget = 0.5 * one  # e.g. a budget lowered on resume
    with pytest.raises(BudgetError, match="client 0 has spent"):
        tight.check_budget()


def test_rows_have_the_contract_keys():
    ledger = PrivacyLedger(DELTA)
    ledger.charge(0, [3, 4], "dpsgd", round_event(640), {"z": 1.0, "phases": [0.05, 20]})
    ledger.charge(1, None, "central", central_round_event(0.1, 2.0))
    ledger.charge(1, [3], "dpsgd", round_event(640))
    rows = ledger.rows()
    assert [r["client"] for r in rows] == [3, 4, None, 3, 4, 3]
    for row in rows:
        assert set(row) == {"client", "round", "mechanism", "params", "epsilon"}
        assert isinstance(json.loads(row["params"]), dict)
    assert json.loads(rows[0]["params"]) == {"phases": [0.05, 20], "z": 1.0}
    client3 = [r["epsilon"] for r in rows if r["client"] == 3]
    assert client3 == sorted(client3) and client3[-1] == ledger.epsilon(3)


def test_mixing_neighbouring_relations_is_refused():
    ledger = PrivacyLedger(DELTA)
    ledger.charge(0, None, "central", central_round_event(0.1, 1.0))
    wor = central_round_event(0.1, 1.0, sampling="without_replacement", population=100)
    with pytest.raises(PrivacyConfigError, match="REPLACE_ONE"):
        ledger.charge(1, None, "central", wor)


def test_thousand_clients_fifty_rounds_share_accounting():
    sizes = {c: (500, 1000, 2000, 4000)[c % 4] for c in range(1000)}
    events = {n: round_event(n) for n in set(sizes.values())}
    ledger = PrivacyLedger(DELTA, num_clients=1000)
    calls = 0
    compute = ledger._states.epsilon

    def counting(state):
        nonlocal calls
        calls += 1
        return compute(state)

    ledger._states.epsilon = counting
    start = time.perf_counter()
    for r in range(50):
        for n, event in events.items():
            ledger.charge(r, [c for c in sizes if sizes[c] == n], "dpsgd", event)
        ledger.summary()
    assert time.perf_counter() - start < 10
    # one epsilon per distinct history per round (+1: the population), not per client
    assert calls <= 4 * 50 + 1
    fifty = dpa.SelfComposedDpEvent(events[4000], 50)
    assert ledger.epsilon(3) == pytest.approx(epsilon(fifty, DELTA))
    assert len(ledger.rows()) == 50 * 1000


def test_late_clients_reuse_histories_whose_state_was_dropped():
    e, f = round_event(640), selection_event(0.3, 1)
    ledger = PrivacyLedger(DELTA)
    ledger.charge(0, [0], "dpsgd", e)
    ledger.charge(1, [0], "select", f)  # client 0 leaves the "e" history: its state is dropped
    ledger.charge(2, [1], "dpsgd", e)  # client 1 reaches it later and needs it again
    ledger.charge(3, [1], "dpsgd", e)
    assert ledger.epsilon(0) == pytest.approx(epsilon(dpa.ComposedDpEvent([e, f]), DELTA))
    assert ledger.epsilon(1) == pytest.approx(epsilon(dpa.SelfComposedDpEvent(e, 2), DELTA))
