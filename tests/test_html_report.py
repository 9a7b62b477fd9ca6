"""`raysim report`'s report.html on hand-written run directories (the files a run writes, with
numbers chosen so that each figure's and the table's values are known): grouping over seeds,
mean ± std, the ledger's eps per client and round, what is left out and why, the refusals of
--out, and that the directories read are left as they were. The page on a real compare run, in
a real browser: tests/test_report_browser.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from raysim.cli.main import main
from raysim.metrics import html_report as hr


def write_run(
    d: Path,
    algorithm: str,
    seed: int,
    accuracies: list[float],
    *,
    epsilon_budget: float | None = 4.0,
    mode: str = "sample",
    assigned: list[int] | None = None,
    ledger: list[tuple[int, int, float]] | None = None,
    client_acc: list[float] | None = None,
    per_round: list[list[int]] | None = None,
) -> Path:
    """A finished run's files, as raysim.metrics.results.write_results lays them out; two true
    clusters of two clients each."""
    d.mkdir(parents=True)
    rounds = len(accuracies)
    eps = [
        None if mode == "none" else (epsilon_budget or 0) * (r + 1) / rounds for r in range(rounds)
    ]
    cfg = {
        "name": "t",
        "seed": seed,
        "algorithm": {"name": algorithm},
        "privacy": {"mode": mode, "epsilon": epsilon_budget, "client_seed": 100 + seed},
        "runtime": {"num_workers": 2},
    }
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    pd.DataFrame(
        {
            "round": range(1, rounds + 1),
            "accuracy": accuracies,
            "accuracy_min": [a / 2 for a in accuracies],
            "epsilon": [np.nan if e is None else e for e in eps],
        }
    ).to_parquet(d / "metrics.parquet")
    pd.DataFrame(
        {
            "client_id": [0, 1, 2, 3],
            "true_cluster": [0, 0, 1, 1],
            "assigned_cluster": assigned if assigned is not None else [None] * 4,
            "accuracy": client_acc or [accuracies[-1]] * 4,
        }
    ).to_parquet(d / "clients.parquet")
    if per_round is not None:  # assignments.parquet: each client's cluster each round
        pd.DataFrame(
            {
                "round": np.repeat(np.arange(1, len(per_round) + 1), 4),
                "client_id": np.tile(np.arange(4), len(per_round)),
                "cluster": np.asarray(per_round, dtype=np.int32).ravel(),
            }
        ).to_parquet(d / "assignments.parquet")
    rows = ledger or []
    pd.DataFrame(
        {
            "client": pd.array([r[0] for r in rows], dtype="Int64"),
            "round": pd.array([r[1] for r in rows], dtype="Int64"),
            "mechanism": ["dpsgd"] * len(rows),
            "params": ["{}"] * len(rows),
            "epsilon": pd.array([r[2] for r in rows], dtype="float64"),
        }
    ).to_parquet(d / "privacy.parquet")
    summary = {
        "algorithm": algorithm,
        "dataset": "digits",
        "seed": seed,
        "rounds": rounds,
        "privacy_mode": mode,
        "epsilon": eps[-1],
        "epsilon_budget": epsilon_budget if mode != "none" else None,
        "delta": 1e-3,
        "final": {"accuracy": accuracies[-1], "accuracy_min": accuracies[-1] / 2},
        "privacy": {"accounts_epsilon": mode not in ("none", "dprivacy")},
        "rounds_seconds": 1.0,
    }
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def compare_dir(root: Path) -> Path:
    out = root / "cmp"
    ledger = [(c, r, 2.0 * r) for c in range(4) for r in (1, 2)]
    write_run(out / "fedavg" / "seed0", "fedavg", 0, [0.4, 0.5], ledger=ledger)
    write_run(out / "fedavg" / "seed1", "fedavg", 1, [0.5, 0.7], ledger=ledger)
    rounds = [[-1, 0, -1, 0], [1, 1, 0, 0]]
    write_run(
        out / "ifca" / "seed0", "ifca", 0, [0.6, 0.8], assigned=[1, 1, 0, 0], ledger=ledger,
        per_round=rounds,
    )  # fmt: skip
    write_run(out / "ifca" / "seed1", "ifca", 1, [0.6, 0.9], assigned=[0, 0, 1, 2], ledger=ledger)
    (out / "compare.json").write_text("[]")
    return out


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


def figures(page: str) -> list[str]:
    return re.findall(r'<img id="fig-([a-z-]+)" src="data:image/png;base64,', page)


def test_summary_is_mean_and_std_over_seeds_per_algorithm(tmp_path):
    out = compare_dir(tmp_path)
    groups = hr.group_runs(hr.load_runs(sorted(p.parent for p in out.rglob("summary.json"))))
    assert [(g.label, len(g.runs)) for g in groups] == [("fedavg", 2), ("ifca", 2)]
    header, rows = hr.summary_table(groups)
    table = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert table["fedavg"]["All %"] == "60.0 ± 10.0"  # 50 and 70
    assert table["ifca"]["All %"] == "85.0 ± 5.0"  # 80 and 90
    assert table["ifca"]["worst client %"] == "42.5 ± 2.5"
    assert table["fedavg"]["seeds"] == "2" and table["fedavg"]["eps spent"] == "4.00 ± 0.00"
    assert "ARI" not in header  # nobody has it: no column of dashes


def test_runs_differing_in_a_swept_key_are_separate_groups(tmp_path):
    dirs = [
        write_run(tmp_path / f"t{i}", "rdpcfl", seed, [0.5 + i / 10], epsilon_budget=eps)
        for i, (eps, seed) in enumerate([(1.0, 0), (1.0, 1), (4.0, 0), (4.0, 1)])
    ]
    groups = hr.group_runs(hr.load_runs(dirs))
    assert [g.label for g in groups] == ["rdpcfl, epsilon=1.0", "rdpcfl, epsilon=4.0"]
    assert [[r.seed for r in g.runs] for g in groups] == [[0, 1], [0, 1]]
    page = hr.render(dirs, [tmp_path])
    assert "privacy-utility" in figures(page)


def test_each_clients_eps_per_round_comes_from_its_last_charge_and_carries_over(tmp_path):
    ledger = [(0, 1, 1.0), (0, 1, 1.5), (1, 1, 0.5), (0, 3, 2.5), (1, 2, 2.0)]
    d = write_run(tmp_path / "r", "fedavg", 0, [0.1, 0.2, 0.3], ledger=ledger)
    spent = hr.client_epsilon(hr.load_runs([d])[0])
    assert list(spent.columns) == [0, 1, 2, 3]
    assert spent.loc[0].tolist() == [0.0, 1.5, 1.5, 2.5]
    assert spent.loc[1].tolist() == [0.0, 0.5, 2.0, 2.0]


def test_assignment_ids_are_matched_to_the_true_clusters():
    true = np.array([0, 0, 1, 1, 1])
    assert hr._matched(true, np.array([5, 5, 2, 2, 7])).tolist() == [0, 0, 1, 1, 2]
    assert hr._matched(true, np.array([1, 1, 0, 0, 0])).tolist() == [0, 0, 1, 1, 1]


def test_each_rounds_assignment_is_matched_to_the_true_clusters_that_round(tmp_path):
    """Round 1: clients 0 and 2 have not chosen (-1, kept apart from any cluster), 1 and 3 chose
    id 5 (one cluster: it takes one true id); round 2: ids 1 and 0 are the true clusters 0 and
    1 (relabelled, not drawn as they came)."""
    d = write_run(
        tmp_path / "r", "ifca", 0, [0.5, 0.6], assigned=[1, 1, 0, 0],
        per_round=[[-1, 5, -1, 5], [1, 1, 0, 0]],
    )  # fmt: skip
    (run,) = hr.load_runs([d])
    rounds, grid = hr.assignment_grid(run)
    assert rounds.tolist() == [1, 2]
    assert grid.tolist() == [[-1, 0, -1, 0], [0, 0, 1, 1]]


def test_report_writes_one_page_beside_the_directory_and_nothing_into_it(tmp_path, capsys):
    out = compare_dir(tmp_path)
    before = snapshot(out)
    assert main(["report", str(out)]) == 0
    captured = capsys.readouterr()
    assert "fedavg" in captured.out  # the printed table stays
    page_file = tmp_path / "cmp-report.html"
    assert f"report: {page_file}" in captured.err
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp", "cmp-report.html"]
    page = page_file.read_text()
    assert figures(page) == [
        "rounds", "privacy-utility", "clients", "assignments", "assignment-rounds", "epsilon",
    ]  # fmt: skip
    assert "Not drawn: no audit.parquet" in page
    # self-contained: nothing fetched from anywhere, no script
    assert not re.search(r'(src|href)="(?!data:|#)', page)
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert "60.0 ± 10.0" in page and "85.0 ± 5.0" in page


def test_figures_without_data_are_left_out_with_a_note(tmp_path):
    dirs = [
        write_run(tmp_path / f"s{s}", "fedavg", s, [0.3, 0.4], mode="none", epsilon_budget=None)
        for s in (0, 1)
    ]
    page = hr.render(dirs, [tmp_path])
    assert figures(page) == ["rounds", "privacy-utility", "clients"]
    assert "Not drawn: no run assigns clients to clusters" in page
    assert "Not drawn: no run recorded its assignments round by round" in page
    assert "Not drawn: no run has a per-client (eps, delta) ledger" in page
    assert hr.NO_DP in page  # the table's eps for runs without DP


def test_audit_scores_are_drawn_where_an_audit_parquet_is_present(tmp_path):
    out = compare_dir(tmp_path)
    audit = out / "audit"
    audit.mkdir()
    rng = np.random.default_rng(0)
    pd.DataFrame(
        {"canary": range(40), "in": [True, False] * 20, "score": rng.normal(size=40)}
    ).to_parquet(audit / "audit.parquet")
    (audit / "audit.json").write_text(json.dumps({"claimed_epsilon": 4.0, "lower_bound": 0.7}))
    page = hr.render(sorted(p.parent for p in out.rglob("summary.json")), [out])
    assert figures(page)[-1] == "audit"


def test_report_refuses_an_out_inside_a_directory_read_or_existing(tmp_path, capsys):
    out = compare_dir(tmp_path)
    before = snapshot(out)
    for bad in (out / "report.html", out / "ifca" / "x.html"):
        assert main(["report", str(out), "--out", str(bad)]) == 2
        err = capsys.readouterr().err
        assert "is inside" in err and "--out" in err and "Traceback" not in err
    assert snapshot(out) == before
    assert main(["report", str(out), "--out", str(tmp_path / "r.txt")]) == 2
    assert "an .html file" in capsys.readouterr().err
    page = tmp_path / "r.html"
    page.write_text("mine")
    assert main(["report", str(out), "--out", str(page)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert page.read_text() == "mine"
    assert main(["report", str(out), "--out", str(page), "--overwrite"]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert main(["report", str(out), "--out", str(tmp_path / "no" / "r.html")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("several", [False, True])
def test_default_out(tmp_path, monkeypatch, several):
    monkeypatch.chdir(tmp_path)
    a = write_run(tmp_path / "a", "fedavg", 0, [0.5])
    read = [a, write_run(tmp_path / "b", "fedavg", 1, [0.6])] if several else [a]
    expect = Path("report.html") if several else tmp_path / "a-report.html"
    assert hr.output_path(read, None, overwrite=False) == expect


def test_report_formats_give_the_pages_numbers_as_data(tmp_path, capsys):
    """--format json|csv|markdown: the same groups and mean ± std over seeds as the page, to
    stdout (nothing else there, so it pipes) or to --out, never into the directories read."""
    import io

    out = compare_dir(tmp_path)
    before = snapshot(out)
    assert main(["report", str(out), "--format", "json"]) == 0
    groups = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    assert groups["fedavg"]["accuracy_mean"] == pytest.approx(0.6)  # 0.5 and 0.7
    assert groups["fedavg"]["accuracy_std"] == pytest.approx(0.1)
    assert groups["ifca"]["accuracy_min_mean"] == pytest.approx(0.425)
    assert groups["ifca"]["seeds"] == [0, 1] and groups["ifca"]["accuracy_n"] == 2
    assert main(["report", str(out), "--format", "csv"]) == 0
    table = pd.read_csv(io.StringIO(capsys.readouterr().out)).set_index("group")
    assert table.loc["ifca", "accuracy_mean"] == pytest.approx(0.85)
    assert table.loc["fedavg", "seeds"] == "0;1"
    assert main(["report", str(out), "--format", "markdown"]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0].startswith("| group | seeds | rounds | All % |") and md[1].startswith("|---|")
    assert "| fedavg | 2 | 2 | 60.0 ± 10.0 |" in md[2]
    target = tmp_path / "summary.csv"
    assert main(["report", str(out), "--format", "csv", "--out", str(target)]) == 0
    assert target.read_text().startswith("group,algorithm,")
    assert main(["report", str(out), "--format", "csv", "--out", str(target)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["report", str(out), "--format", "json", "--out", str(out / "s.json")]) == 2
    assert "is inside" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["report", str(out), "--format", "yaml"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cmp", "summary.csv"]
