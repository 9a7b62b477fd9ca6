"""Limits before anything runs: a bound on rounds and a schedule sized against the machine,
messages of a readable length whatever the input, and the small input mistakes (an empty config,
a device, a relative module path) refused with exit 2 and the field named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raysim import limits
from raysim.cli.main import main
from raysim.config import (
    MAX_ROUNDS,
    MESSAGE_LIMIT,
    ConfigError,
    brief,
    load_config,
    shorten,
)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "raysim" / "demo.yaml"

# Runs the CLI in a child and reports its exit code, stderr, wall time and the peak RSS of the
# child and every process it waited for (RUSAGE_CHILDREN of this wrapper, which has no other).
_MEASURE = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
proc = subprocess.run([sys.executable, "-m", "raysim.cli.main", *sys.argv[1:]],
                      capture_output=True, text=True, timeout=120)
wall = time.perf_counter() - t0
peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"rc": proc.returncode, "err": proc.stderr, "wall": wall, "peak_kb": peak_kb}))
"""


def _measured(args: list[str], cwd: Path) -> dict:
    env_cmd = [sys.executable, "-c", _MEASURE, *args]
    out = subprocess.run(env_cmd, capture_output=True, text=True, cwd=cwd, check=True, timeout=180)
    return json.loads(out.stdout)


def _sweep_file(tmp_path: Path, space: dict) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "limits", "base": str(DEMO), "space": space}))
    return path


@pytest.mark.parametrize("command", ["run", "privacy", "compare", "sweep"])
def test_a_billion_rounds_is_refused_within_2_s_and_200_mb(command, tmp_path):
    args = {
        "run": ["run"],
        "privacy": ["privacy"],
        "compare": ["compare", str(DEMO), "--seeds", "0"],
        "sweep": ["sweep", str(tmp_path / "sweep.yaml")],
    }[command] + ["--set", "rounds=1000000000"]
    if command == "sweep":
        _sweep_file(tmp_path, {"seed": {"grid": [0, 1]}})
    got = _measured(args, tmp_path)
    assert got["rc"] == 2, got["err"]
    assert "rounds: must be <= 100000" in got["err"]
    assert "Traceback" not in got["err"]
    assert got["wall"] < 2.0, got
    assert got["peak_kb"] < 200 * 1024, got
    assert list(tmp_path.iterdir()) == ([tmp_path / "sweep.yaml"] if command == "sweep" else [])


def test_a_swept_rounds_value_over_the_bound_is_refused_naming_the_field(tmp_path):
    sweep = _sweep_file(tmp_path, {"rounds": {"grid": [2, 10**9]}})
    got = _measured(["sweep", str(sweep)], tmp_path)
    assert got["rc"] == 2 and "rounds" in got["err"] and "100000" in got["err"], got["err"]
    assert "Traceback" not in got["err"]


def test_rounds_bound_and_its_reason_are_in_the_field():
    with pytest.raises(ConfigError, match=r"rounds: must be <= 100000 .*memory grows"):
        load_config(DEMO, [f"rounds={MAX_ROUNDS + 1}"], lean=True)
    assert load_config(DEMO, [f"rounds={MAX_ROUNDS}"], lean=True).rounds == MAX_ROUNDS


def test_a_schedule_larger_than_memory_is_refused_before_anything_is_built(tmp_path):
    """10^5 rounds of 10^5 clients charged one by one: ~10 TB of ledger rows on any machine."""
    sets = ["rounds=100000", "data.num_clients=100000", "data.cluster_sizes=null"]
    for command in (["privacy"], ["run", "--out", str(tmp_path / "out")]):
        got = _measured([*command, *sum((["--set", s] for s in sets), [])], tmp_path)
        assert got["rc"] == 2, got["err"]
        assert "rounds=100000: the run would keep about" in got["err"]
        assert "memory available" in got["err"] and "Traceback" not in got["err"]
        assert got["wall"] < 10, got  # no data of 10^5 clients was built
    assert list(tmp_path.iterdir()) == []


def test_a_sweeps_trial_whose_schedule_cannot_fit_is_named(tmp_path):
    sweep = _sweep_file(tmp_path, {"rounds": {"grid": [2, 100000]}})
    sets = ["--set", "data.num_clients=100000", "--set", "data.cluster_sizes=null"]
    got = _measured(["sweep", str(sweep), *sets], tmp_path)
    assert got["rc"] == 2, got["err"]
    assert "trial rounds = 100000: rounds=100000: the run would keep" in got["err"]


