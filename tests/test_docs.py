"""The documentation: docs/architecture.md's "Adding an algorithm" walkthrough runs as written,
through the CLI; the site builds with no warning; no page points outside the repository."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from raysim.cli.main import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def walkthrough_code(start: str = "## Adding an algorithm", end: str = "## Adding a privacy mode"):
    text = DOC.read_text()
    section = text[text.index(start) : text.index(end)]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_walkthrough_algorithm_runs_through_the_cli(tmp_path, monkeypatch):
    (tmp_path / "walkthrough_algo.py").write_text(walkthrough_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "runs"
    argv = [
        "compare",
        str(DOC.parents[1] / "raysim" / "demo.yaml"),
        "--algorithms",
        "walkthrough_algo:TrimmedMean",
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
        "privacy.mode=sample",
        "--set",
        "privacy.delta=0.001",
        "--set",
        "privacy.epsilon=4",
        "--set",
        "algorithm.trim=0.25",
        "--set",
        "algorithm.server_momentum=0.5",
        "--set",
        "runtime.progress=false",
    ]
    assert main(argv) == 0
    summary = json.loads(next(out.glob("*/seed0/summary.json")).read_text())
    assert summary["algorithm"] == "walkthrough_algo:TrimmedMean" and summary["rounds"] == 3
    assert 0 < summary["epsilon"] <= 4.0 + 1e-9  # DP-SGD was charged
    assert summary["final_accuracy"] > 0.1
    sys.modules.pop("walkthrough_algo", None)


def test_walkthrough_privacy_mode_runs_through_the_cli(tmp_path, monkeypatch, capsys):
    """The "Adding a privacy mode" walkthrough: named as module:Name, it runs FedAvg (which
    declares sample, the mode it serves as); `raysim privacy` plans exactly the budget, the run
    charges no more, and what crossed is the mode's mechanism at its calibrated noise."""
    import pandas as pd

    code = walkthrough_code("## Adding a privacy mode", "## Adding a model or a dataset")
    (tmp_path / "walkthrough_mode.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "runs"
    sets = [
        "rounds=3",
        "data.dataset=digits",
        "data.num_clients=8",
        "data.cluster_sizes=[4,4]",
        "model.name=linear",
        "privacy.mode=walkthrough_mode:LocalGaussian",
        "privacy.delta=0.001",
        "privacy.epsilon=4",
        "privacy.clip=1",
        "training.sampling_rate=1",
        "runtime.progress=false",
    ]
    flags = [x for kv in sets for x in ("--set", kv)]
    demo = str(DOC.parents[1] / "raysim" / "demo.yaml")
    assert main(["privacy", demo, "--json", *flags]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["epsilon"] == pytest.approx(4.0, rel=2e-3)  # calibrated to the budget
    argv = ["compare", demo, "--algorithms", "fedavg", "--seeds", "0", "--inline"]
    assert main([*argv, "--out", str(out), *flags]) == 0
    run = next(out.glob("*/seed0"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["privacy_mode"] == "walkthrough_mode:LocalGaussian"
    assert summary["epsilon"] == pytest.approx(planned["epsilon"], rel=1e-6)
    ledger = pd.read_parquet(run / "privacy.parquet")
    assert set(ledger["mechanism"]) == {"local_gaussian"}
    # an algorithm that declares no mode served as this one is refused before anything runs
    refused = ["compare", demo, "--algorithms", "pina", "--seeds", "0", "--inline"]
    assert main([*refused, "--out", str(tmp_path / "pina"), *flags]) == 2
    assert "does not support 'walkthrough_mode:LocalGaussian'" in capsys.readouterr().err
    sys.modules.pop("walkthrough_mode", None)


def test_what_users_read_points_nowhere_outside_the_repository():
    """README, docs, configs, sweeps, scripts and the package's text name no file the
    repository does not hold (the developers' notes, the papers' local copies) and no issue
    number of the project's tracker: a user has neither."""
    import re

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(
        r"\.\./shared|DESIGN\.md|FIELD-NOTES|\bpaper 00\d|\bappendix 00\d|\bissues? \d+",
        re.IGNORECASE,
    )
    files = [root / "README.md", *(root / "docs").rglob("*.md")]
    for folder, ext in (("configs", "yaml"), ("tune", "yaml"), ("scripts", "py"), ("raysim", "py")):
        files += (root / folder).rglob(f"*.{ext}")
    files += (root / "algorithms").glob("*.py")
    found = [
        f"{f.relative_to(root)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, an image that is not there or a page left out of
    the navigation fails it."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "site" / "privacy" / "index.html").is_file()
    # the Python API's page is read from raysim.api: every public name of it is documented there
    import inspect

    import raysim.api

    api_page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    public = [
        name
        for name, obj in vars(raysim.api).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == "raysim.api"
    ]
    assert {"run", "compare", "sweep", "audit", "privacy", "load"} <= set(public)
    for name in public:
        assert f'id="raysim.api.{name}"' in api_page, name


def test_reference_pages_are_what_the_code_generates():
    """docs/reference/ is generated (``python -m raysim.reference``): a flag or config field
    added without regenerating fails here, so the reference never falls behind the code."""
    from raysim import reference

    for name, make in reference.PAGES.items():
        if name == "cli.md" and sys.version_info[:2] != (3, 11):
            continue  # argparse's help layout differs between Python versions; pages made on 3.11
        committed = (reference.DOCS / name).read_text()
        assert make() == committed, f"docs/reference/{name} is stale: python -m raysim.reference"


def test_config_schema_validates_a_shipped_config():
    """The JSON Schema editors read accepts what raysim accepts and names a bad key's type."""
    import jsonschema
    import yaml

    from raysim import reference

    schema = json.loads((reference.DOCS / "config.schema.json").read_text())
    root = Path(__file__).resolve().parents[1]
    jsonschema.validate(
        yaml.safe_load((root / "configs" / "rdpcfl_quick.yaml").read_text()), schema
    )
    try:
        jsonschema.validate({"rounds": "many"}, schema)
    except jsonschema.ValidationError as err:
        assert "rounds" in str(list(err.absolute_path)) or "many" in err.message
    else:
        raise AssertionError("a string for rounds passed the schema")
