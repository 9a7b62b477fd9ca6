"""Ctrl-C, and SIGTERM to the whole process group (`timeout`, `kill -TERM -PGID`), end
`raysim run` cleanly: exit code 130, no traceback, Ray's processes gone, and the run marked
interrupted in OUT.incomplete (the target directory is never half-written)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import small_config

ROOT = Path(__file__).parents[1]


def _descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid``, read from /proc (Linux)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are dead
            parent[int(stat.parent.name)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent.items() if p in frontier} - out
        out |= frontier
    return out


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm-to-group"])
def test_stop_exits_130_without_traceback_and_marks_the_run(tmp_path, stop):
    out = tmp_path / "run"
    sets = sum((["--set", s] for s in small_config(rounds=200, **{"model.name": "linear"})), [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli.main", "run", "--out", str(out), *sets],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        # A suite started in the background (`pytest ... &` from a script) has SIGINT ignored,
        # and a child inherits that: Python then never installs its Ctrl-C handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        # A group of its own, as a shell gives a job: the group signal reaches nothing else.
        start_new_session=stop == "sigterm-to-group",
    )
    metrics = tmp_path / "run.incomplete" / "metrics.parquet"
    deadline = time.monotonic() + 240
    while not metrics.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics.exists(), proc.stderr.read() if proc.poll() is not None else "no round ran"
    family = _descendants(proc.pid)  # Ray's processes among them
    if stop == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    else:  # Ray's daemons must not hear it: they would end the driver before it marks the run
        os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "raysim: interrupted" in err
    assert f"continue it with `raysim run --resume {out}`" in err  # where it is, how it goes on
    assert family
    deadline = time.monotonic() + 30
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(family)  # Ray shut down
    assert not out.exists()
    status = json.loads((tmp_path / "run.incomplete" / "status.json").read_text())
    assert status["status"] == "interrupted"
