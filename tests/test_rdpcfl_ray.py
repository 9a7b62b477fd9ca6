"""R-DPCFL through the engine (Ray workers) gives the numbers of the in-process runner: the
same seeded generators decide every draw, wherever a client runs."""

from __future__ import annotations

import json

import numpy as np
from conftest import small_config

from algorithms import Environment, get_algorithm
from raysim.config import load_config
from raysim.engine.experiment import prepare
from raysim.runtime.inline import run_inline
from raysim.runtime.run import run_prepared


def test_engine_and_inline_runner_agree(ray_session, tmp_path):
    sets = small_config(**{"algorithm.name": "rdpcfl", "rounds": 2, "algorithm.num_clusters": 2})
    cfg = load_config(None, sets)
    engine = run_prepared(prepare(cfg, get_algorithm("rdpcfl"), Environment), tmp_path)
    inline = run_inline(prepare(cfg, get_algorithm("rdpcfl"), Environment), device="cpu")
    for a, b in zip(engine["history"], inline["history"], strict=True):
        for key in ("accuracy", "loss", "gmm_mss", "switch_round", "ari", "epsilon"):
            assert np.isclose(a[key], b[key], rtol=1e-6), (key, a[key], b[key])
    assert np.array_equal(engine["assignments"], inline["assignments"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final"]["num_clusters"] == 2 and "gmm_mss" in summary["final"]
