"""The comparison table printed by `raysim run` and `raysim report`, and the comparison plot.

One unit everywhere a user reads accuracy: percent of a client's test samples, averaged over
clients (the definitions are in raysim/metrics/evaluation.py). A non-private run spent no
privacy budget it could account for: its eps is shown as "∞ (no DP)", never as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raysim.metrics.results import load_run
from raysim.privacy.report import both_epsilons

NO_DP = "∞ (no DP)"
METRIC_DP = "- (metric DP)"

# (header, key in summary.json / its "final", format); accuracies are fractions on disk.
COLUMNS = (
    ("algorithm", "algorithm", "{}"),
    ("rounds", "rounds", "{}"),
    ("All %", "accuracy", "pct"),
    ("majority %", "accuracy_majority", "pct"),
    ("minority %", "accuracy_minority", "pct"),
    ("worst client %", "accuracy_min", "pct"),
    ("test loss", "regression_loss", "{:.4g}"),  # a regression task's, which has no accuracy
    ("ARI", "ari", "{:.2f}"),
    ("M", "num_clusters", "{}"),
    ("eps spent", "epsilon", "eps"),
    ("wall s", "rounds_seconds", "{:.0f}"),  # every round's, a resumed run's before it too
)

LEGEND = (
    "accuracy in % (test accuracy averaged over clients; minority = the smallest true cluster,\n"
    "majority = the others); ARI: clusters recovered (1 = every client in its true cluster);\n"
    "eps spent: the largest per-client epsilon at the run's delta (distributed: the eps amplified\n"
    "by sampling, which needs participation hidden from the server, / the same noise's eps\n"
    "without amplification by sampling)"
)


def _cell(fmt: str, value: Any, summary: dict[str, Any]) -> str:
    if fmt == "eps":
        if summary.get("privacy_mode") == "none":
            return NO_DP
        if summary.get("privacy_mode") == "dprivacy":  # metric DP: leakage, not (eps, delta)
            return METRIC_DP
        if value is None:
            return "-"
        unamplified = summary.get("epsilon_unamplified")
        eps = f"{value:.2f}"
        if unamplified is not None:  # distributed: both, each with what it assumes
            eps = both_epsilons(eps, f"{unamplified:.2f}")
        return f"{eps} (delta {summary.get('delta'):g})"
    if value is None:
        return "-"
    if fmt == "pct":
        return f"{100 * value:.1f}"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def table_rows(run_dirs: Sequence[Path]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for d in run_dirs:
        summary, _ = load_run(Path(d))
        values = {**summary.get("final", {}), **summary}
        values.setdefault("rounds_seconds", summary.get("wall_seconds"))  # runs before it
        if values.get("accuracy") is None:
            values["regression_loss"] = values.get("loss")
        label = str(d) + (" (cluster identifiers not private)" if summary.get("warning") else "")
        rows.append([label] + [_cell(fmt, values.get(key), summary) for _, key, fmt in COLUMNS])
    header = ["run"] + [name for name, _, _ in COLUMNS]
    keep = [i for i in range(len(header)) if i < 3 or any(r[i] != "-" for r in rows)]
    return [header[i] for i in keep], [[r[i] for i in keep] for r in rows]


def comparison_table(run_dirs: Sequence[Path], legend: bool = True) -> str:
    """Columns nobody has a value for (e.g. ARI when no algorithm clusters) are left out."""
    header, rows = table_rows(run_dirs)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    lines = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
    return "\n".join(lines + ([LEGEND] if legend else []))


def comparison_plot(run_dirs: Sequence[Path], path: Path) -> None:
    """Test accuracy (%) per round of every run, one line each, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for d in run_dirs:
        summary, m = load_run(Path(d))
        if "accuracy" not in m:
            continue
        ev = m.dropna(subset=["accuracy"])
        label = summary["algorithm"]
        axes[0].plot(ev["round"], 100 * ev["accuracy"], label=label, lw=2)
        if "accuracy_minority" in ev:
            axes[1].plot(ev["round"], 100 * ev["accuracy_minority"], label=label, lw=2)
    from matplotlib.ticker import MaxNLocator

    first, _ = load_run(Path(run_dirs[0]))
    if first.get("privacy_mode") != "none":
        title = f"{first['dataset']}: eps {first.get('epsilon_budget')} per client"
        unamplified = first.get("epsilon_unamplified")
        if unamplified is not None:  # distributed: the budget is the noise-cohort eps
            title = f"{first['dataset']}: eps " + both_epsilons(
                f"{first.get('epsilon_budget')}", f"{unamplified:.3g}"
            )
        fig.suptitle(title)
    axes[0].set_title("all clients")
    axes[1].set_title("minority cluster")
    axes[0].set_ylabel("test accuracy (%)")
    for ax in axes:
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
