"""Paths stay where the user put them: the config's name is one directory under runs/, --out is
never a system directory, files about several runs go only into a directory raysim made, data
export replaces a file only when asked and leaves no partial file, and report reads what it can.
Every refusal here comes before anything is written: no test writes outside tmp_path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raysim.cli.main import main
from raysim.config import ConfigError, load_config
from raysim.state import rundir

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "raysim" / "demo.yaml"


@pytest.mark.parametrize(
    "name", ["../../etc/evil", "/etc/evil", "a/b", "..", "runs\\x", "-rf", ".hidden", "x" * 129]
)
def test_a_name_that_is_not_one_plain_directory_is_refused(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--set", f"name={name}"]) == 2
    err = capsys.readouterr().err
    assert "name: must be a plain name" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # not even runs/
    load_config(DEMO, ["name=my-run_2.v1"], lean=True)  # a plain name is fine


@pytest.mark.parametrize(
    "path", ["/", "/etc", "/etc/x", "/usr/lib/x/y", "/fedavg", "/usr/x", "/var/log", "/home/x"]
)
def test_system_directories_and_their_entries_are_refused(path):
    with pytest.raises(ConfigError, match=r"^--out .*(system directory|directly in /)"):
        rundir.check_place(Path(path))


@pytest.mark.parametrize("path", ["/usr/src/app/runs", "/var/tmp/x/y", "/home/me/runs/a"])
def test_deeper_places_under_shared_tops_are_the_users(path):
    rundir.check_place(Path(path))  # nothing is written: the check reads paths only


def test_a_symlink_into_a_system_directory_is_followed(tmp_path):
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(ConfigError, match="leads to '/etc/x'"):
        rundir.check_place(tmp_path / "link" / "x")
    rundir.check_place(tmp_path / "mine" / "x")


@pytest.mark.parametrize("out", ["/", "/etc/raysim-test-never-made"])
def test_run_refuses_a_system_out_before_reading_the_config(out, capsys):
    # an invalid config too: were --out accepted, the config would still stop the run
    assert main(["run", "--out", out, "--set", "data.dataset=nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raysim: --out {out!r} is") and "Traceback" not in err
    assert not Path("/etc/raysim-test-never-made").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", str(DEMO), "--out", "/etc/raysim-test-never-made"],
        ["sweep", str(ROOT / "tune/sweeps/rdpcfl_m_candidates.yaml"), "--out", "/proc/x"],
        ["attack", "dlg", "--out", "/sys/raysim-x"],
        ["data", "export", "--out", "/etc/raysim-test.npz"],
    ],
)
def test_every_command_that_writes_refuses_system_directories(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "system directory" in err and "Traceback" not in err
    assert not Path("/etc/raysim-test-never-made").exists()


def _user_dir(tmp_path: Path) -> Path:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "comparison.png").write_bytes(b"my own figure")
    (mine / "compare.md").write_text("my own notes")
    (mine / "notes.txt").write_text("keep me")
    return mine


def test_a_multi_algorithm_run_never_writes_into_a_users_directory(tmp_path, capsys):
    mine = _user_dir(tmp_path)
    assert main(["run", "--algorithms", "fedavg,local", "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "raysim did not make" in err and "--out" in err
    assert sorted(p.name for p in mine.iterdir()) == ["compare.md", "comparison.png", "notes.txt"]
    assert (mine / "comparison.png").read_bytes() == b"my own figure"


def test_a_compare_never_writes_its_table_into_a_users_directory(tmp_path, capsys):
    mine = _user_dir(tmp_path)
    for extra in ([], ["--report-only"]):
        argv = ["compare", str(DEMO), "--algorithms", "fedavg", "--seeds", "0", "--out", str(mine)]
        assert main([*argv, *extra]) == 2
        assert "raysim did not make" in capsys.readouterr().err
    assert (mine / "compare.md").read_text() == "my own notes"


def test_directories_raysim_made_are_recognised(tmp_path):
    rundir.check_home(tmp_path / "new")  # absent
    (tmp_path / "empty").mkdir()
    rundir.check_home(tmp_path / "empty")
    rundir.mark_home(tmp_path / "marked")
    (tmp_path / "marked" / "comparison.png").write_bytes(b"png")
    rundir.check_home(tmp_path / "marked")
    old = tmp_path / "old"  # a multi-algorithm run written before the marker
    for algorithm in ("fedavg", "local"):
        (old / algorithm).mkdir(parents=True)
        (old / algorithm / "config.yaml").write_text("rounds: 1\n")
    (old / "comparison.png").write_bytes(b"png")
    rundir.check_home(old)
    compare = tmp_path / "cmp"  # a compare's, before the marker: ALGORITHM/seedS
    (compare / "fedavg" / "seed0").mkdir(parents=True)
    (compare / "fedavg" / "seed0" / "config.yaml").write_text("rounds: 1\n")
    (compare / "fedavg" / "seed1.incomplete").mkdir()
    (compare / "compare.md").write_text("| table |")
    rundir.check_home(compare)
    (compare / "fedavg" / "mine.txt").write_text("not raysim's")
    with pytest.raises(ConfigError, match="did not make"):
        rundir.check_home(compare)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        rundir.check_home(tmp_path / "afile")


def test_a_marker_alone_is_removed_with_its_directory(tmp_path):
    rundir.mark_home(tmp_path / "made")
    rundir.remove_if_unused(tmp_path / "made")
    assert not (tmp_path / "made").exists()
    rundir.mark_home(tmp_path / "used")
    (tmp_path / "used" / "fedavg").mkdir()
    rundir.remove_if_unused(tmp_path / "used")
    assert (tmp_path / "used" / "fedavg").is_dir()


def test_data_export_replaces_a_file_only_with_overwrite(tmp_path, capsys):
    out = tmp_path / "pop.npz"
    out.write_bytes(b"the user's own arrays")
    assert main(["data", "export", "--out", str(out)]) == 2
    assert "already exists: pass --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == b"the user's own arrays"
    assert main(["data", "export", "--out", str(out), "--overwrite"]) == 0
    import numpy as np

    with np.load(out) as arrays:
        assert "y_train" in arrays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pop.npz"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes
    (tmp_path / "adir.npz").mkdir()
    assert main(["data", "export", "--out", str(tmp_path / "adir.npz"), "--overwrite"]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_data_export_leaves_no_partial_file_when_writing_fails(tmp_path, monkeypatch, capsys):
    import errno

    import numpy as np

    def full_disk(file, **arrays):
        file.write(b"half an archive")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    out = tmp_path / "pop.npz"
    assert main(["data", "export", "--out", str(out)]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _finished_run(path: Path, algorithm: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("rounds: 2\n")
    summary = {"algorithm": algorithm, "dataset": "digits", "rounds": 2, "seed": 0}
    summary.update(privacy_mode="none", epsilon=None, delta=None, privacy={})
    (path / "summary.json").write_text(json.dumps({**summary, "final": {"accuracy": 0.5}}))
    table = pa.table({"round": [1, 2], "accuracy": [0.4, 0.5], "epsilon": [0.0, 0.0]})
    pq.write_table(table, path / "metrics.parquet")
    return path


def test_report_skips_and_names_a_run_it_cannot_read(tmp_path, capsys):
    good = _finished_run(tmp_path / "runs" / "fedavg", "fedavg")
    _finished_run(tmp_path / "runs" / "local", "local")
    bad = _finished_run(tmp_path / "runs" / "broken", "broken")
    (bad / "metrics.parquet").write_bytes(b"PAR1 not a parquet file")
    assert main(["report", str(tmp_path / "runs")]) == 0
    captured = capsys.readouterr()
    assert f"skipped {bad}: cannot read it" in captured.err
    assert "reporting 2 of 3 runs" in captured.err
    assert str(good) in captured.out and "broken" not in captured.out
    assert (tmp_path / "runs-report.html").is_file()  # beside the runs, not in them
    assert not (tmp_path / "runs" / "comparison.png").exists()
    (good / "metrics.parquet").write_bytes(b"")
    (tmp_path / "runs" / "local" / "summary.json").write_text("{not json")
    assert main(["report", str(tmp_path / "runs"), "--overwrite"]) == 2  # nothing left
    assert "no finished run to report" in capsys.readouterr().err
