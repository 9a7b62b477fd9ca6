"""A local run's workers forked from the zygote (raysim/engine/zygote.py): they start with torch
loaded, as Ray's own workers would otherwise be (priority, process group, job), they go with
their launcher and with the driver, and a run gives the same bits with and without them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import small_config

from raysim.engine import zygote

ROOT = Path(__file__).parents[1]
PLAIN = json.dumps({"command_prefix": [], "env_vars": {}, "py_executable": sys.executable})


def _command(context: str = PLAIN, python: str = sys.executable, *flags: str) -> list[str]:
    return [
        python,
        "/ray/_private/workers/setup_worker.py",
        *flags,
        "/ray/_private/workers/default_worker.py",
        "--node-ip-address=127.0.0.1",
        f"--serialized-runtime-env-context={context}",
        "--language=PYTHON",
        "--startup-token=3",
    ]


def test_only_a_plain_python_worker_is_forked() -> None:
    env = {"HOME": "/h", "A": "0"}
    script = [
        "/ray/_private/workers/default_worker.py",
        "--node-ip-address=127.0.0.1",
        "--startup-token=3",
    ]
    assert zygote._worker_script(_command(), env) == (script, env)
    assert zygote._worker_script(_command("{}"), env) == (script, env)  # Ray's, for no runtime env
    # a runtime environment's variables (Tune's trials have one): set over the command's
    tune = json.dumps({"env_vars": {"A": "1", "PL_DISABLE_FORK": "1"}})
    assert zygote._worker_script(_command(tune), env) == (
        script,
        {"HOME": "/h", "A": "1", "PL_DISABLE_FORK": "1"},
    )
    declined = [
        _command(json.dumps({"env_vars": {"A": "${HOME}/x"}})),  # Ray would expand it
        _command(json.dumps({"command_prefix": ["conda", "run"]})),
        _command(json.dumps({"py_executable": "/other/python"})),
        _command(python="/other/python"),  # another interpreter than the zygote's
        _command(PLAIN, sys.executable, "-S"),  # interpreter flags the zygote was not run with
        [sys.executable, "/ray/_private/workers/default_worker.py"],  # not through setup_worker
        [c.replace("PYTHON", "JAVA") for c in _command()],
    ]
    for command in declined:
        assert zygote._worker_script(command, env) is None, command


def test_a_worker_that_would_load_other_code_is_not_forked() -> None:
    env = dict(os.environ)
    assert zygote.same_loader(env)
    for name in ("PYTHONPATH", "LD_PRELOAD", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"):
        assert not zygote.same_loader({**env, name: "/elsewhere"})


def test_the_launcher_runs_the_command_itself_where_there_is_no_zygote() -> None:
    launcher = [sys.executable, "-I", "-S", str(zygote.CLIENT), "raysim-zygote-absent"]
    proc = subprocess.Popen([*launcher, "/bin/sh", "-c", "echo $$; exit 3"], stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 3  # the command's own status
    assert int(out) == proc.pid  # it replaced the launcher: the PID the raylet watches


def _python(code: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (this one has Ray loaded), from the repository."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


PRELOAD_PROBE = """
import importlib.metadata as md, json, re, sys
from raysim.engine import zygote

zygote._preload()
assert "ray" not in sys.modules
before = {m.split(".")[0] for m in sys.modules}
import ray
after = {m.split(".")[0] for m in sys.modules}


def normal(name):
    return name.lower().replace("_", "-")


