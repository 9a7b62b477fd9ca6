"""Every `raysim` command in the code blocks of the README and of docs/*.md runs, in its
documented form, with tiny sizes added as `--set` overrides (placeholders such as CONFIG filled
in, optional [...] parts left out). A documented command without a case here fails
`test_every_readme_command_is_covered`, so the docs and the code cannot drift apart."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from conftest import RAY_TIMEOUT_S

from raysim.cli.main import main

ROOT = Path(__file__).parents[1]
DEMO = ROOT / "raysim" / "demo.yaml"
FMNIST = Path("/usr/share/datasets/fashion-mnist")
needs_fmnist = pytest.mark.skipif(not FMNIST.is_dir(), reason="Fashion-MNIST not installed")

QUICK = ["runtime.progress=false", f"runtime.round_timeout_s={RAY_TIMEOUT_S}"]
TINY_DEMO = ["rounds=2", *QUICK]
TINY_FMNIST = [  # the papers' configs cut down: 8 clients of 60 images, 1 round
    "rounds=1",
    "data.num_clients=8",
    "data.cluster_sizes=[2, 2, 2, 2]",
    "data.cluster_ratios=null",
    "data.samples_per_client=60",
    "training.local_epochs=1",
    "training.sampling_rate=1.0",
    *QUICK,
]
TINY_POPULATION = [  # the million clients kept (made lazily), a cohort of about 20, 1 round
    "rounds=1",
    "training.sampling_rate=0.00002",
    "training.eval_clients=20",
    *QUICK,
]
CLUSTER_HERE = ["runtime.address=null", "runtime.num_workers=2", "runtime.gpus_per_worker=auto"]


def documented_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def readme_commands() -> list[str]:
    """`raysim ...` invocations in the bash blocks of the README and the docs, continuations
    joined, each once."""
    text = "\n".join(f.read_text() for f in documented_files())
    found: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            m = re.search(r"(?:^|&&\s+|\s--\s+)(raysim(?:\s.*)?)$", line)
            if m and " ".join(m.group(1).split()) not in found:
                found.append(" ".join(m.group(1).split()))
    return found


# documented command -> (extra --set overrides, needs Fashion-MNIST), in the order of
# README.md, then docs/*.md by name.
CASES: dict[str, tuple[list[str], bool]] = {
    "raysim run": (TINY_DEMO, False),
    "raysim run [CONFIG] [--set key=value ...] [--out DIR] [--algorithms a,b] [--overwrite]": (
        TINY_DEMO,
        False,
    ),
    "raysim report DIR [DIR ...]": ([], False),
    "raysim data describe [CONFIG]": ([], False),
    "raysim data export [CONFIG] --out pop.npz": ([], False),
    "raysim privacy [CONFIG] [--json]": ([], False),
    "raysim compare CONFIG --algorithms rdpcfl,ifca,fedavg,local --seeds 0,1,2": (
        ["rounds=1", *QUICK],
        False,
    ),
    "raysim sweep SWEEP.yaml [--scheduler asha]": ([], False),
    "raysim audit configs/audit_digits.yaml [--runs R] [--out DIR]": ([], False),
    "raysim list KIND": ([], False),
    "raysim --help": ([], False),
    "raysim audit configs/audit_digits.yaml --runs 1000000 --out runs/audit-client": ([], False),
    "raysim audit configs/audit_digits.yaml --adversary black-box --set privacy.mode=sample "
    "--set rounds=5 --set training.local_epochs=5 --set training.lr=0.5 "
    "--set privacy.client_seed=0 --out runs/audit-bb": (
        [],
        False,
    ),
    "raysim audit configs/audit_digits.yaml --adversary black-box --set rounds=5 "
    "--set training.local_epochs=5 --set training.lr=0.5 --out runs/audit-bb-client": ([], False),
    "raysim audit configs/audit_digits.yaml --adversary black-box --set privacy.mode=dprivacy "
    "--set privacy.client_seed=0 --out runs/audit-bb-dprivacy": ([], False),
    "raysim audit configs/audit_digits.yaml --adversary black-box --runs 1000 "
    "--out runs/audit-bb-mr": ([], False),
    "raysim run configs/dpfedavg_population.yaml --out runs/pop-real": (TINY_POPULATION, True),
    "raysim run configs/dpfedavg_population.yaml --out runs/pop-conv "
    "--set training.sampling_rate=0.001 --set privacy.noise_cohort_size=10000 "
    "--set privacy.population=1000000": (TINY_POPULATION, True),
    "raysim compare configs/rdpcfl_fmnist_rotation.yaml --inline --jobs 2 --algorithms rdpcfl "
    "--seeds 0,1,2 --set training.eval_every=10 --out results/e200-fmnist --resume": (
        TINY_FMNIST,
        True,
    ),
    "raysim compare configs/rdpcfl_fmnist_rotation.yaml --inline --jobs 2 "
    "--algorithms ifca,fedavg,local --seeds 0,1,2 --set training.eval_every=10 "
    "--set algorithm.num_clusters=4 --out results/e200-fmnist --resume": (TINY_FMNIST, True),
    "raysim compare configs/rdpcfl_fmnist_rotation.yaml --algorithms rdpcfl,ifca,local,fedavg "
    "--seeds 0,1,2,3 --set rounds=18 --inline": (TINY_FMNIST, True),
    "raysim sweep tune/sweeps/rdpcfl_eps_x_algorithm.yaml --out runs/sweep-eps [--num-samples N] "
    "[--scheduler asha] [--set rounds=6] [--max-concurrent 2]": (TINY_FMNIST, True),
    "raysim sweep tune/sweeps/rdpcfl_eps_x_algorithm.yaml --out runs/sweep-eps --resume": (
        TINY_FMNIST,
        True,
    ),
    "raysim run --resume runs/demo-20260101-120000": ([], False),
    "raysim run configs/rdpcfl_fmnist_rotation.yaml --out /tmp/runs/fmnist "
    "--set runtime.address=auto --set runtime.num_workers=16 --set runtime.gpus_per_worker=0.25": (
        [*CLUSTER_HERE, *TINY_FMNIST],
        True,
    ),
    "raysim sweep tune/sweeps/rdpcfl_eps_x_algorithm.yaml --set runtime.address=auto "
    "--out /tmp/sweeps/eps": ([*CLUSTER_HERE, *TINY_FMNIST], True),
    "raysim run CONFIG --set tracking.backend=tensorboard --out runs/tracked": (TINY_DEMO, False),
    "raysim completion bash": ([], False),
}


# commands that take minutes as written: run with `pytest -m slow`
SLOW = {"raysim audit configs/audit_digits.yaml --runs 1000000 --out runs/audit-client"}


def test_every_readme_command_is_covered():
    assert readme_commands() == list(CASES)


def _argv(command: str, tmp: Path, extra: list[str]) -> list[str]:
    """The documented tokens (optional parts dropped, placeholders and example paths filled
    in), then the tiny overrides (a later --set wins)."""
    command = re.sub(r"\s*\[[^\]]*\]", "", command)
    fill = {
        "CONFIG": str(DEMO),
        "KIND": "algorithms",
        "DIR": str(tmp / "demo-run"),
        "SWEEP.yaml": str(tmp / "tiny-sweep.yaml"),
        "/tmp/runs/fmnist": str(tmp / "runs-fmnist"),
        "/tmp/sweeps/eps": str(tmp / "sweeps-eps"),
    }
    tokens = [fill.get(t, t) for t in shlex.split(command)][1:]
    return tokens + sum((["--set", s] for s in extra), [])


def prepare_named(command: str, tmp: Path) -> None:
    """What a command needs to exist first: a finished run, an interrupted one, a sweep file."""
    if " DIR" in command and "report" in command:
        assert main(["run", "--out", str(tmp / "demo-run"), *_argv("", tmp, TINY_DEMO)]) == 0
    if "--resume runs/demo" in command:
        from algorithms import Environment, get_algorithm
        from raysim.config import load_config
        from raysim.engine.experiment import prepare
        from raysim.runtime.run import run_prepared

        cfg = load_config(DEMO, TINY_DEMO)
        prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)

        def stop(row):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            run_prepared(prep, Path("runs/demo-20260101-120000"), on_round=stop)
    if "SWEEP.yaml" in command:
        sweep = {
            "name": "tiny",
            "base": str(DEMO),
            "set": ["rounds=1", "runtime.num_workers=1", *QUICK],
            "space": {"algorithm.name": {"grid": ["fedavg", "rdpcfl"]}},
        }
        (tmp / "tiny-sweep.yaml").write_text(yaml.safe_dump(sweep))
    if command.endswith("--resume") and "compare" in command:  # a table to keep
        first = command.removesuffix(" --resume")
        assert main(_argv(first, tmp, CASES[command][0])) == 0
    if command.endswith("--resume") and "sweep" in command:
        first = command.removesuffix(" --resume")
        assert (
            main(
                _argv(
                    first,
                    tmp,
                    CASES[
                        first + " [--num-samples N] [--scheduler asha] "
                        "[--set rounds=6] [--max-concurrent 2]"
                    ][0],
                )
            )
            == 0
        )


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run from a scratch directory holding the repository's configs/ and tune/ (as a clone)."""
    for name in ("configs", "tune"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _params():
    out = []
    for i, (command, (_, fmnist)) in enumerate(CASES.items()):
        marks = [needs_fmnist, pytest.mark.slow] if fmnist else []
        marks += [pytest.mark.slow] if command in SLOW else []
        out.append(pytest.param(command, marks=marks, id=f"{i}-{command.split()[1]}"))
    return out


@pytest.mark.parametrize("command", _params())
def test_readme_command_runs(command, ray_session, in_tmp, capsys):
    extra, _ = CASES[command]
    prepare_named(command, in_tmp)
    argv = _argv(command, in_tmp, extra)
    if argv == ["--help"]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        return
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err


def _as_written(command: str) -> list[tuple[str, object]] | None:
    """Every run a README command starts, as (label, config), with the sizes it is written with
    (optional parts left out); None where it starts none of its own."""
    from raysim.cli.compare import configs_of, parser
    from raysim.cli.main import DEMO_ALGORITHMS
    from raysim.compose import for_algorithm
    from raysim.config import load_config

    argv = _argv(command, ROOT, [])
    if argv[0] not in ("run", "compare") or (argv[0] == "run" and "--resume" in argv):
        return None  # a sweep's trials: test_sweeps_ready; a resumed run: as it was started
    if argv[0] == "compare":
        args = parser().parse_args(argv[1:])
        algorithms, seeds = args.algorithms.split(","), [int(s) for s in args.seeds.split(",")]
        configs = configs_of(args.config, list(args.set or []), algorithms, seeds)
        return [(f"{c.algorithm.name} seed {c.seed}", c) for c in configs]
    sets = [argv[i + 1] for i, t in enumerate(argv) if t == "--set"]
    given = [t for t in argv[1:] if t.endswith(".yaml")]
    if given:
        return [(given[0], load_config(ROOT / given[0], sets))]
    demo = [load_config(DEMO, [*sets, f"algorithm.name={a}"]) for a in DEMO_ALGORITHMS]
    return [(cfg.algorithm.name, for_algorithm(cfg, quiet=True)) for cfg in demo]


def _starting() -> list:
    return [
        pytest.param(c, marks=[needs_fmnist] if f else [], id=f"{i}-{c.split()[1]}")
        for i, (c, (_, f)) in enumerate(CASES.items())
        if _as_written(c) is not None
    ]


@pytest.mark.parametrize("command", _starting())
def test_every_readme_experiment_can_start_as_written(command, capsys):
    """The runs above are cut down; here each command's own sizes are prepared (its data built,
    its noise calibrated), as `raysim compare` does before its first run: a budget the command
    as written cannot meet fails here, not in a user's hands. (The ready sweeps' trials:
    test_sweeps_ready.)"""
    from raysim.compose import check_budgets

    check_budgets(_as_written(command))
