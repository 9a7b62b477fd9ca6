"""Galli et al.'s synthetic experiment (section 4, appendix B.1) over many seeds, in-process.

    python scripts/galli_synthetic.py [--seeds 40] [--nus 1,5] [--rounds 200] [--out runs/galli]

For every seed: FedAvg and IFCA without privacy, and Algorithm 1 (dp_group, k-means on the
d-private releases) at each nu under MSE and under RMSE (Eq. 14), plus its client-choice
ablation at the first nu. Each run trains ``--rounds`` rounds; after each, App. B.1's validation
scores the hypotheses on a held-out set of users with the same characteristics (100 users of 10
samples, drawn like the training users with another seed): each user takes the hypothesis with
the lowest Eq. 14 on its data, and the validation loss is their mean Eq. 14. The run "stops"
where that loss has not improved for ``training.early_stop_patience`` rounds (6, the paper's);
the table gives the hypotheses both there and after all rounds. Reported per setting (median
over seeds): the distance from each true optimum to its nearest hypothesis, the share of seeds
with both optima within 1, the stop round, and the largest client leakage per participation
(n / nu). Writes table.md, summary.json, the paper's Fig. 1 (released parameter vectors per round
with the optima) and Fig. 2 (max leakage per cluster per round) for seed 0.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from algorithms import Environment, get_algorithm
from raysim.compose import for_algorithm
from raysim.config import load_config, with_client_seed
from raysim.data.synthetic import make_synthetic_linear
from raysim.engine.experiment import prepare
from raysim.metrics.leakage import plot_max_leakage
from raysim.runtime.inline import inline_loop

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "galli_synthetic.yaml"
OPTIMA = np.array([[5.0, 6.0], [4.0, -4.5]])
VALIDATION_SEED = 1_000_003  # + the run's seed: held-out users, never the training users' draws
EXTRA_PATIENCES = (20, 50)  # what a longer patience would have kept


def validation_users(cfg, seed: int, users: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """App. B.1's held-out users: ``users`` clients of the training users' size and clusters
    (half each), drawn by the same generator with another seed. (x, y) of shape (users, m, .)."""
    m = cfg.data.samples_per_client * cfg.data.train_fraction
    data_cfg = cfg.data.model_copy(update={"samples_per_client": int(round(m))})
    clusters = np.repeat(np.arange(len(OPTIMA)), users // len(OPTIMA))
    syn = make_synthetic_linear(clusters, data_cfg, VALIDATION_SEED + seed)
    x = np.asarray(syn.data.x, dtype=np.float64).reshape(len(clusters), -1, OPTIMA.shape[1])
    return x, np.asarray(syn.data.y, dtype=np.float64).reshape(len(clusters), -1)


def validation_loss(hyps: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean over the held-out users of Eq. 14 under the hypothesis each finds best."""
    rmse = np.sqrt((((x @ hyps.T) - y[:, :, None]) ** 2).mean(axis=1))  # (users, hypotheses)
    return float(rmse.min(axis=1).mean())


def stop_round(losses: list[float], patience: int) -> int:
    """The round (1-based) at which ``patience`` rounds without a lower loss have passed, or the
    last round where that never happens."""
    best, stale = np.inf, 0
    for r, loss in enumerate(losses, start=1):
        best, stale = (loss, 0) if loss < best else (best, stale + 1)
        if stale >= patience:
            return r
    return len(losses)


def nearest(hyps: np.ndarray) -> list[float]:
    return np.linalg.norm(OPTIMA[:, None, :] - hyps[None, :, :], axis=2).min(axis=1).tolist()


def run(seed: int, sets: list[str], rounds: int) -> dict:
    cfg = load_config(CONFIG, [f"seed={seed}", f"rounds={rounds}", "runtime.progress=false", *sets])
    patience = cfg.training.early_stop_patience or rounds
    # the stop is judged here, on held-out users; the engine runs every round
    cfg = for_algorithm(
        cfg.model_copy(
            update={"training": cfg.training.model_copy(update={"early_stop_patience": None})}
        )
    )
    if cfg.privacy.mode == "dprivacy":  # the clients' noise from the run's seed: the table
        # reproduces from its seeds alone (a server knowing the seed could redraw it; none does)
        cfg = with_client_seed(cfg, seed)
    prep = prepare(cfg, get_algorithm(cfg.algorithm.name), Environment)
    loop = inline_loop(prep)
    released: list[tuple[int, np.ndarray]] = []  # what the server saw: (round, theta_hat)
    admit = prep.mode.admit

    def watching(name, plan, reports, rng, secure=None):
        view = admit(name, plan, reports, rng, secure=secure)
        for m in view:
            if m.update is not None:
                base = plan.models[m.cluster if m.cluster is not None else 0]
                released.append((plan.round, (base + m.update).numpy()))
        return view

    prep.mode.admit = watching
    vx, vy = validation_users(cfg, seed)
    trail, losses = [], []
    for _ in range(cfg.rounds):
        loop.step()
        state = loop.state
        models = state.models if hasattr(state, "models") else [state.model]
        trail.append(np.stack([m.numpy() for m in models]).astype(np.float64))
        losses.append(validation_loss(trail[-1], vx, vy))
    stops = {p: stop_round(losses, p) for p in (patience, *EXTRA_PATIENCES)}
    rows = loop.metric_ledger.rows()
    parts = np.bincount([r["client"] for r in rows], minlength=100)
    totals = np.array([loop.metric_ledger.total(c) for c in range(100)])
    return {
        "dist": nearest(trail[-1]),
        "stop": stops[patience],
        "dist_at_stop": {p: nearest(trail[r - 1]) for p, r in stops.items()},
        "stops": stops,
        "hypotheses": trail[-1].tolist(),
        "validation_loss": losses,
        "leak_max": float(totals.max()),
        "leak_per_participation": float((totals[parts > 0] / parts[parts > 0]).max())
        if parts.any()
        else 0.0,
        "released": released,
        "ledger_rows": rows,
        "truth": prep.truth.tolist(),
    }


