"""Why raysim's DP-IFCA clusters where the R-DPCFL paper's mis-clusters: an ablation of what may
differ (the initial models, what the private choice scores, the choice's eps), over the first
rounds of the paper-scale runs, in-process.

    python scripts/ifca_ablation.py [--out results/ifca-ablation] [--jobs 2] [--rounds 4]
        [--datasets fmnist,mnist] [--seeds 0,1] [--variants shipped,loss,shared_init,eps_0.01]
        [--report-only]

Each run is ``configs/rdpcfl_{dataset}_rotation.yaml`` with ``algorithm.name=ifca`` and M = 4,
calibrated for its E = 200 rounds (the same DP-SGD noise and selection budget as the E = 200
runs of results/e200-*), stepped for its first ``--rounds`` rounds only: IFCA's clustering is
settled by then in the E = 200 runs (ARI constant from round 2 on FMNIST, round 3 on MNIST).
Written per run: OUT/DATASET/VARIANT/seedS.json (ARI per round, the clients' final choice, the
wall time); the table (OUT/table.md) gives the ARI per round and the true clusters sharing a
model. ``shipped`` with seeds 0 and 1 is the E = 200 runs' own start, which it must reproduce.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "shipped": [],  # accuracy-scored choice, eps_select 0.05, four random initial models
    "loss": ["algorithm.select_by=loss"],  # the choice scores the clipped train loss
    "shared_init": ["algorithm.random_init=false"],  # the four models start equal
    "eps_0.01": ["algorithm.eps_select=0.01"],  # a five times noisier choice
    "eps_0.002": ["algorithm.eps_select=0.002"],  # 25 times noisier
}


def one(dataset: str, variant: str, seed: int, rounds: int, path: str) -> str:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from algorithms import Environment, get_algorithm
    from raysim.config import load_config
    from raysim.engine.experiment import prepare
    from raysim.runtime.inline import inline_loop

    sets = [
        "algorithm.name=ifca",
        "algorithm.num_clusters=4",
        f"seed={seed}",
        f"training.eval_every={rounds}",
        "privacy.client_seed=same_as_seed",  # as the E = 200 runs drew (before the key existed)
        "runtime.progress=false",
        *VARIANTS[variant],
    ]
    cfg = load_config(ROOT / "configs" / f"rdpcfl_{dataset}_rotation.yaml", sets)
    t0 = time.perf_counter()
    prep = prepare(cfg, get_algorithm("ifca"), Environment)
    loop = inline_loop(prep, device="cpu")
    rows = [loop.step() for _ in range(rounds)]
    truth = np.asarray(prep.truth)
    chosen = np.asarray(loop.algorithm.assignments(loop.state))
    out = {
        "ari": [float(r["ari"]) for r in rows],
        "accuracy": float(rows[-1]["accuracy"]),
        "truth": truth.tolist(),
        "assigned": chosen.tolist(),
        "wall_seconds": time.perf_counter() - t0,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out))
    return path


def sharing(truth: list[int], assigned: list[int]) -> str:
    """The models each true cluster's clients use, and which true clusters share one."""
    t, a = np.asarray(truth), np.asarray(assigned)
    groups = [sorted({int(m) for m in a[t == k]}) for k in np.unique(t)]
    return " ".join(f"{k}->{'/'.join(map(str, g))}" for k, g in enumerate(groups))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "ifca-ablation")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--datasets", default="fmnist,mnist")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    grid = [
        (d, v, s, args.rounds, str(args.out / d / v / f"seed{s}.json"))
        for v in args.variants.split(",")
        for d in args.datasets.split(",")
        for s in args.seeds
    ]
    if not args.report_only:
        todo = [g for g in grid if not Path(g[-1]).exists()]
        print(f"ifca_ablation: {len(todo)} runs to do", file=sys.stderr)
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for fut in as_completed([pool.submit(one, *g) for g in todo]):
                print(f"done: {fut.result()}", file=sys.stderr)
    lines = [
        "| dataset | variant | seed | ARI, rounds 1.. | accuracy at the last | true cluster -> "
        "models | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, v, s, _, path in grid:
        if not Path(path).exists():
            continue
        r = json.loads(Path(path).read_text())
        aris = ", ".join(f"{a:.2f}" for a in r["ari"])
        lines.append(
            f"| {d} | {v} | {s} | {aris} | {100 * r['accuracy']:.1f} | "
            f"{sharing(r['truth'], r['assigned'])} | {r['wall_seconds']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