requirements = [r for r in md.requires("ray") or [] if "extra ==" not in r]
declared = {normal(re.split(r"[<>=!~;\\[ ]", r, maxsplit=1)[0]) for r in requirements}
modules = {m for m, ds in md.packages_distributions().items() if {normal(d) for d in ds} & declared}
print(json.dumps({"missed": sorted((after - before) & modules), "declared": sorted(declared)}))
"""


def test_the_zygote_preloads_what_ray_imports_from_its_dependencies() -> None:
    """Each forked worker imports Ray, which the zygote cannot load; the third-party packages
    Ray's import pulls in (about half its time) come preloaded. Fails where a new Ray imports
    another of its declared dependencies (add it to RAY_DEPENDENCIES) and where the list names
    one that Ray vendors, which a worker must load from Ray's own copy."""
    proc = _python(PRELOAD_PROBE, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["declared"] and out["missed"] == [], out
    import importlib.util

    vendored = Path(importlib.util.find_spec("ray").origin).parent / "thirdparty_files"
    bundled = {p.name for p in vendored.iterdir()} if vendored.is_dir() else set()
    assert not {name.split(".")[0] for name in zygote.RAY_DEPENDENCIES} & bundled


def test_what_a_preloaded_dependency_warns_stays_off_the_terminal(tmp_path, monkeypatch) -> None:
    """The zygote's stderr is the user's terminal; a worker's is its log."""
    (tmp_path / "raysim_warns_on_import.py").write_text(
        "import warnings\nwarnings.warn('mismatched versions', UserWarning)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(zygote, "RAY_DEPENDENCIES", ("raysim_warns_on_import",))
    monkeypatch.delitem(sys.modules, "raysim_warns_on_import", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zygote._preload()
    assert sys.modules.pop("raysim_warns_on_import", None) is not None  # it was loaded
    assert not [w for w in caught if "mismatched" in str(w.message)]


def test_a_zygote_forked_before_stays_with_its_owner(monkeypatch) -> None:
    """`raysim compare` and `raysim sweep` let go only of a zygote they forked themselves."""
    plan = zygote.Plan("raysim-zygote-test", (-1, -1), os.getpid(), forked=True)
    monkeypatch.setattr(zygote, "PLAN", plan)
    assert zygote.fork_here() is False and zygote.PLAN is plan and zygote.forked()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


PROBE = """
import json, os, signal, sys, time
from pathlib import Path
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("OMP_NUM_THREADS", None)  # torch's default in the zygote: the machine's cores
from raysim.engine import zygote

plan = zygote.plan()
child = os.fork()
if child == 0:  # as the prepare child: fork the zygote, then go
    import torch
    zygote.fork_planned()
    os._exit(0)
os.waitpid(child, 0)
os.close(plan.lifeline[0])
plan.forked = True

import ray
from raysim.runtime.local_ray import start_local_ray

start_local_ray(num_cpus=2)


@ray.remote(num_cpus=0.5)  # room for three at once on the two CPUs
class Probe:
    def report(self):
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "torch": "torch" in sys.modules,  # nothing here imports it
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "pgid": os.getpgid(0),
            "job": os.environ.get("RAY_JOB_ID"),
            "argv0": os.path.basename(sys.argv[0]),
            "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else 0,
            "probe_var": os.environ.get("RAYSIM_PROBE"),
        }


def launchers():
    out = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if any(a.endswith(b"/zygote_client.py") for a in cmd.read_bytes().split(b"\\0")):
                out.append(int(cmd.parent.name))
        except OSError:
            pass
    return out


first, second = Probe.remote(), Probe.remote()
reports = ray.get([first.report.remote(), second.report.remote()], timeout=180)
print("REPORTS", json.dumps(reports), flush=True)
stat = Path(f"/proc/{reports[0]['ppid']}/stat").read_text()
print("ZYGOTE_PARENT", stat.rsplit(")", 1)[1].split()[1], os.getpid(), flush=True)
print("LAUNCHERS", json.dumps(launchers()), flush=True)
ray.kill(first)  # its launcher leaves with it
deadline = time.monotonic() + 30
while Path(f"/proc/{reports[0]['pid']}").exists() and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(1.0)
print("LAUNCHERS_AFTER_KILL", json.dumps(launchers()), flush=True)
for pid in launchers():  # as the raylet kills a worker that never registered: by its launcher
    os.kill(pid, signal.SIGKILL)
deadline = time.monotonic() + 30
while Path(f"/proc/{reports[1]['pid']}").exists() and time.monotonic() < deadline:
    time.sleep(0.2)
print("SECOND_GONE", not Path(f"/proc/{reports[1]['pid']}").exists(), flush=True)
import socket
from raysim.engine.zygote_client import HEADER, request

with socket.socket(socket.AF_UNIX) as junk:  # a request that is none: dropped
    junk.connect("\\0" + plan.address)
    junk.sendall(b"garbage!")
with socket.socket(socket.AF_UNIX) as other:  # a command that is not a Ray worker's: declined
    other.connect("\\0" + plan.address)
    body = request(["/bin/true"])
    socket.send_fds(other, [HEADER.pack(len(body))], [0, 1, 2])
    other.sendall(body)
    print("DECLINED", other.recv(1).decode(), flush=True)
third = Probe.remote()  # the zygote still forks
print("THIRD", json.dumps(ray.get(third.report.remote(), timeout=180)), flush=True)
tune_like = Probe.options(num_cpus=0.01, runtime_env={"env_vars": {"RAYSIM_PROBE": "1"}}).remote()
print("ENV_VARS", json.dumps(ray.get(tune_like.report.remote(), timeout=180)), flush=True)
os._exit(0)  # no ray.shutdown: the zygote and its workers must still go
"""


def test_workers_are_forked_with_torch_loaded_and_go_with_the_driver() -> None:
    proc = _python(PROBE, timeout=400)
    lines = dict(
        line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0].isupper()
    )
    assert proc.returncode == 0 and "REPORTS" in lines, proc.stdout + proc.stderr[-3000:]
    reports = json.loads(lines["REPORTS"])
    workers = {r["pid"] for r in reports}
    zygotes = {r["ppid"] for r in reports}
    try:
        assert len(zygotes) == 1  # both forked by the same process
        env_vars = json.loads(lines["ENV_VARS"])  # a Tune trial's runtime env sets variables
        assert env_vars["ppid"] in zygotes and env_vars["probe_var"] == "1", env_vars
        workers.add(env_vars["pid"])
        for r in [*reports, env_vars]:
            assert r["torch"], r  # loaded before the worker started
            assert r["threads"] == 1, r  # as Ray gives a fresh worker of at most one CPU
            assert r["nice"] == 15 and r["pgid"] == r["pid"], r  # as the raylet's workers are
            assert r["job"] and r["argv0"] == "default_worker.py", r
        # the prepare child is gone and the driver, its orphans' reaper, is the zygote's parent
        parent, driver = lines["ZYGOTE_PARENT"].split()
        assert parent == driver
        launchers = json.loads(lines["LAUNCHERS"])
        assert len(launchers) >= 2  # one per worker, the raylet's children
        assert len(json.loads(lines["LAUNCHERS_AFTER_KILL"])) == len(launchers) - 1
        assert lines["DECLINED"] == "0"
        assert lines["SECOND_GONE"] == "True"  # its launcher killed, the zygote killed it
        third = json.loads(lines["THIRD"])
        workers.add(third["pid"])
        assert third["ppid"] in zygotes and third["torch"], third
        deadline = time.monotonic() + 30  # the driver left: the zygote and its workers go
        while any(_alive(p) for p in workers | zygotes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers | zygotes)
    finally:
        for pid in workers | zygotes:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _raysim(tmp_path: Path, *args: str) -> set[str]:
    """Run the CLI; the names of the processes that started its Tune trials (seen every 0.2 s)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli.main", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    parents: set[str] = set()
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        parents |= _trial_parents(proc.pid)
        time.sleep(0.2)
    _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 0, err[-3000:]
    return parents


def _trial_parents(driver: int) -> set[str]:
    """The names (``comm``) of the parents of this driver's Tune trial processes: the raylet's
    own children, or the zygote's (both the driver's children)."""
    names = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if not cmdline.read_bytes().startswith(b"ray::ImplicitFunc"):
                continue
            parent = _ppid(int(cmdline.parent.name))
            if _ppid(parent) == driver:
                names.add(Path(f"/proc/{parent}/comm").read_text().strip())
        except (OSError, ValueError, IndexError):
            continue
    return names


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cli_run(tmp_path: Path, name: str, **overrides: object):
    sets = [s for item in small_config(**overrides) for s in ("--set", item)]
    _raysim(tmp_path, "run", "--out", str(tmp_path / name), *sets)
    table = pq.read_table(tmp_path / name / "metrics.parquet").to_pandas()
    return table.drop(columns=["round_seconds"])


@pytest.mark.parametrize("mode", ["sample", "none"])
def test_a_run_gives_the_same_bits_with_forked_workers(tmp_path, mode) -> None:
    common = {"privacy.mode": mode, "runtime.client_group_size": 3}
    forked = _cli_run(tmp_path, "forked", **common)
    started = _cli_run(tmp_path, "started", **common, **{"runtime.fork_workers": "false"})
    assert forked.equals(started), (forked, started)


def _cli_sweep(tmp_path: Path, name: str, *sets: str):
    sweep = tmp_path / "sweep.yaml"
    space = {"privacy.epsilon": {"grid": [1, 8]}}
    config = small_config(rounds=1, **{"runtime.cpus_per_worker": 0.45})
    sweep.write_text(yaml.safe_dump({"name": "tiny", "set": config, "space": space}))
    sets = tuple(s for item in sets for s in ("--set", item))
    parents = _raysim(tmp_path, "sweep", str(sweep), "--out", str(tmp_path / name), *sets)
    trials = pd.read_parquet(tmp_path / name / "trials.parquet").sort_values("privacy.epsilon")
    return trials[["privacy.epsilon", "accuracy", "loss", "epsilon"]].reset_index(
        drop=True
    ), parents


@pytest.mark.slow  # 30 s; forked workers' bits are checked per run above, in the default suite
def test_a_sweep_gives_the_same_bits_with_forked_trials(tmp_path) -> None:
    """`raysim sweep` forks the zygote from its driver, and Tune's trial actors (whose runtime
    environment sets variables) start from it, not from the raylet."""
    forked, forked_by = _cli_sweep(tmp_path, "forked")
    started, started_by = _cli_sweep(tmp_path, "started", "runtime.fork_workers=false")
    assert started_by == {"raylet"}, started_by
    assert forked_by and "raylet" not in forked_by, forked_by
    assert forked["accuracy"].notna().all() and forked.equals(started), (forked, started)
