"""The command line's own entry points: --version, python -m raysim, and `raysim list`."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from raysim.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_distribution(capsys):
    import raysim

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"raysim {version(raysim.DISTRIBUTION)}"
    assert raysim.__version__ == version("raysim-dpfl") == version(raysim.DISTRIBUTION)


def test_python_dash_m_raysim_is_the_command():
    out = subprocess.run(
        [sys.executable, "-m", "raysim", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "usage: raysim" in out.stdout and "list" in out.stdout


def _listed(kind: str, capsys) -> list[str]:
    assert main(["list", kind]) == 0
    return [line.split()[0] for line in capsys.readouterr().out.splitlines()]


def test_list_algorithms_names_every_registered_one(capsys):
    from algorithms import ALGORITHMS

    names = _listed("algorithms", capsys)
    assert names == list(ALGORITHMS)
    assert {"pina", "dp_group", "kmeans_cfl_sketch", "rr_cluster"} <= set(names)


def test_list_modes_and_datasets_follow_the_config(capsys):
    from raysim.config import DATASETS, PRIVACY_MODES

    assert _listed("modes", capsys) == list(PRIVACY_MODES)
    assert _listed("datasets", capsys) == list(DATASETS)


def test_list_configs_and_sweeps_are_the_shipped_files(capsys):
    configs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))
    sweeps = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tune/sweeps").glob("*.yaml"))
    assert _listed("configs", capsys) == configs and "configs/pina_quick.yaml" in configs
    assert _listed("sweeps", capsys) == sweeps


def test_each_line_is_one_sentence_of_its_docstring():
    from raysim.cli.catalog import first_sentence

    assert first_sentence("FedProx (Li et al. 2020): FedAvg with a proximal term. More.") == (
        "FedProx (Li et al. 2020): FedAvg with a proximal term"
    )
    assert first_sentence("``privacy.mode: client``: client-level DP.") == "client-level DP"
    assert len(first_sentence("x " * 200)) == 100


def test_an_unknown_kind_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["list", "models"])
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_the_command_line_loads_without_torch():
    """Every command's parser is built before a run's prepare child loads torch: a subcommand
    that imports torch (or scipy) at registration slows every command's refusal by seconds."""
    code = (
        "import sys; from raysim.cli.main import parser; parser(); "
        "print(sorted(m for m in ('torch', 'scipy', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