def settings(nus: list[float]) -> dict[str, list[str]]:
    out = {
        "FedAvg (no DP)": ["algorithm.name=fedavg", "privacy.mode=none"],
        "IFCA (no DP)": [
            "algorithm.name=ifca",
            "privacy.mode=none",
            "algorithm.select_by=loss",
            "algorithm.loss_clip=1e12",
        ],
    }
    for loss in ("mse", "rmse"):
        for nu in nus:
            out[f"Algorithm 1, {loss.upper()}, nu={nu:g}"] = [
                "algorithm.name=dp_group",
                f"privacy.nu={nu}",
                f"training.regression_loss={loss}",
            ]
    out[f"IFCA on sanitized (client choice), nu={nus[0]:g}"] = [
        "algorithm.name=dp_group",
        f"privacy.nu={nus[0]}",
        "algorithm.server_clustering=client_choice",
    ]
    return out


def figure1(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.6), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items(), strict=True):
        if res["released"]:
            rounds = np.array([r for r, _ in res["released"]])
            pts = np.stack([p for _, p in res["released"]])
            sc = ax.scatter(pts[:, 0], pts[:, 1], c=rounds, s=6, cmap="viridis", alpha=0.7)
            fig.colorbar(sc, ax=ax, label="round")
        ax.scatter(OPTIMA[:, 0], OPTIMA[:, 1], marker="*", s=160, c="red", label="optima")
        hyps = np.array(res["hypotheses"])
        ax.scatter(hyps[:, 0], hyps[:, 1], marker="x", s=80, c="black", label="final")
        ax.set_title(name, fontsize=9)
        ax.set_xlim(-15, 15)
        ax.set_ylim(-15, 15)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle("released parameter vectors (seed 0)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--nus", default="1,5")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", default="runs/galli")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nus = [float(v) for v in args.nus.split(",")]
    lines = [
        f"| setting | seeds | T = {args.rounds}: median dist to optimum 1 / 2 | both within 1 | "
        "validation stop: median round | at the stop: median dist 1 / 2 | both within 1 | "
        "max client leakage / participation |",
        "|---|---|---|---|---|---|---|---|",
    ]
    seed0: dict[str, dict] = {}
    summary = {}
    start = time.perf_counter()
    for name, sets in settings(nus).items():
        res = [run(s, sets, args.rounds) for s in range(args.seeds)]
        seed0[name] = res[0]
        d = np.array([r["dist"] for r in res])
        patience = next(iter(res[0]["dist_at_stop"]))
        at = {p: np.array([r["dist_at_stop"][p] for r in res]) for p in res[0]["dist_at_stop"]}
        stops = {p: np.array([r["stops"][p] for r in res]) for p in res[0]["stops"]}
        leak = max(r["leak_per_participation"] for r in res)
        summary[name] = {
            "median_dist": np.median(d, axis=0).tolist(),
            "both_within_1": float(np.mean((d <= 1).all(axis=1))),
            "by_patience": {
                str(p): {
                    "median_stop_round": float(np.median(stops[p])),
                    "median_dist": np.median(at[p], axis=0).tolist(),
                    "both_within_1": float(np.mean((at[p] <= 1).all(axis=1))),
                }
                for p in at
            },
            "median_validation_loss": {
                r: float(np.median([x["validation_loss"][r - 1] for x in res]))
                for r in (1, 10, 25, 50, 100, 150, args.rounds)
                if r <= args.rounds
            },
            "leak_per_participation": leak,
            "seconds": time.perf_counter() - start,
        }
        s0 = at[patience]
        lines.append(
            f"| {name} | {args.seeds} | {np.median(d[:, 0]):.2f} / {np.median(d[:, 1]):.2f} | "
            f"{np.mean((d <= 1).all(axis=1)):.0%} | {np.median(stops[patience]):.0f} | "
            f"{np.median(s0[:, 0]):.2f} / {np.median(s0[:, 1]):.2f} | "
            f"{np.mean((s0 <= 1).all(axis=1)):.0%} | {leak:.3f} |"
        )
        print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    shown = ["FedAvg (no DP)", "IFCA (no DP)", f"Algorithm 1, RMSE, nu={nus[-1]:g}"]
    figure1({k: seed0[k] for k in shown}, out / "figure1.png")
    first_dp = next(k for k in seed0 if k.startswith("Algorithm 1"))
    plot_max_leakage(
        seed0[first_dp]["ledger_rows"],
        seed0[first_dp]["truth"],
        out / "figure2.png",
        title=f"{first_dp}: max leakage per cluster (seed 0)",
    )
    print("\n".join(lines))
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
