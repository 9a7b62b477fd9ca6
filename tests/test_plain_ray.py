"""The plain path: a run on a local Ray started by a plain ``ray.init`` (``RAYSIM_PLAIN_RAY``)
with workers that Ray starts itself (``runtime.fork_workers=false``). The lean head and the
zygote reach into Ray's internals; this is what a user falls back to when a Ray release moves
them, so it is run here and must give the same results as the usual path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from conftest import small_config

from raysim.runtime.local_ray import PLAIN_RAY_ENV


def _run(out: Path, plain: bool) -> subprocess.CompletedProcess:
    sets = small_config(**{"rounds": 1, "runtime.fork_workers": "false" if plain else "true"})
    env = {**os.environ, PLAIN_RAY_ENV: "1" if plain else "0"}
    argv = [sys.executable, "-m", "raysim", "run", "--out", str(out)]
    argv += [a for s in sets for a in ("--set", s)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def test_a_run_on_plain_ray_gives_the_usual_results(tmp_path):
    plain, usual = _run(tmp_path / "plain", True), _run(tmp_path / "usual", False)
    assert plain.returncode == 0, plain.stderr
    assert usual.returncode == 0, usual.stderr
    assert json.loads((tmp_path / "plain" / "summary.json").read_text())["rounds"] == 1
    for name in ("metrics.parquet", "clients.parquet", "privacy.parquet"):
        a, b = (pq.read_table(tmp_path / d / name) for d in ("plain", "usual"))
        drop = [c for c in a.column_names if "seconds" in c or c == "wall"]
        assert a.drop_columns(drop).equals(b.drop_columns(drop)), name
