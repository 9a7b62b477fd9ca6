"""Sweep plots: the privacy-utility curve and the effect of each swept knob."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tune.space import Sweep


def _numeric(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)


def plot_sweep(df: pd.DataFrame, sweep: Sweep, out: Path) -> list[Path]:
    """privacy_utility.png: final accuracy vs eps spent, one line per algorithm;
    knob_<key>.png: final accuracy vs each numeric swept key (one line per algorithm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df.dropna(subset=["accuracy"])
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, g in ok.groupby("algorithm"):
        g = g.groupby("epsilon_budget", dropna=False).agg(
            eps=("epsilon", "mean"), acc=("accuracy", "mean")
        )
        g = g.sort_values("eps")
        ax.plot(g["eps"], 100 * g["acc"], marker="o", label=str(algo))
    ax.set_xlabel("epsilon spent")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title(f"{sweep.name}: privacy-utility")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "privacy_utility.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    for key in sweep.space:
        if key not in ok or not _numeric(ok[key]):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for algo, g in ok.groupby("algorithm"):
            g = g.groupby(key)["accuracy"].mean().sort_index()
            ax.plot(g.index, 100 * g.values, marker="o", label=str(algo))
        ax.set_xlabel(key)
        ax.set_ylabel("final test accuracy (%)")
        if "loguniform" in sweep.space[key]:
            ax.set_xscale("log")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / f"knob_{key.replace('.', '_')}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
