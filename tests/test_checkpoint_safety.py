"""A checkpoint is data (raysim.state.checkpoint) and a run directory is one run
(raysim.state.rundir): a crafted checkpoint never runs, a damaged one or an edited config.yaml is
refused before Ray starts, and a second writer is refused."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import inline_run

from raysim.cli.main import main
from raysim.config import ConfigError
from raysim.state import checkpoint as ck
from raysim.state import rundir
from raysim.state.checkpoint import CHECKPOINT, PREVIOUS

SETTINGS = {"rounds": 3, "model.name": "mlp", "privacy.mode": "none"}


class Payload:
    """What an attacker writes: unpickling it would run a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run stopped after round 2 of 3 (inline, no Ray): checkpoints after rounds 2 and 1."""
    out = tmp_path_factory.mktemp("safety") / "run"
    with pytest.raises(KeyboardInterrupt):
        inline_run(out, SETTINGS, die_after=2)
    return out


@pytest.fixture
def run(stopped, tmp_path) -> Path:
    """A copy of the stopped run, for one test to change."""
    out = tmp_path / "run"
    shutil.copytree(rundir.staging_dir(stopped), rundir.staging_dir(out))
    return out


@pytest.fixture
def no_run(monkeypatch):
    """Fails a test whose command gets as far as running (Ray would start there)."""

    def ran(*args, **kw):
        raise AssertionError("the run started: it should have been refused before")

    monkeypatch.setattr("raysim.cli.main.run_one", ran)  # `raysim run`
    monkeypatch.setattr("raysim.cli.common.run_one", ran)  # `raysim compare`


def _resume(out: Path, capsys) -> tuple[int, str]:
    code = main(["run", "--resume", str(out)])
    return code, capsys.readouterr().err


def test_a_checkpoint_holds_the_two_last_rounds(stopped):
    stage = rundir.staging_dir(stopped)
    assert ck.read_header((stage / CHECKPOINT).read_bytes())[0]["round"] == 2
    assert ck.read_header((stage / PREVIOUS).read_bytes())[0]["round"] == 1
    assert not list(stage.glob("*.tmp"))


@pytest.mark.parametrize("where", ["legacy", "legacy-prefixed", "raw", "nested"])
def test_a_crafted_checkpoint_never_runs(run, tmp_path, capsys, no_run, where):
    marker = tmp_path / "pwned"
    stage = rundir.staging_dir(run)
    evil = pickle.dumps(Payload(marker))
    if where.startswith("legacy"):  # an old raysim's file name, with or without its prefix
        (stage / CHECKPOINT).unlink()
        (stage / PREVIOUS).unlink()
        prefix = b"raysim:clients-apart:2\n" if where == "legacy-prefixed" else b""
        (stage / ck.LEGACY).write_bytes(prefix + evil)
    elif where == "raw":  # a pickle under today's name
        (stage / CHECKPOINT).write_bytes(evil)
    else:  # inside a field of a checkpoint whose header and checksums are right
        config = (stage / "config.yaml").read_text()
        loop = ck.encode_state({"round": 2, "history": [Payload(marker)]})
        (stage / CHECKPOINT).write_bytes(ck.join_checkpoint(loop, None, None, 2, config))
    before = (stage / "status.json").read_text()
    code, err = _resume(run, capsys)
    assert code == 2
    assert not marker.exists()  # nothing in it ran
    assert "Traceback" not in err
    assert ("pickle" if where != "nested" else "does not load") in err
    if where == "nested":
        assert "system" in err  # the global it named
        assert str(stage / CHECKPOINT) in err  # and the file it is in
    assert (stage / "status.json").read_text() == before  # not marked failed


def test_torch_refuses_any_global_outside_the_allowlist(tmp_path):
    marker = tmp_path / "pwned"
    blob = ck.encode_state({"state": [1, {"x": Payload(marker)}]})
    with pytest.raises(ck.CheckpointError, match="does not load"):
        ck.decode_state(blob)
    assert not marker.exists()
    # a bound method comes back only as a public method of an allowed class
    with pytest.raises(pickle.UnpicklingError):
        ck.method_of(rundir.Unfinished(Path("."), "", 0, None, None), "__init__")


def test_a_checkpoint_from_before_the_layout_resumes(monkeypatch):
    """A checkpoint written when the state classes lived in raysim.rebalancing and raysim.modes
    names them there: it decodes to today's classes, and a module that never held engine state
    stays refused."""
    import types

    import numpy as np

    from raysim.privacy.needs import PrivacyNeeds
    from raysim.server.rebalancing import Grouping

    state = {"g": Grouping(np.arange(3), np.zeros(3), np.array([0, 0, 1])), "n": PrivacyNeeds(None)}
    for cls, old in ((Grouping, "raysim.rebalancing"), (PrivacyNeeds, "raysim.modes.base")):
        monkeypatch.setitem(sys.modules, old, types.ModuleType(old))
        setattr(sys.modules[old], cls.__name__, cls)
        monkeypatch.setattr(cls, "__module__", old)
    blob = ck.encode_state(state)
    assert b"raysim.rebalancing" in blob and b"raysim.server" not in blob
    monkeypatch.undo()
    back = ck.decode_state(blob)
    assert type(back["g"]) is Grouping and type(back["n"]) is PrivacyNeeds
    assert back["g"].after.tolist() == [0, 0, 1]
    forged = blob.replace(b"raysim.rebalancing\nGrouping", b"raysim.seedingx\nGrouping")
    with pytest.raises(ck.CheckpointError):
        ck.decode_state(forged)


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign"])
def test_a_damaged_checkpoint_is_refused_and_nothing_is_lost(run, capsys, no_run, damage):
    stage = rundir.staging_dir(run)
    blob = (stage / CHECKPOINT).read_bytes()
    bad = {
        "truncated": blob[: len(blob) // 2],
        "flipped": blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:],
        "foreign": b"PK\x03\x04 not ours",
    }[damage]
    (stage / CHECKPOINT).write_bytes(bad)
    status = (stage / "status.json").read_text()
    code, err = _resume(run, capsys)
    assert code == 2 and "Traceback" not in err
    assert "previous checkpoint (after round 1) is intact" in err
    # nothing deleted, the run not marked failed: it can still go on from the previous one
    assert (stage / CHECKPOINT).read_bytes() == bad and (stage / PREVIOUS).is_file()
    assert (stage / "status.json").read_text() == status


def test_a_run_goes_on_from_the_previous_checkpoint_as_the_message_says(run, tmp_path):
    """The newest moved aside: the run continues from round 1's checkpoint, to the same
    results as one that never stopped."""
    whole = inline_run(tmp_path / "whole", SETTINGS)
    stage = rundir.staging_dir(run)
    (stage / CHECKPOINT).rename(tmp_path / "aside")
    blob = ck.load_checkpoint(stage)
    assert ck.read_header(blob)[0]["round"] == 1
    assert inline_run(run, SETTINGS, resume=blob).equals(whole)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_an_edited_config_is_refused_naming_the_keys(run, capsys, no_run, checkpointed):
    stage = rundir.staging_dir(run)
    if not checkpointed:  # a run stopped before its first checkpoint: the status has the config
        (stage / CHECKPOINT).unlink()
        (stage / PREVIOUS).unlink()
    config = stage / "config.yaml"
    text = config.read_text()
    assert "lr: 0.1" in text
    config.write_text(text.replace("lr: 0.1", "lr: 0.5").replace("seed: 0", "seed: 3"))
    code, err = _resume(run, capsys)
    assert code == 2
    assert "training.lr" in err and "seed" in err and "config.yaml differs" in err
    # runtime.* may change: how a run is executed, not what it computes
    config.write_text(text.replace("progress: false", "progress: true"))
    assert ck.config_digest(ck.config_record(config.read_text())) == ck.config_digest(
        ck.config_record(text)
    )


def _hold_lock(stage: Path) -> subprocess.Popen:
    """Another process holding the run's lock, as a running writer does."""
    code = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(stage / rundir.LOCK)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, str(os.getpid()).encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused(run, capsys, no_run, tmp_path):
    stage = rundir.staging_dir(run)
    holder = _hold_lock(stage)
    try:
        code, err = _resume(run, capsys)
        assert code == 2 and f"is being written by process {holder.pid}" in err
        # a new run onto it, even with --overwrite: refused, and the running run untouched
        files = sorted(p.name for p in stage.iterdir())
        with pytest.raises(Exception, match=f"being written by process {holder.pid}"):
            rundir.begin(run, "seed: 0\n", 3, overwrite=True, resume=False)
        # and `raysim run --overwrite` says so before it starts Ray (no_run: nothing may run)
        with pytest.raises(ConfigError, match=f"being written by process {holder.pid}"):
            rundir.check_target(run, overwrite=True)
        assert sorted(p.name for p in stage.iterdir()) == files
    finally:
        holder.kill()
        holder.wait()
    # once it is gone, the lock is free (a killed writer never leaves it held)
    rundir.lock(stage)
    rundir.release(stage)


