"""Accounting speed-up: identical events in a composition are accounted once, times their
count. Checked against dp_accounting's stock RDP accountant (which composes them one by one),
and `raysim privacy` answers in seconds with a readable summary."""

from __future__ import annotations

import json
import time

import dp_accounting as dpa
import pytest
from conftest import small_config

from raysim.cli.main import main
from raysim.privacy.accounting import epsilon


def _round(q: float, z: float, steps: int) -> dpa.DpEvent:
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)


@pytest.mark.parametrize("delta", [1e-3, 1e-5])
def test_repeated_rounds_account_exactly_as_dp_accounting(delta):
    event = dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(3.0)] + [_round(0.1, 1.1, 8)] * 11 + [_round(0.05, 1.1, 3)] * 2
    )
    stock = dpa.rdp.RdpAccountant().compose(event).get_epsilon(delta)
    assert epsilon(event, delta, "rdp") == pytest.approx(stock, rel=1e-9)


def test_privacy_command_is_fast_and_readable(capsys):
    rdpcfl = {"algorithm.name": "rdpcfl", "algorithm.eps_select": 0.05}
    sets = sum((["--set", s] for s in small_config(rounds=30, **rdpcfl)), [])
    t0 = time.perf_counter()
    assert main(["privacy", *sets]) == 0
    assert time.perf_counter() - t0 < 30  # was minutes of repeated RDP sums on long schedules
    text = capsys.readouterr().out
    assert text.startswith("privacy.mode sample: eps ") and "noise multiplier" in text
    assert len(text.splitlines()) < 15 and "train_size=" not in text  # no per-round dump
    assert main(["privacy", *sets, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (schedule,) = report["epsilon_per_round"].values()
    assert len(schedule) == 30 and schedule[-1] == pytest.approx(report["epsilon"])


def test_privacy_command_without_dp(capsys):
    sets = sum((["--set", s] for s in small_config(**{"privacy.mode": "none"})), [])
    assert main(["privacy", *sets]) == 0
    assert "eps = ∞" in capsys.readouterr().out
    assert main(["privacy", *sets, "--json"]) == 0
    text = capsys.readouterr().out  # JSON: no Infinity (which strict parsers refuse), null
    report = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert report["epsilon"] is None
