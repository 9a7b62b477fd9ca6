"""docs/architecture.md's "Adding an algorithm" walkthrough runs as written, through the CLI."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from raysim.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def walkthrough_code() -> str:
    text = DOC.read_text()
    section = text[text.index("## Adding an algorithm") : text.index("## Adding a privacy mode")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_walkthrough_algorithm_runs_through_the_cli(tmp_path, monkeypatch):
    (tmp_path / "walkthrough_algo.py").write_text(walkthrough_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "runs"
    argv = [
        "compare",
        str(DOC.parents[1] / "raysim" / "demo.yaml"),
        "--algorithms",
        "walkthrough_algo:FedAvgM",
        "--seeds",
        "0",
        "--inline",
        "--out",
        str(out),
        "--set",
        "rounds=3",
        "--set",
        "data.dataset=digits",
        "--set",
        "data.num_clients=8",
        "--set",
        "data.cluster_sizes=[4,4]",
        "--set",
        "model.name=linear",
        "--set",
        "privacy.mode=client",
        "--set",
        "privacy.delta=0.01",
        "--set",
        "privacy.epsilon=4",
        "--set",
        "algorithm.beta=0.5",
        "--set",
        "runtime.progress=false",
    ]
    assert main(argv) == 0
    summary = json.loads(next(out.glob("*/seed0/summary.json")).read_text())
    assert summary["algorithm"] == "walkthrough_algo:FedAvgM" and summary["rounds"] == 3
    assert 0 < summary["epsilon"] <= 4.0 + 1e-9  # the noisy sums were charged
    assert summary["final_accuracy"] > 0.1
    sys.modules.pop("walkthrough_algo", None)