def test_check_schedule_compares_the_estimate_with_available_memory(monkeypatch):
    cfg = load_config(DEMO, lean=True)
    size = limits.schedule_size(cfg)
    assert (size.rounds, size.cohort, size.models) == (20, 12, 3)  # sample-level: per client
    limits.check_schedule(cfg)  # ~1 MB: fits
    monkeypatch.setattr(limits, "available_memory", lambda: size.bytes)  # over half of it
    with pytest.raises(ConfigError, match=r"^rounds=20: .*\(20 rounds x 12 clients .* x 3 model"):
        limits.check_schedule(cfg)
    monkeypatch.setattr(limits, "available_memory", lambda: None)  # unknown: not refused
    limits.check_schedule(cfg)
    central = load_config(DEMO, ["privacy.mode=client", "privacy.delta=1e-3"], lean=True)
    assert limits.schedule_size(central).cohort == 1  # the population is one account


def _alias_bomb(levels: int = 9) -> str:
    lines, prev = ["a0: &a0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"], "a0"
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*{prev}'] * 9)}]")
        prev = f"a{i}"
    return "\n".join(lines) + f"\ndata:\n  cluster_sizes: *{prev}\n"


def test_a_yaml_alias_bomb_gets_a_short_message_naming_the_field(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())  # 9^9 integers once expanded
    got = _measured(["run", str(bomb)], tmp_path)
    assert got["rc"] == 2 and "Traceback" not in got["err"]
    assert "data.cluster_sizes" in got["err"]
    assert len(got["err"]) <= MESSAGE_LIMIT + len("raysim: \n"), len(got["err"])


def test_a_long_list_is_summarised_in_the_message(tmp_path, capsys):
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump({"data": {"num_clients": 12, "cluster_sizes": [1] * 200000}}))
    assert main(["privacy", str(config)]) == 2
    err = capsys.readouterr().err
    assert "data" in err and "cluster_sizes" in err and "(200000 items)" in err
    assert len(err) < 1000, len(err)


def test_messages_are_cut_to_the_limit_with_what_was_left_out():
    text = "x" * 10_000
    cut = shorten(text)
    assert MESSAGE_LIMIT - 5 <= len(cut) <= MESSAGE_LIMIT
    kept, tail = cut.split("... (")
    assert set(kept) == {"x"} and tail.endswith(" more characters)")
    assert len(kept) + int(tail.split()[0]) == len(text)
    assert len(str(ConfigError(text))) <= MESSAGE_LIMIT
    assert shorten("short") == "short"
    nested: list = [1]
    for _ in range(30):
        nested = [nested] * 9
    assert len(brief(nested)) < 400  # 6 x 6 elided sublists at most


@pytest.mark.parametrize("field", ["model.name", "algorithm.name"])
def test_a_relative_module_path_is_refused_with_exit_2(field, tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "o"), "--set", f"{field}=..os:system"]) == 2
    err = capsys.readouterr().err
    assert f"{field}: '..os:system' is not module:Name" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_an_empty_config_is_refused_saying_how_to_get_the_demo(tmp_path, capsys):
    for text in ("", "# only a comment\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        assert main(["privacy", str(empty)]) == 2
        err = capsys.readouterr().err
        assert "is empty" in err and "with no CONFIG runs the demo" in err and "{}" in err


def test_a_device_or_a_directory_as_config_is_not_a_file(tmp_path, capsys):
    assert main(["privacy", "/dev/null"]) == 2
    assert "'/dev/null' is a device, not a file" in capsys.readouterr().err
    assert main(["privacy", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["privacy", str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_data_root_that_is_a_file_is_not_a_directory(tmp_path, capsys):
    afile = tmp_path / "f.txt"
    afile.write_text("x")
    assert main(["privacy", "--set", f"data.root={afile}"]) == 2
    assert "is a directory, not" not in (err := capsys.readouterr().err)
    assert "data.root" in err and "not a directory" in err
    assert main(["privacy", "--set", "data.dataset=npz", "--set", f"data.root={tmp_path}"]) == 2
    assert "is a directory, not a file" in capsys.readouterr().err
    assert main(["attack", "dlg", "--data-root", str(afile)]) == 2
    assert f"--data-root {str(afile)!r} is not a directory" in capsys.readouterr().err


def test_renormalised_cluster_ratios_are_said(capsys):
    sets = ["--set", "data.cluster_sizes=null", "--set", "data.cluster_ratios=[0.5, 0.6]"]
    assert main(["data", "describe", *sets]) == 0
    err = capsys.readouterr().err
    assert "data.cluster_ratios [0.5, 0.6] add up to 1.1, not 1" in err
    assert "shares 0.455, 0.545" in err and "cluster sizes [5, 7]" in err
    sets[-1] = "data.cluster_ratios=[2, 1, 1]"  # weights, by design: nothing to say
    assert main(["data", "describe", *sets]) == 0
    assert "cluster_ratios" not in capsys.readouterr().err
