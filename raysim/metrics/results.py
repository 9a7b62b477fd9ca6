"""A run's directory: config.yaml, metrics.parquet, clients.parquet, privacy.parquet,
summary.json, PNG plots and, for clustering methods, assignments.parquet (each client's cluster
each round). `raysim report` reads them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raysim.config import dump_config
from raysim.metrics.evaluation import diagnostics_summary
from raysim.privacy.report import AMPLIFIED_LABEL, EPSILON_LABELS, UNAMPLIFIED_LABEL
from raysim.state.checkpoint import rows_table
from raysim.state.rundir import json_safe

# privacy.parquet's columns (PrivacyLedger.rows), also when nothing was charged
LEDGER_COLUMNS = [
    ("client", pa.int64()),
    ("round", pa.int64()),
    ("mechanism", pa.string()),
    ("params", pa.string()),
    ("epsilon", pa.float64()),
]

RESULT_FILES = (
    "config.yaml",
    "metrics.parquet",
    "clients.parquet",
    "privacy.parquet",
    "summary.json",
    "accuracy.png",
)


def write_results(out: Path, prep: Any, results: dict[str, Any]) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    cfg = prep.cfg
    (out / "config.yaml").write_text(dump_config(prep.recorded_config()))
    history = results["history"]
    pq.write_table(rows_table(history), out / "metrics.parquet")

    truth = np.asarray(prep.truth)
    accounted = accounts_epsilon(prep.privacy_summary, cfg.privacy.mode)
    clients = client_columns(truth, prep.dataset.train_sizes, results, accounted)
    leakage = results.get("client_leakage")
    if cfg.privacy.mode == "dprivacy" and leakage is not None:  # metric DP: its own ledger
        clients["leakage"] = pa.array(np.asarray(leakage, dtype=np.float64))
        rows = results.get("metric_ledger_rows") or []
        if rows:
            from raysim.metrics.leakage import plot_max_leakage

            pq.write_table(rows_table(rows), out / "leakage.parquet")
            plot_max_leakage(rows, truth, out / "leakage.png", rounds=len(history))
    pq.write_table(pa.table(clients), out / "clients.parquet")
    history_of_assignments = results.get("assignment_history") or []
    if history_of_assignments:  # long form: one row per (round, client)
        n = len(truth)
        pq.write_table(
            pa.table(
                {
                    "round": np.repeat([r for r, _ in history_of_assignments], n),
                    "client_id": np.tile(np.arange(n), len(history_of_assignments)),
                    "cluster": np.concatenate([a for _, a in history_of_assignments]),
                }
            ),
            out / "assignments.parquet",
        )
    ledger_rows = results["ledger_rows"]
    if ledger_rows:
        pq.write_table(rows_table(ledger_rows), out / "privacy.parquet")
    else:  # nothing charged: no rows (not one of nulls), the ledger's columns
        pq.write_table(pa.schema(LEDGER_COLUMNS).empty_table(), out / "privacy.parquet")

    last_eval = next((r for r in reversed(history) if "accuracy" in r), {})
    summary = {
        "name": cfg.name,
        "algorithm": cfg.algorithm.name,
        "dataset": cfg.data.dataset,
        "num_clients": int(len(truth)),
        "rounds": len(history),
        "seed": cfg.seed,
        "privacy_mode": cfg.privacy.mode,
        "epsilon": json_safe(history[-1]["epsilon"]) if history else None,
        "epsilon_budget": cfg.privacy.epsilon if cfg.privacy.mode != "none" else None,
        "delta": cfg.privacy.delta,
        "final_accuracy": last_eval.get("accuracy"),
        "final_loss": last_eval.get("loss"),
        "final": {k: v for k, v in last_eval.items() if k != "round"},
        "privacy": {
            **results.get("privacy", {}),
            **results["ledger_summary"],
            **prep.privacy_summary,
        },
        "diagnostics": diagnostics_summary(history),
        "reports_per_round": float(np.mean([r["participants"] for r in history]))
        if history
        else None,
        "wall_seconds": results["wall_seconds"],  # this process's (a resumed run: since resuming)
        # the rounds' own time, summed over every round, resumed or not: what a run costs
        "rounds_seconds": sum(row.get("round_seconds", 0.0) for row in history),
        "workers": len(results.get("workers", [])),
        "gpus_per_worker": results.get("gpus_per_worker"),
        "workers_replaced": results.get("workers_replaced", 0),
    }
    if history and "epsilon_unamplified" in history[-1]:  # distributed: both, labelled
        summary["epsilon_unamplified"] = json_safe(history[-1]["epsilon_unamplified"])
        summary["epsilon_labels"] = dict(EPSILON_LABELS)
    meta = getattr(prep.dataset, "meta", {})
    if meta.get("shared_samples"):  # more clients than the dataset holds their samples
        summary["shared_samples"] = (
            "clients share base samples: the population's clients hold more samples than the "
            "dataset has, so some hold the same ones (each client's own stay distinct)"
        )
    if any("dropped_out" in r for r in history):  # training.client_dropout: how many, in all
        summary["dropped_out"] = sum(r.get("dropped_out", 0) for r in history)
    if any("aborted" in r for r in history):  # privacy.shortfall: abort, rounds that released none
        summary["aborted_rounds"] = int(sum(r.get("aborted", 0) for r in history))
    if results.get("startup_seconds"):  # a Ray run: when each start-up step was done
        summary["startup_seconds"] = results["startup_seconds"]
    privacy = summary["privacy"]
    warning = privacy.get("identifiers_warning") or privacy.get("accounting_warning")
    if warning:  # said at the top, in words
        summary["warning"] = warning
    summary = json.loads(json.dumps(summary, default=_json_default), parse_constant=lambda c: None)
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))
    plot_run(out)
    return summary


def client_columns(
    truth: np.ndarray, train_sizes: np.ndarray, results: dict[str, Any], accounted: bool
) -> dict[str, pa.Array]:
    """clients.parquet's columns, one row per client of the population, built as columns: a
    million clients' rows as Python dicts took seconds and gigabytes. Null where a client has no
    value (not evaluated, no assignment, eps not accounted or not finite)."""
    n = len(truth)
    accuracy, loss = np.full(n, np.nan), np.full(n, np.nan)
    no_accuracy, no_loss = np.ones(n, dtype=bool), np.ones(n, dtype=bool)
    for r in results["eval"]:
        if r.accuracy is not None:
            accuracy[r.client_id], no_accuracy[r.client_id] = r.accuracy, False
        if r.loss is not None:
            loss[r.client_id], no_loss[r.client_id] = r.loss, False
    assigned = results.get("assignments")
    reported = results.get("rounds_reported")  # absent from results made before it was counted
    eps = np.asarray(results["client_epsilon"], dtype=np.float64)
    return {
        "client_id": pa.array(np.arange(n, dtype=np.int64)),
        "true_cluster": pa.array(truth.astype(np.int64)),
        "assigned_cluster": pa.nulls(n)
        if assigned is None
        else pa.array(np.asarray(assigned, dtype=np.int64)),
        "accuracy": pa.array(accuracy, mask=no_accuracy),
        "loss": pa.array(loss, mask=no_loss),
        "num_train": pa.array(np.asarray(train_sizes, dtype=np.int64)),
        "rounds_reported": pa.nulls(n)
        if reported is None
        else pa.array(np.asarray(reported, dtype=np.int64)),
        "epsilon": pa.array(eps, mask=~np.isfinite(eps)) if accounted else pa.nulls(n),
    }


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def load_run(run_dir: Path) -> tuple[dict[str, Any], Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = pq.read_table(run_dir / "metrics.parquet").to_pandas()
    return summary, metrics


def accounts_epsilon(privacy_summary: dict[str, Any], mode: str | None) -> bool:
    """Whether the run's mode is (eps, delta)-DP (``PrivacyMode.accounts_epsilon``, in its
    privacy summary); a run written before the summary said so: unless it had no DP."""
    return bool(privacy_summary.get("accounts_epsilon", mode != "none"))


def plot_run(run_dir: Path) -> None:
    """accuracy.png (all clients and per true cluster), epsilon.png (spent per round) and, under
    adaptive clipping, clip.png (the clip and the noisy share of updates under it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, m = load_run(run_dir)
    # a regression task (synthetic_linear) has no accuracy: its test loss (MSE) instead
    metric = "accuracy" if "accuracy" in m and m["accuracy"].notna().any() else "loss"
    ev = m.dropna(subset=[metric]) if metric in m else m.iloc[0:0]
    scale = 100 if metric == "accuracy" else 1
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(ev):
        ax.plot(ev["round"], scale * ev[metric], label="all clients", lw=2)
        for col in sorted(c for c in m.columns if c.startswith(f"{metric}_cluster_")):
            lbl = col.removeprefix(f"{metric}_")
            ax.plot(ev["round"], scale * ev[col], label=lbl, lw=1, alpha=0.8)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)" if metric == "accuracy" else "test loss")
    title = f"{summary['algorithm']} on {summary['dataset']}"
    if summary.get("warning"):
        title += f"\n({warning_label(summary['warning'])})"
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "accuracy.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    mode = summary.get("privacy_mode")
    if not accounts_epsilon(summary.get("privacy", {}), mode):  # eps is not 0: not defined
        text = "no DP: eps = ∞" if mode == "none" else "metric DP: leakage.png"
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    elif "epsilon_unamplified" in m:  # distributed: both eps, each with what it assumes
        ax.plot(m["round"], m["epsilon"], marker=".", label=f"eps ({AMPLIFIED_LABEL})")
        ax.plot(
            m["round"], m["epsilon_unamplified"], marker=".", label=f"eps ({UNAMPLIFIED_LABEL})"
        )
        ax.set_title("distributed DP: eps with and without amplification by sampling", fontsize=9)
        ax.legend(fontsize=7)
    else:
        ax.plot(m["round"], m["epsilon"], marker=".")
    ax.set_xlabel("round")
    ax.set_ylabel(f"epsilon spent (delta={summary['delta']})")
    fig.tight_layout()
    fig.savefig(run_dir / "epsilon.png", dpi=100)
    plt.close(fig)
    if "clip" in m:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(m["round"], m["clip"], marker=".", label="clip")
        ax.set_xlabel("round")
        ax.set_ylabel("clip (update L2 norm)")
        if "unclipped_fraction" in m:  # absent where every round's secure sum was aborted
            share = ax.twinx()
            share.plot(m["round"], m["unclipped_fraction"], color="tab:orange", alpha=0.6, lw=1)
            share.set_ylabel("noisy share of updates under the clip", color="tab:orange")
        ax.set_title(f"adaptive clipping to the {summary['privacy'].get('clip_quantile')} quantile")
        fig.tight_layout()
        fig.savefig(run_dir / "clip.png", dpi=100)
        plt.close(fig)


def warning_label(warning: str) -> str:
    """A run's privacy warning in a few words (its text up to the colon), for titles and tables."""
    return warning.split(":", 1)[0]
