"""The benchmark's reading of the host's steal time and of other processes' CPU use
(benchmarks/engine_vs_loop.py)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_vs_loop.py"
_spec = importlib.util.spec_from_file_location("engine_vs_loop", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_cpu_ticks_reads_steal_and_total(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user)
    stat.write_text("cpu  100 5 20 800 10 0 5 60 7 0\ncpu0 1 2 3\n")
    assert bench.cpu_ticks(str(stat)) == (60, 1000)


def test_cpu_ticks_without_a_steal_column(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 20 800\n")
    assert bench.cpu_ticks(str(stat)) is None
    assert bench.cpu_ticks(str(tmp_path / "missing")) is None


def test_steal_share_over_an_interval() -> None:
    assert bench.steal_share((60, 1000), (160, 1400)) == pytest.approx(0.25)
    assert bench.steal_share(None, (1, 2)) is None
    assert bench.steal_share((5, 100), (5, 100)) is None  # no time passed


def test_busy_ticks_and_the_share_of_other_processes(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 20 800 10 0 5 60 7 0\n")
    assert bench.busy_ticks(str(stat)) == (130, 1000)  # user + nice + system + irq + softirq
    assert bench.busy_ticks(str(tmp_path / "missing")) is None
    # 400 ticks of the machine's time passed, 300 were busy, 100 of them ours: 50% others
    assert bench.others_share((130, 1000), (430, 1400), ours=100) == pytest.approx(0.5)
    # ours read a little high (a reaped process's ticks are rounded up): never below 0
    assert bench.others_share((130, 1000), (230, 1400), ours=120) == 0.0
    assert bench.others_share(None, (1, 2), ours=0) is None


def test_process_ticks_count_this_process_s_cpu_time() -> None:
    before = bench.process_ticks(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn 0.3 CPU-s
        pass
    after = bench.process_ticks(os.getpid())
    hz = os.sysconf("SC_CLK_TCK")
    assert after - before >= 0.25 * hz
    assert bench.process_ticks(2**22 + 7) is None  # no such process


def test_a_rep_contended_by_other_processes_runs_again() -> None:
    seq = iter([{"steal": 0.0, "others": 0.4, "wall": 1.0}, {"steal": 0.0, "others": 0.01}])
    args = argparse.Namespace(retries=2)
    assert bench.quiet_rep("raysim", 0, args, lambda: next(seq))["others"] == 0.01
    assert bench.contention({"steal": None, "others": None}) == 0.0
    assert bench.contention({"steal": 0.02, "others": 0.3}) == 0.3


def test_a_contended_rep_runs_again_up_to_the_retries() -> None:
    def runs(steals):
        seq = iter(steals)
        return lambda: {"steal": next(seq), "wall": 1.0}

    args = argparse.Namespace(retries=2)
    assert bench.quiet_rep("loop", 0, args, runs([0.0, 0.5]))["steal"] == 0.0  # quiet: kept
    assert bench.quiet_rep("loop", 0, args, runs([0.3, 0.02, 0.9]))["steal"] == 0.02
    assert bench.quiet_rep("loop", 0, args, runs([0.3, 0.2, 0.1, 0.0]))["steal"] == 0.1  # last
    assert bench.quiet_rep("loop", 0, args, runs([None, 0.5]))["steal"] is None  # unreadable
    none = argparse.Namespace(retries=0)
    assert bench.quiet_rep("loop", 0, none, runs([0.4, 0.0]))["steal"] == 0.4


def test_a_raysim_rep_run_again_writes_over_its_contended_try(tmp_path: Path, monkeypatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def fake_raysim(cmd: list[str], poll: list[Path]) -> dict:
        out = Path(cmd[cmd.index("--out") + 1])
        if out.exists() or poll[0].parent.exists():  # as `raysim run` refuses a used --out
            raise RuntimeError(f"--out {out} already holds a run")
        poll[0].parent.mkdir()  # the staging directory a run leaves behind when it is killed
        out.mkdir()
        pq.write_table(pa.table({"round_seconds": [2.0, 1.0, 1.0]}), out / "metrics.parquet")
        (out / "summary.json").write_text('{"startup_seconds": {"first_round": 5.0}}')
        return {"t0": 0.0, "wall": 9.0, "seen": 7.0, "steal": 0.0, "others": 0.3}

    monkeypatch.setattr(bench, "run_child", fake_raysim)
    args = argparse.Namespace(rounds=3, workers=2, clients=1000, dp=False, set=None, retries=2)

    def rep() -> dict:
        return bench.engine_rep(args, tmp_path, 0)

    assert rep()["first_round"] == 5.0  # round 1 seen at 7.0 s, started at 0.0, lasted 2.0
    # contended (others 30%): quiet_rep runs it twice more, into the same directories
    assert bench.quiet_rep("raysim", 0, args, rep)["startup"] == {"first_round": 5.0}
