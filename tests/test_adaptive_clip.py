"""Adaptive clipping under client-level DP (Andrew et al. 2021): the count beside each sum takes
its share of the calibrated noise by the closed form 1/z^2 = 1/z_sum^2 + 1/z_count^2, which
dp_accounting must agree spends what a fixed clip at z spends; the server clips at the clip it
learnt and moves it by the geometric rule; whole runs record the clip and resume to the same bits.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import inline_run

from raysim import privacy as privacy_lib
from raysim.cli.main import main
from raysim.config import load_config
from raysim.privacy.events import dp_event
from raysim.privacy.modes import TrustBoundaryError, make_mode
from raysim.privacy.needs import PrivacyNeeds
from raysim.privacy.planning import CentralPlan
from raysim.state.checkpoint import load_checkpoint
from raysim.state.rundir import staging_dir

ROUNDS, Q, N = 30, 0.1, 1000


def _plan(sampling, **privacy):
    sets = ["privacy.mode=client", "privacy.epsilon=4", "privacy.delta=1e-5"]
    cfg = load_config(None, sets + [f"privacy.{k}={v}" for k, v in privacy.items()])
    return CentralPlan(cfg.privacy, ROUNDS, Q, sampling, N)


def _eps(plan):
    event = dp_event.SelfComposedDpEvent(plan.round_event(), ROUNDS)
    return privacy_lib.epsilon(event, 1e-5, "rdp")


@pytest.mark.parametrize(
    ("sampling", "count_sensitivity"), [("poisson", 0.5), ("without_replacement", 1.0)]
)
def test_the_count_takes_its_share_and_the_run_spends_what_a_fixed_clip_would(
    sampling, count_sensitivity
):
    fixed = _plan(sampling)
    adaptive = _plan(sampling, clip_quantile=0.5)
    cohort = Q * N
    assert adaptive.count_noise == pytest.approx(cohort / 20 / count_sensitivity)  # the default
    assert adaptive.noise**-2 + adaptive.count_noise**-2 == pytest.approx(fixed.noise**-2)
    assert adaptive.noise > fixed.noise  # the sum's own noise is larger
    assert _eps(adaptive) == pytest.approx(_eps(fixed), rel=1e-6)
    assert _eps(adaptive) <= 4 * (1 + 1e-3)
    # a given count noise: its std over the sensitivity
    assert _plan(sampling, clip_quantile=0.5, clip_count_noise=7).count_noise == pytest.approx(
        7 / count_sensitivity
    )


def test_geometric_update_is_the_papers():
    # Andrew et al. eq. (2): C exp(-eta (b - gamma))
    assert privacy_lib.geometric_clip_update(1.0, 0.9, 0.5, 0.2) == pytest.approx(math.exp(-0.08))
    assert privacy_lib.geometric_clip_update(2.0, 0.1, 0.5, 0.2) == pytest.approx(
        2 * math.exp(0.08)
    )
    assert privacy_lib.geometric_clip_update(3.0, 0.5, 0.5, 0.2) == 3.0


def _mode(**privacy):
    sets = ["privacy.mode=client", "privacy.epsilon=null", "privacy.delta=1e-3"]
    sets += ["training.sampling_rate=1", "data.num_clients=4", "data.cluster_sizes=[4]"]
    cfg = load_config(None, sets + [f"privacy.{k}={v}" for k, v in privacy.items()])
    needs = PrivacyNeeds(lambda n: [])
    return make_mode(cfg, np.full(4, 50), needs)


def test_the_server_clips_at_the_clip_it_learnt_and_moves_it():
    # noise ~ 0 on the sum and on the count, so both are exact
    mode = _mode(
        noise_multiplier=1e-9,
        clip=1.5,
        clip_quantile=0.25,
        clip_lr=0.2,
        clip_count_noise=1e-6,
    )
    assert "update_clip" not in mode.train_overrides(0)  # the server needs the whole norms
    assert _mode(clip=1.5, noise_multiplier=1.0).train_overrides(0) == {"update_clip": 1.5}
    eye = torch.eye(4)
    updates = [0.5 * eye[0], 1.0 * eye[1], 2.0 * eye[2], 4.0 * eye[3]]
    rng = np.random.default_rng(0)
    total = mode.noisy_sum(updates, mode.sensitivity(), rng, 4)
    np.testing.assert_allclose(total.numpy(), [0.5, 1.0, 1.5, 1.5], atol=1e-5)
    metrics = mode.round_metrics()
    assert metrics["clip"] == 1.5 and metrics["unclipped_fraction"] == pytest.approx(0.5)
    assert mode.clip == pytest.approx(1.5 * math.exp(-0.2 * (0.5 - 0.25)))
    assert mode.sensitivity() == pytest.approx(mode.clip)  # Poisson: C, at the new clip
    with pytest.raises(TrustBoundaryError, match="one model sum a round"):
        mode.noisy_sum(updates, mode.sensitivity(), rng, 4)
    mode._server_releases.clear()
    mode.noisy_sum(updates, mode.sensitivity(), rng, 4)
    (charge,) = mode.server_charges(1)
    (planned,) = mode.planned_charges(1, range(4), [])
    assert repr(charge.event) == repr(planned.event)
    assert "GaussianDpEvent(noise_multiplier=" in repr(charge.event)
    assert repr(charge.event).count("GaussianDpEvent") == 2  # the sum and the count


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["privacy.clip_quantile=0.5"], "privacy.mode=client"),  # the demo is sample-level
        (["privacy.mode=client", "privacy.clip_quantile=1"], "privacy.clip_quantile"),
        (
            [
                "privacy.mode=client",
                "algorithm.name=fedavg",
                "privacy.clip_quantile=0.5",
                "privacy.clip_count_noise=0.01",
            ],
            "privacy.clip_count_noise",
        ),
        (
            [
                "privacy.mode=distributed",
                "privacy.clip_quantile=0.5",
                "privacy.clip_count_noise=1",
            ],
            "privacy.clip_count_noise is client mode's",
        ),
        (
            [
                "privacy.mode=distributed",
                "algorithm.name=pina",
                "privacy.clip_quantile=0.5",
                "privacy.population=1000000",
                "privacy.delta=1e-7",
            ],
            "use it with fedavg or ifca",
        ),
        (
            [
                "privacy.mode=client",
                "privacy.clip_quantile=0.5",
                "algorithm.name=rr_cluster",
                "training.sampling=without_replacement",
                "algorithm.B=0",
            ],
            "fedavg, fedprox or fedper",
        ),
    ],
)
def test_bad_requests_exit_2_naming_the_field(sets, words, capsys):
    argv = ["privacy", "--set", "privacy.delta=1e-3"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


RUN = {
    "rounds": 4,
    "model.name": "mlp",
    "privacy.mode": "client",
    "privacy.epsilon": 8,
    "privacy.clip": 20,
    "privacy.clip_quantile": 0.5,
    "privacy.clip_lr": 0.5,
    "privacy.clip_count_noise": 1.0,
}


def _run(out, die_after=None, resume=None, **extra):
    return inline_run(out, {**RUN, **extra}, die_after, resume)


def test_a_run_learns_its_clip_spends_the_fixed_budget_and_resumes(tmp_path):
    whole = _run(tmp_path / "whole")
    clips, under = whole["clip"].to_numpy(), whole["unclipped_fraction"].to_numpy()
    assert clips[0] == 20 and len(set(clips)) == len(clips)
    # each round's noisy count moves the next round's clip by the paper's rule
    np.testing.assert_allclose(clips[1:], clips[:-1] * np.exp(-0.5 * (under[:-1] - 0.5)))
    assert (tmp_path / "whole" / "clip.png").is_file()
    fixed = _run(tmp_path / "fixed", **{"privacy.clip_quantile": "null"})
    assert "clip" not in fixed and not (tmp_path / "fixed" / "clip.png").exists()
    np.testing.assert_allclose(whole["epsilon"], fixed["epsilon"], rtol=1e-9)
    ledger = pq.read_table(tmp_path / "whole" / "privacy.parquet").to_pandas()
    z_counts = {json.loads(p)["z_count"] for p in ledger["params"]}  # the count's noise, named:
    assert z_counts == {2.0}  # its std 1.0 over the bits' sensitivity 1/2 (Poisson, q = 1)
    died = tmp_path / "died"
    with pytest.raises(KeyboardInterrupt):
        _run(died, die_after=2)
    resumed = _run(died, resume=load_checkpoint(staging_dir(died)))
    assert whole.equals(resumed)  # the learnt clip travels in the checkpoint


# -- behind secure aggregation (privacy.mode distributed) -----------------------------------------

DISTRIBUTED = {
    "rounds": 5,
    "model.name": "mlp",
    "privacy.mode": "distributed",
    "privacy.epsilon": 8,
    "privacy.population": 1000000,
    "privacy.delta": 1e-7,
    "privacy.clip": 20,
    "privacy.clip_quantile": 0.5,
    "privacy.clip_lr": 0.5,
}


def test_a_secure_sum_carries_the_clip_bits_at_the_noise_the_closed_form_gives():
    """Per slot, 2 members under the clip and 1 over: the centred bits sum to 1/2, noised at
    std / (BIT_WEIGHT * clip) in members; the contribution's norm bound grows by the bit."""
    from raysim.privacy.modes.secure import BIT_WEIGHT, COUNT_WEIGHT, SecureAggregator
    from raysim.privacy.modes.secure import contribution_sensitivity as sens
    from raysim.protocol import SecureContribution

    slots, clip, std = 4000, 2.0, 0.3
    agg = SecureAggregator(slots, 1, clip, std, adaptive=True)
    ins = [
        SecureContribution(s, torch.tensor([clip]), under_clip=under)
        for s in range(slots)
        for under in (True, True, False)
    ]
    bits = np.array(agg.aggregate(ins, np.random.default_rng(0)).under_clip)
    bit_std = std / (BIT_WEIGHT * clip)
    assert abs(bits.mean() - 0.5) < 5 * bit_std / math.sqrt(slots)
    assert bits.std() == pytest.approx(bit_std, rel=0.05)
    assert sens(clip, True) == pytest.approx(
        math.hypot(clip, COUNT_WEIGHT * clip, BIT_WEIGHT * clip / 2)
    )
    assert sens(clip) == pytest.approx(math.hypot(clip, COUNT_WEIGHT * clip))
    plain = SecureAggregator(1, 1, clip, std)
    for aggregator, contribution in ((agg, SecureContribution(0, torch.zeros(1))), (plain, ins[0])):
        with pytest.raises(TrustBoundaryError, match="clip bit"):
            aggregator.aggregate([contribution], np.random.default_rng(0))


