"""Galli et al.'s Table 2 (validation accuracy against the noise multiplier nu) in the closest
offline setting: ``configs/galli_fmnist_rotation.yaml`` at each nu and seed, in-process.

    python scripts/galli_nu_table.py [--out results/galli-fmnist-rotation] [--jobs 2]
        [--nus 0,0.001,0.01,0.1,1,3,5,10] [--seeds 0,1,2] [--set KEY=VALUE ...] [--report-only]

nu = 0 is the same algorithm without noise (privacy.mode=none). Each run is written as a result
directory OUT/nuNU/seedS (a finished run is skipped, so the script resumes); the table
(OUT/table.md, table.json) gives per nu, over seeds: the held-out clients' accuracy where the
run stopped (mean +- std, the paper's measure) and at its best evaluation, the stop round, the
ARI of the trained clients' final clusters, the leakage of one release (n / nu) and a training
client's total (median and largest), beside the paper's cross-entropy column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from grid_runs import run_all

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "galli_fmnist_rotation.yaml"
# Table 2, cross-entropy: nu -> (mean validation accuracy, std), FEMNIST, 62 classes
PAPER = {
    0.0: (0.832, 0.012),
    0.001: (0.843, 0.006),
    0.01: (0.832, 0.017),
    0.1: (0.834, 0.026),
    1.0: (0.834, 0.014),
    3.0: (0.835, 0.017),
    5.0: (0.812, 0.016),
    10.0: (0.692, 0.002),
    15.0: (0.561, 0.005),
}


def run_dir(out: Path, nu: float, seed: int) -> Path:
    return out / f"nu{nu:g}" / f"seed{seed}"


def overrides(nu: float, seed: int, extra: list[str]) -> list[str]:
    noise = ["privacy.mode=none"] if nu == 0 else [f"privacy.nu={nu:g}"]
    return [f"seed={seed}", "runtime.progress=false", *noise, *extra]


def one(path: Path) -> dict[str, Any]:
    """What the table reads from one finished run."""
    import pyarrow.parquet as pq
    from sklearn.metrics import adjusted_rand_score

    summary = json.loads((path / "summary.json").read_text())
    metrics = pq.read_table(path / "metrics.parquet").to_pandas()
    judged = metrics.dropna(subset=["accuracy"])
    clients = pq.read_table(path / "clients.parquet").to_pandas()
    trained = clients[clients["rounds_reported"] > 0]
    leak = trained["leakage"] if "leakage" in trained else trained["rounds_reported"] * 0.0
    last = metrics.iloc[-1]
    return {
        "accuracy": float(judged["accuracy"].iloc[-1]),
        "best_accuracy": float(judged["accuracy"].max()),
        "stop_round": int(last["round"]),
        # the clients that trained: a held-out or never-sampled one has no cluster of its own
        "ari": float(adjusted_rand_score(trained["true_cluster"], trained["assigned_cluster"]))
        if len(trained)
        else None,
        "leakage_median": float(leak.median()) if len(leak) else 0.0,
        "leakage_max": float(leak.max()) if len(leak) else 0.0,
        "wall_seconds": float(summary.get("wall_seconds", float("nan"))),
    }


def _ms(vals: list[float], scale: float = 100.0) -> str:
    if not vals:
        return "-"
    v = np.asarray(vals) * scale
    return f"{v[0]:.1f}" if len(v) == 1 else f"{v.mean():.1f} ± {v.std():.1f}"


def table(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    from raysim.config import load_config
    from raysim.models import build_model
    from raysim.models.params import num_params

    cfg = load_config(CONFIG, args.set)
    n = num_params(build_model(cfg.model.name, (1, 28, 28), 10))
    lines = [
        f"n = {n:,} parameters; accuracy of the held-out clients, % (mean ± std over seeds); "
        "leakage in the paper's sense (a release leaks n / nu)",
        "",
        "| nu | runs | accuracy at the stop | best evaluation | stop round (median) | ARI of "
        "the trained clients | leakage per release | a client's total: median / largest | paper, "
        "cross-entropy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    data: dict[str, Any] = {"parameters": n, "nu": {}}
    for nu in args.nus:
        runs = [
            one(d)
            for s in args.seeds
            if (d := run_dir(args.out, nu, s) / "").exists() and (d / "summary.json").exists()
        ]
        paper = PAPER.get(nu)
        paper_s = f"{100 * paper[0]:.1f} ± {100 * paper[1]:.1f}" if paper else "-"
        data["nu"][f"{nu:g}"] = {"runs": runs, "paper": paper}
        if not runs:
            lines.append(f"| {nu:g} | 0 | - | - | - | - | - | - | {paper_s} |")
            continue
        aris = [r["ari"] for r in runs if r["ari"] is not None]
        release = "-" if nu == 0 else f"{n / nu:.3g}"
        totals = (
            "-"
            if nu == 0
            else (
                f"{np.median([r['leakage_median'] for r in runs]):.3g} / "
                f"{max(r['leakage_max'] for r in runs):.3g}"
            )
        )
        ari = f"{np.mean(aris):.2f}" if aris else "-"
        lines.append(
            f"| {nu:g} | {len(runs)} | {_ms([r['accuracy'] for r in runs])} | "
            f"{_ms([r['best_accuracy'] for r in runs])} | "
            f"{np.median([r['stop_round'] for r in runs]):.0f} | {ari} | {release} | "
            f"{totals} | {paper_s} |"
        )
    return "\n".join(lines) + "\n", data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "galli-fmnist-rotation")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--nus",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.0, 0.001, 0.01, 0.1, 1.0, 3.0, 5.0, 10.0],
    )
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.report_only:
        runs = [
            (str(CONFIG), overrides(nu, s, args.set), str(run_dir(args.out, nu, s)))
            for s in args.seeds
            for nu in args.nus
        ]
        run_all(runs, args.jobs, "galli_nu_table")
    text, data = table(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    (args.out / "table.json").write_text(json.dumps(data, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
