"""docs/reference/results.md against what raysim writes: every column and key that the committed
runs in results/ and a few short inline runs write is documented there, and every engine column
the page documents is still written (the page cannot describe a column that no longer exists).
The every-algorithm, every-mode collection is marked slow (``pytest -m slow``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import inline_run

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "results.md"
RUN_TABLES = ("metrics.parquet", "clients.parquet", "privacy.parquet", "assignments.parquet")
RUN_TABLES += ("leakage.parquet",)
# what an unfinished run holds besides a run's files: never in a finished run directory
STAGING_ONLY = {"status.json", "checkpoint.ckpt", "checkpoint.prev.ckpt", ".lock"}

# A handful of short runs that together write nearly every column: the engine's conditional
# ones (minority, early stop, dropout, leakage cap), both modes' adaptive clip, the secure sum's
# shortfall, and the diagnostics of R-DPCFL, RR-Cluster and PINA.
SECURE = {
    "privacy.mode": "distributed",
    "privacy.noise_source": "clients",
    "privacy.population": 1000000,
    "privacy.delta": 1e-7,
    "privacy.epsilon": 8,
    "training.client_dropout": 0.3,
}
FAST = {
    "rdpcfl-none": {
        "algorithm.name": "rdpcfl",
        "privacy.mode": "none",
        "data.cluster_sizes": "[5, 3]",  # unequal: accuracy_minority / _majority
        "training.early_stop_patience": 1,
        "training.lr": 1e-12,  # the loss does not improve: early_stopped
    },
    "rr_cluster-client": {
        "algorithm.name": "rr_cluster",
        "privacy.mode": "client",
        "privacy.epsilon": 8,
        "algorithm.B": 1,
        "training.sampling": "without_replacement",
        "training.sampling_rate": 0.5,
    },
    "fedavg-client-adaptive": {
        "algorithm.name": "fedavg",
        "privacy.mode": "client",
        "privacy.epsilon": 8,
        "privacy.clip": 20,
        "privacy.clip_quantile": 0.5,
        "privacy.clip_lr": 0.5,
        "privacy.clip_count_noise": 1.0,
        "training.client_dropout": 0.3,
    },
    "fedavg-distributed-abort": {
        "algorithm.name": "fedavg",
        **SECURE,
        "privacy.shortfall": "abort",
    },
    "ifca-distributed-topup": {"algorithm.name": "ifca", **SECURE, "privacy.clip_quantile": 0.5},
    "fedavg-dprivacy-cap": {
        "algorithm.name": "fedavg",
        "privacy.mode": "dprivacy",
        "privacy.leakage_cap": 1,  # every release would cross it: skipped_over_cap
    },
    "dp_group-dprivacy": {"algorithm.name": "dp_group", "privacy.mode": "dprivacy"},
    "pina-none": {"algorithm.name": "pina", "privacy.mode": "none", "rounds": 4},
    "ifca-sample": {"algorithm.name": "ifca", "privacy.mode": "sample"},
}


def documented() -> dict[str, dict[str, set[str]]]:
    """The names in the first cell of each table row, by section (## heading) and subsection
    (### or #### heading)."""
    out: dict[str, dict[str, set[str]]] = {}
    h2 = h3 = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            h2, h3 = line[3:].strip(), ""
        elif line.startswith(("### ", "#### ")):
            h3 = line.lstrip("#").strip()
        elif line.startswith("| `"):
            first = line.split("|")[1]
            out.setdefault(h2, {}).setdefault(h3, set()).update(re.findall(r"`([^`]+)`", first))
    return out


def names(section: str, sub: str | None = None) -> set[str]:
    doc = documented()
    assert section in doc, f"docs/reference/results.md has no section {section!r}"
    parts = doc[section]
    if sub is not None:
        assert sub in parts, f"docs/reference/results.md: {section!r} has no {sub!r}"
        return parts[sub]
    return set().union(*parts.values())


def pattern(name: str) -> re.Pattern[str]:
    """``accuracy_cluster_<k>``: a one-letter placeholder stands for a number; a longer one
    (``config.<key>``) for any name."""
    parts = re.split(r"(<[^>]+>)", name)
    return re.compile(
        "".join(
            (r"\d+" if len(p) == 3 else r".+") if p.startswith("<") else re.escape(p) for p in parts
        )
    )


def undocumented(seen: Iterable[str], doc: set[str]) -> list[str]:
    pats = [pattern(d) for d in doc]
    return sorted(s for s in set(seen) if not any(p.fullmatch(s) for p in pats))


def unseen(doc: set[str], seen: Iterable[str]) -> list[str]:
    seen = set(seen)
    return sorted(d for d in doc if not any(pattern(d).fullmatch(s) for s in seen))


def written(run_dir: Path) -> dict[str, set[str]]:
    """What a finished run directory holds: its files, each table's columns, summary.json's
    keys (the privacy block's as ``privacy.KEY``)."""
    out: dict[str, set[str]] = {"files": {p.name for p in run_dir.iterdir()}}
    for name in RUN_TABLES:
        if (run_dir / name).is_file():
            out[name] = set(pq.read_schema(run_dir / name).names)
    summary = json.loads((run_dir / "summary.json").read_text())
    out["summary.json"] = set(summary) | {f"privacy.{k}" for k in summary["privacy"]}
    return out


def merged(runs: Iterable[dict[str, set[str]]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for run in runs:
        for k, v in run.items():
            out.setdefault(k, set()).update(v)
    return out


def check_documented(seen: dict[str, set[str]], where: str) -> None:
    files = undocumented(seen["files"], names("The run directory"))
    assert not files, f"{where} write files docs/reference/results.md does not name: {files}"
    for name in (*RUN_TABLES, "summary.json"):
        missing = undocumented(seen.get(name, ()), names(name))
        assert not missing, (
            f"{where}: {name} has columns/keys the page does not document: {missing}"
        )


def committed_runs() -> list[Path]:
    return sorted(p.parent for p in (ROOT / "results").glob("*/*/seed*/summary.json"))


def test_the_page_documents_every_column_of_the_committed_runs():
    runs = committed_runs()
    assert runs, "results/ holds no committed run"
    check_documented(merged(written(r) for r in runs), "the committed runs in results/")
    records = [
        rec
        for path in (ROOT / "results").glob("*/compare.json")
        for recs in json.loads(path.read_text()).values()
        for rec in recs
    ]
    assert records
    final_keys = names("metrics.parquet")  # compare.json's records carry the final metrics
    missing = undocumented(
        {k for r in records for k in r}, names("A compare directory") | final_keys
    )
    assert not missing, f"compare.json keys the page does not document: {missing}"


def test_the_report_formats_keys_are_documented():
    from raysim.metrics.tables import group_records

    records = group_records(committed_runs())
    missing = undocumented({k for r in records for k in r}, names("raysim report"))
    assert not missing, f"raysim report --format json/csv keys not documented: {missing}"


def test_the_pattern_matches_numbers_only_for_one_letter_placeholders():
    assert pattern("accuracy_cluster_<k>").fullmatch("accuracy_cluster_12")
    assert not pattern("accuracy_cluster_<k>").fullmatch("accuracy_cluster_x")
    assert not pattern("mss_m<M>").fullmatch("mss_m")
    assert pattern("config.<key>").fullmatch("config.data.shift")
    assert undocumented({"accuracy", "brand_new"}, {"accuracy"}) == ["brand_new"]
    assert unseen({"accuracy", "gone_<k>"}, {"accuracy"}) == ["gone_<k>"]


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory) -> dict[str, dict[str, set[str]]]:
    root = tmp_path_factory.mktemp("schema")
    out = {}
    for name, settings in FAST.items():
        inline_run(root / name, {"model.name": "mlp", **settings})
        out[name] = written(root / name)
    return out


def test_short_runs_write_only_documented_columns(fast_runs):
    seen = merged(fast_runs.values())
    assert "leakage.parquet" in seen and "assignments.parquet" in seen  # the set covers them
    check_documented(seen, "the short runs")


def test_every_documented_engine_column_is_still_written(fast_runs):
    """The engine's and the modes' columns the page names, each written by a short run or a
    committed one: a column renamed or dropped in the code fails here until the page follows."""
    seen = merged([*fast_runs.values(), *(written(r) for r in committed_runs())])
    for sub in ("Engine columns", "Privacy-mode columns"):
        gone = unseen(names("metrics.parquet", sub), seen["metrics.parquet"])
        assert not gone, f"docs/reference/results.md ({sub}) names columns no run writes: {gone}"
    for name in ("clients.parquet", "privacy.parquet", "assignments.parquet", "leakage.parquet"):
        gone = unseen(names(name), seen[name])
        assert not gone, f"docs/reference/results.md ({name}) names columns no run writes: {gone}"


# ------------------------------------------------------- every algorithm in every mode (slow)

MODE_SETTINGS = {
    "none": {"privacy.mode": "none"},
    "sample": {"privacy.mode": "sample"},
    "client": {"privacy.mode": "client", "privacy.clip": 20, "privacy.epsilon": 8},
    "distributed": {"privacy.mode": "distributed", "privacy.noise_cohort_size": 6},
    "dprivacy": {"privacy.mode": "dprivacy"},
}
ALGORITHM_SETTINGS = {
    "rr_cluster": FAST["rr_cluster-client"] | {"algorithm.name": "rr_cluster"},
    "pina": {"rounds": 4},  # stage 1 and the k-means initialisation come first
    "kmeans_cfl_sketch": {"rounds": 4},
}


@pytest.mark.slow
def test_every_algorithm_in_every_mode_writes_only_documented_columns(tmp_path):
    from algorithms import ALGORITHMS

    runs = []
    for name, cls in ALGORITHMS.items():
        for mode in cls.privacy_modes:
            out = tmp_path / f"{name}-{mode}"
            settings = {**ALGORITHM_SETTINGS.get(name, {}), **MODE_SETTINGS[mode]}
            inline_run(out, {"model.name": "mlp", "algorithm.name": name, **settings})
            runs.append(written(out))
    check_documented(merged(runs), "the every-algorithm runs")
