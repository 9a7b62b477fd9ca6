"""RR-Cluster's table: identifier mode x B x eps x setup x seed, in-process, in parallel.

    python scripts/rr_table.py --out runs/rr-table [--jobs 16] [--seeds 0,1,2] [--rounds 30]
        [--setups balanced,imbalanced] [--eps 4,8] [--B 0,8,12]
        [--modes private,histogram,unaccounted] [--set KEY=VALUE ...] [--report-only]

Each run is ``configs/rr_fmnist_{setup}.yaml`` (FMNIST rotation, 1000 clients, q = 0.1 without
replacement, k = 4, client-level DP) with the grid's overrides, run by ``raysim.cli.compare
.run_inline`` (the engine's round loop without Ray, on the CPU, one torch thread) in a pool of
``--jobs`` processes, and written as a usual result directory OUT/TAG/seedS (a finished run is
skipped, so the script resumes). The table (OUT/table.md, table.json) gives, per setup, eps,
mode and B, the mean +- std over seeds of the final accuracy (and the minority's), the final
clustering accuracy of the clients' choices, the gain over B = 0 of the same mode, and the
per-round diagnostics averaged over rounds: the ids' noise-to-signal s, the analytic and
measured keep rate, the smallest group before rebalancing, the updates moved per round, and the
cohort's clustering accuracy before and after rebalancing. ``unaccounted`` rows are marked
"cluster identifiers not private".
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from grid_runs import run_all

ROOT = Path(__file__).resolve().parents[1]
MODE_LABEL = {
    "private": "private",
    "histogram": "histogram",
    "unaccounted": "unaccounted (cluster identifiers not private)",
}
DIAG = (
    ("s", "id_noise_to_signal", 1.0, "{:.2f}"),
    ("keep (analytic)", "id_keep_analytic", 1.0, "{:.2f}"),
    ("keep (measured)", "id_keep_measured", 1.0, "{:.2f}"),
    ("min group before", "group_size_min_before", 1.0, "{:.1f}"),
    ("moved / round", "rebalance_moved", 1.0, "{:.2f}"),
    ("cl. acc before", "clustering_accuracy_before", 100.0, "{:.1f}"),
    ("cl. acc after", "clustering_accuracy_after", 100.0, "{:.1f}"),
)


def tag(setup: str, eps: float, mode: str, B: int) -> str:
    return f"{setup}-eps{eps:g}-{mode}-B{B}"


def grid(args: argparse.Namespace) -> list[tuple[str, str, list[str], str]]:
    out = []
    for setup, eps, mode, B, seed in itertools.product(
        args.setups, args.eps, args.modes, args.B, args.seeds
    ):
        sets = [
            f"rounds={args.rounds}",
            f"seed={seed}",
            f"privacy.epsilon={eps}",
            f"algorithm.identifiers={mode}",
            f"algorithm.B={B}",
            "runtime.progress=false",
            *args.set,
        ]
        t = tag(setup, eps, mode, B)
        out.append((t, setup, sets, str(args.out / t / f"seed{seed}")))
    return out


def run_grid(args: argparse.Namespace) -> None:
    config = str(ROOT / "configs" / "rr_fmnist_{}.yaml")
    run_all(
        [(config.format(setup), sets, d) for _, setup, sets, d in grid(args)], args.jobs, "rr_table"
    )


# ------------------------------------------------------------------------------- the table


def _ms(vals: list[float], scale: float = 100.0, fmt: str = "{:.2f}") -> str:
    vals = [v * scale for v in vals if v is not None and np.isfinite(v)]
    if not vals:
        return "-"
    if len(vals) == 1:
        return fmt.format(vals[0])
    return f"{fmt.format(np.mean(vals))} ± {fmt.format(np.std(vals))}"


def load(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    import pyarrow.parquet as pq

    runs: dict[str, list[dict[str, Any]]] = {}
    for t, _, _, d in grid(args):
        path = Path(d) / "summary.json"
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        m = pq.read_table(Path(d) / "metrics.parquet").to_pandas()
        row = {
            "accuracy": s["final"].get("accuracy"),
            "accuracy_minority": s["final"].get("accuracy_minority"),
            "clustering_accuracy": float(m["clustering_accuracy"].iloc[-1]),
            "epsilon": s["epsilon"],
            "wall_seconds": s["wall_seconds"],
            "warning": s.get("warning"),
            **s.get("diagnostics", {}),
        }
        runs.setdefault(t, []).append(row)
    return runs


def table(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> str:
    head = ["setup", "eps", "identifiers", "B", "seeds", "accuracy", "Δ vs B=0", "minority"]
    head += ["clustering acc"] + [name for name, *_ in DIAG]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for setup, eps, mode, B in itertools.product(args.setups, args.eps, args.modes, args.B):
        rs = runs.get(tag(setup, eps, mode, B))
        if not rs:
            continue
        base = runs.get(tag(setup, eps, mode, 0), [])
        gain = "-"
        if B and base:
            diff = np.mean([r["accuracy"] for r in rs]) - np.mean([r["accuracy"] for r in base])
            gain = f"{100 * diff:+.2f}"
        cells = [setup, f"{eps:g}", MODE_LABEL[mode], str(B), str(len(rs))]
        cells += [_ms([r["accuracy"] for r in rs]), gain]
        cells += [_ms([r.get("accuracy_minority") for r in rs])]
        cells += [_ms([r["clustering_accuracy"] for r in rs], fmt="{:.1f}")]
        cells += [_ms([r.get(key) for r in rs], scale, fmt) for _, key, scale, fmt in DIAG]
        lines.append("| " + " | ".join(cells) + " |")
    walls = [r["wall_seconds"] for rs in runs.values() for r in rs]
    if walls:
        lines.append("")
        lines.append(f"{len(walls)} runs, {np.mean(walls):.0f} s of wall time per run on average.")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def floats(s: str) -> list[float]:
        return [float(x) for x in s.split(",") if x]

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    def names(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    p.add_argument("--out", type=Path, default=Path("runs/rr-table"))
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--setups", type=names, default=["balanced", "imbalanced"])
    p.add_argument("--eps", type=floats, default=[4.0, 8.0])
    p.add_argument("--B", type=ints, default=[0, 8, 12])
    p.add_argument("--modes", type=names, default=["private", "histogram", "unaccounted"])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--report-only", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    bad = [m for m in args.modes if m not in MODE_LABEL]
    if bad:
        allowed = ", ".join(MODE_LABEL)
        print(f"rr_table: --modes: unknown {bad}; allowed: {allowed}", file=sys.stderr)
        return 2
    if not args.report_only:
        run_grid(args)
    text = table(args, load(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "table.json").write_text(json.dumps(load(args), indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
