"""The runs committed under results/ (the README's E = 200 tables, built up over sessions): each
one was made by the README's command with today's code and config, an unfinished one can still
be continued from its checkpoint, and ``compare --report-only`` reads them all."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from algorithms import get_algorithm
from raysim.cli.compare import compare_main
from raysim.compose import for_algorithm
from raysim.config import changed_keys, dump_config, load_config, with_client_seed
from raysim.engine.rounds import CHECKPOINT_FIELDS
from raysim.state.checkpoint import (
    CHECKPOINT,
    decode_state,
    load_checkpoint,
    split_checkpoint,
)
from raysim.state.rundir import SUFFIX, find_runs

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
# results/<folder>: the config of the README's command that writes it
TABLES = {
    "e200-fmnist": "configs/rdpcfl_fmnist_rotation.yaml",
    "e200-mnist": "configs/rdpcfl_mnist_rotation.yaml",
}


def readme_sets(algorithm: str) -> list[str]:
    """The README's --set values: rdpcfl picks M itself, the others are given the paper's 4."""
    sets = ["training.eval_every=10"]
    return sets if algorithm == "rdpcfl" else [*sets, "algorithm.num_clusters=4"]


def committed_runs() -> list[Path]:
    return sorted(p for t in TABLES for p in (RESULTS / t).glob("*/seed*") if p.is_dir())


# results/<folder> written by a script, not by runs: the script and the docs page quoting it
SCRIPT_TABLES = {
    "galli-synthetic": ("scripts/galli_synthetic.py", "docs/results/group-privacy.md"),
    "galli-fmnist-rotation": ("scripts/galli_nu_table.py", "docs/results/group-privacy.md"),
    "ifca-ablation": ("scripts/ifca_ablation.py", "docs/results/rdpcfl.md"),
    "pina-fmnist-rotation": ("scripts/pina_table.py", "docs/results/pina.md"),
}


def test_every_results_folder_is_a_known_table():
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    known = set(TABLES) | set(SCRIPT_TABLES)
    assert folders <= known, f"add {sorted(folders - known)} to TABLES or SCRIPT_TABLES"
    assert committed_runs(), "results/ holds no run"


@pytest.mark.parametrize("folder", sorted(SCRIPT_TABLES))
def test_a_scripts_table_is_what_its_docs_page_quotes(folder):
    """What the script wrote is the docs page's (so a rerun that changes it must change the
    page too): every row of its table.md, word for word; for galli-synthetic, each row's "both
    within 1" shares, at T and at the stop."""
    script, page = SCRIPT_TABLES[folder]
    assert (REPO / script).is_file()
    text = (REPO / page).read_text()
    if folder != "galli-synthetic":  # the page quotes its table.md whole
        rows = [r for r in (RESULTS / folder / "table.md").read_text().splitlines() if r[:1] == "|"]
        assert rows and [r for r in rows if r not in text.splitlines()] == []
        return
    summary = json.loads((RESULTS / folder / "summary.json").read_text())
    for setting, row in summary.items():
        shares = f"{100 * row['both_within_1']:.0f}%"
        stop = f"{100 * row['by_patience']['6']['both_within_1']:.0f}%"
        quoted = [line for line in text.splitlines() if line.startswith("|") and shares in line]
        assert any(stop in line for line in quoted), (setting, shares, stop)


@pytest.mark.parametrize("run_dir", committed_runs(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_run_is_the_readme_command_and_can_go_on(run_dir):
    algorithm, seed = run_dir.parent.name, int(re.match(r"seed(\d+)", run_dir.name)[1])
    sets = [*readme_sets(algorithm), f"algorithm.name={algorithm}", f"seed={seed}"]
    cfg = for_algorithm(load_config(REPO / TABLES[run_dir.parents[1].name], sets), quiet=True)
    saved = load_config(run_dir / "config.yaml")
    if cfg.privacy.client_seed is None:  # the clients' seed the run drew and recorded
        cfg = with_client_seed(cfg, saved.privacy.client_seed)
    # what `compare --resume` checks before it keeps or continues a run
    assert changed_keys(dump_config(saved), dump_config(cfg)) == []
    rows = pq.read_table(run_dir / "metrics.parquet").to_pylist()
    assert [r["round"] for r in rows] == list(range(1, len(rows) + 1))
    if run_dir.name.endswith(SUFFIX):  # its checkpoint still loads with today's classes
        part = split_checkpoint(load_checkpoint(run_dir))[0]
        snapshot = decode_state(part, get_algorithm(algorithm))  # its state classes allowed
        assert set(snapshot) == set(CHECKPOINT_FIELDS) and snapshot["round"] == len(rows)
    else:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert len(rows) == summary["rounds"] == saved.rounds
        assert summary["final_accuracy"] == rows[-1]["accuracy"]
        assert not (run_dir / CHECKPOINT).exists()  # results/.gitignore keeps it out


@pytest.mark.parametrize("folder", [t for t in TABLES if (RESULTS / t).is_dir()])
def test_report_only_reads_every_committed_run(folder, tmp_path, capsys):
    out = tmp_path / folder
    shutil.copytree(RESULTS / folder, out)
    algorithms = sorted(p.name for p in out.iterdir() if p.is_dir())
    argv = [str(REPO / TABLES[folder]), "--algorithms", ",".join(algorithms), "--out", str(out)]
    assert compare_main([*argv, "--report-only"]) == 0
    finished, unfinished = find_runs(out)
    runs = json.loads((out / "compare.json").read_text())
    assert sum(len(v) for v in runs.values()) == len(finished)
    text = capsys.readouterr().out
    assert all(f"{u.path}: after round {u.rounds_done}" in text for u in unfinished)

    # made again, whatever order --algorithms names them in: the committed table, rows kept
    # (the unfinished runs listed under it are named by where they lie: here, a copy)
    def table(path: Path) -> str:
        return path.read_text().split("\nNot in the table")[0]

    assert table(out / "compare.md") == table(RESULTS / folder / "compare.md")


def test_pina_table_is_made_from_its_committed_runs(tmp_path):
    """scripts/pina_table.py --report-only on a copy of its runs writes the committed table.md
    again, word for word (so that table is those runs', not edited by hand)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pina_table", REPO / "scripts/pina_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "pina"
    shutil.copytree(RESULTS / "pina-fmnist-rotation", out)
    (out / "table.md").unlink()
    assert module.main(["--report-only", "--out", str(out)]) == 0
    committed = (RESULTS / "pina-fmnist-rotation" / "table.md").read_text()
    assert (out / "table.md").read_text() == committed
    assert "## PINA's ablations at eps = 8" in committed