def test_resume_needs_a_directory(capsys, no_run):
    for given in ("", "   ", "/"):
        assert main(["run", "--resume", given]) == 2
        err = capsys.readouterr().err
        assert "--resume" in err and "Traceback" not in err


def test_a_symbolic_link_is_not_replaced(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(Exception, match="symbolic link"):
        rundir.begin(tmp_path / "link", "seed: 0\n", 1, overwrite=True, resume=False)
    assert list(real.iterdir()) == []


def test_overwrite_swaps_the_runs_in_one_step(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 1\n")
    (out / "summary.json").write_text("{}")
    stage = rundir.begin(out, "seed: 2\n", 1, overwrite=True, resume=False)
    (stage / "summary.json").write_text(json.dumps({"new": True}))
    rundir.commit(stage, out)
    assert json.loads((out / "summary.json").read_text())["new"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no old run, no lock left
    assert not (out / rundir.LOCK).exists()


def test_a_full_disk_marks_the_run_failed_and_leaves_no_partial_file(run, tmp_path, monkeypatch):
    """The checkpoint of round 3 cannot be written: the run stops "failed" with the reason,
    no temporary file stays, and the checkpoints already written are whole."""
    stage = rundir.staging_dir(run)
    blob = ck.load_checkpoint(stage)
    kept = (stage / CHECKPOINT).read_bytes()
    real_fsync = os.fsync

    def full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(CHECKPOINT + ".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        inline_run(run, SETTINGS, resume=blob)
    status = json.loads((stage / "status.json").read_text())
    assert status["status"] == "failed" and "No space left" in status["error"]
    assert not list(stage.glob("*.tmp"))
    assert (stage / CHECKPOINT).read_bytes() == kept
    rundir.lock(stage)  # the lock was given back: this process can take it again
    rundir.release(stage)


def test_a_run_recorded_before_draws_continues_as_it_was_drawn(tmp_path, capsys):
    """A config.yaml without ``data.draws`` was recorded before per-client draws: the run is
    continued with the sequential draws it was made with, to the uninterrupted run's metrics,
    and its config.yaml says so from then on."""
    settings = {**SETTINGS, "data.draws": "sequential"}
    whole = inline_run(tmp_path / "whole", settings)
    died = tmp_path / "died"
    with pytest.raises(KeyboardInterrupt):
        inline_run(died, settings, die_after=1)
    config = rundir.staging_dir(died) / "config.yaml"
    text = config.read_text()
    assert "  draws: sequential\n" in text
    config.write_text(text.replace("  draws: sequential\n", ""))  # as raysim wrote it then
    blob = ck.load_checkpoint(rundir.staging_dir(died))
    rundir.date_recorded_draws(rundir.staging_dir(died))
    assert "predates data.draws" in capsys.readouterr().err
    resolved = config.read_text()
    assert "  draws: sequential\n" in resolved
    ck.check_config(blob, resolved, "resume")  # the checkpoint's record: the same run
    assert inline_run(died, settings, resume=blob).equals(whole)
    per_client = inline_run(tmp_path / "per_client", SETTINGS)
    assert not per_client.equals(whole)  # the draws decide the population
