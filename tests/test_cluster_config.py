"""cluster.yaml and cluster-onprem.yaml pass the Ray autoscaler's own schema (offline)."""

from __future__ import annotations

import copy
from pathlib import Path

import click
import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).parents[1]


def _check(raw: dict) -> dict:
    cfg = prepare_config(copy.deepcopy(raw))
    validate_config(cfg)
    return cfg


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-onprem.yaml"])
def test_cluster_files_are_valid(name):
    raw = yaml.safe_load((ROOT / name).read_text())
    cfg = _check(raw)
    assert cfg["head_node_type"] in cfg["available_node_types"]
    assert "~/raysim" in cfg["file_mounts"]
    assert any("pip install" in c and "~/raysim" in c for c in cfg["setup_commands"])


def test_aws_cluster_has_gpu_workers_and_a_cpu_head():
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]["node_config"]["InstanceType"]
    assert not head.startswith(("g", "p"))
    assert any(t["node_config"]["InstanceType"].startswith("g") for t in types.values())


@pytest.mark.parametrize(
    "name, breaking, error, message",
    [
        (
            "cluster.yaml",
            {"head_node_type": "nope"},
            ValueError,
            "`head_node_type` must be one of",
        ),
        (
            "cluster.yaml",
            {"no_such_key": 1},
            jsonschema.ValidationError,
            "'no_such_key' was unexpected",
        ),
        (  # the local provider's own check, in prepare_config (it exits a CLI with this)
            "cluster-onprem.yaml",
            {"provider": {"type": "local", "head_ip": "10.0.0.1"}},
            click.ClickException,
            "list of `worker_ips`",
        ),
    ],
)
def test_the_schema_check_catches_mistakes(name, breaking, error, message):
    raw = yaml.safe_load((ROOT / name).read_text())
    raw.update(breaking)
    with pytest.raises(error, match=message):
        _check(raw)