def test_the_clients_side_takes_the_servers_clip_with_the_noise_scaled_to_it():
    """The round's clip is the server's choice: the clients' side sums at it, but with its own
    noise-to-clip ratio (a larger clip gets proportionally more noise, never less)."""
    from raysim.privacy.modes.secure import SecureAggregator
    from raysim.protocol import SecureContribution
    from raysim.runtime.client_side import ClientSide

    key, dim = b"k" * 16, 20_000
    spec = {"clip": 1.0, "std": 0.5, "share_cohort": None, "releases": 1, "adaptive": True}
    side = ClientSide(key, {}, (), True, 7, spec)
    side.keep(key, 1, {}, {0: SecureContribution(0, torch.zeros(dim), under_clip=True)})
    sums = side.secure_sums(1, [0], SecureAggregator(1, dim, clip=4.0, std=0.0))
    assert float(sums.sums[0].double().std()) == pytest.approx(0.5 * 4.0, rel=0.03)


def test_distributed_learns_its_clip_inside_the_secure_sum_at_the_fixed_budget(tmp_path):
    """The clip moves by the paper's rule from the secure sum's own bits and count; the run
    spends exactly what a fixed clip spends (one Gaussian, its sensitivity the stacked bound);
    the noise std follows the clip; a resumed run gives the same bits."""
    whole = inline_run(tmp_path / "whole", DISTRIBUTED)
    clips, under = whole["clip"].to_numpy(), whole["unclipped_fraction"].to_numpy()
    assert clips[0] == 20 and under[0] == pytest.approx(1.0, abs=0.01)  # 20: above every norm
    np.testing.assert_allclose(clips[1:], clips[:-1] * np.exp(-0.5 * (under[:-1] - 0.5)))
    assert clips[-1] < clips[0]
    fixed = inline_run(tmp_path / "fixed", {**DISTRIBUTED, "privacy.clip_quantile": "null"})
    np.testing.assert_allclose(whole["epsilon"], fixed["epsilon"], rtol=1e-9)
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())["privacy"]
    z, m = summary["noise_multiplier"], summary["secure_spec"]["std"]
    cohort = 8  # small_config's clients, all sampled
    assert m == pytest.approx(z * 20 * math.sqrt(1 + 0.1**2 + 0.1**2) * cohort / 10_000)
    died = tmp_path / "died"
    with pytest.raises(KeyboardInterrupt):
        inline_run(died, DISTRIBUTED, die_after=2)
    resumed = inline_run(died, DISTRIBUTED, resume=load_checkpoint(staging_dir(died)))
    assert whole.equals(resumed)  # the learnt clip travels in the checkpoint


def test_the_clip_plot_is_drawn_where_every_secure_sum_was_aborted(tmp_path):
    """An aborted round records its clip but no noisy share: the plot draws the clip alone
    instead of failing the finished run at its last step."""
    import json

    import pandas as pd

    from raysim.metrics.results import plot_run

    pd.DataFrame(
        {"round": [1, 2], "clip": [1.0, 1.0], "aborted": [1.0, 1.0], "epsilon": [0.5, 1.0]}
    ).to_parquet(tmp_path / "metrics.parquet")
    summary = {
        "algorithm": "fedavg",
        "dataset": "digits",
        "privacy_mode": "distributed",
        "delta": 1e-5,
        "privacy": {"accounts_epsilon": True, "clip_quantile": 0.5},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    plot_run(tmp_path)
    assert (tmp_path / "clip.png").is_file()
