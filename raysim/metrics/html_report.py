"""`raysim report`'s page: one self-contained report.html for a run, a compare directory or a sweep.

Everything is inline (figures as PNG data URIs, the style sheet in the page, no script), so the
file opens offline, can be mailed, and never changes the directories it was drawn from. Runs that
differ only in their seed form one group (an algorithm, plus the config keys that vary between
its runs, e.g. ``privacy.epsilon`` in a sweep); each figure shows the mean over a group's seeds
with the std over seeds as a band or error bar (``np.std``, as compare.md). A figure whose data no
run recorded is left out with a one-line note, never drawn from something else.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import yaml

from raysim.config import ConfigError, dotted
from raysim.metrics.report import METRIC_DP, NO_DP
from raysim.privacy.report import AMPLIFIED_LABEL, UNAMPLIFIED_LABEL, both_epsilons

# config keys that never split runs into groups: the seed is what a group is taken over
IGNORED_KEYS = ("seed", "name", "privacy.client_seed")
IGNORED_PREFIXES = ("runtime.",)
MAX_CLIENT_LINES = 200  # each client's eps as its own line up to this many; a band beyond
MAX_HEATMAP_RUNS = 40
MAX_PANELS = 12
MEMBER_COLUMNS = ("in", "member", "is_member", "included", "inserted", "canary_in", "label")


@dataclass
class RunData:
    """A finished run's files, as the report reads them (absent files: None)."""

    path: Path
    summary: dict[str, Any]
    config: dict[str, Any]
    metrics: pd.DataFrame | None
    clients: pd.DataFrame | None
    ledger: pd.DataFrame | None
    group: str = ""
    assignments: pd.DataFrame | None = None  # each client's cluster each round

    @property
    def seed(self) -> Any:
        return self.summary.get("seed", self.config.get("seed"))

    @property
    def algorithm(self) -> str:
        return str(self.summary.get("algorithm", self.config.get("algorithm.name", "?")))

    @property
    def accounts_epsilon(self) -> bool:
        from raysim.metrics.results import accounts_epsilon

        return accounts_epsilon(self.summary.get("privacy", {}), self.summary.get("privacy_mode"))


@dataclass
class Group:
    label: str
    algorithm: str
    runs: list[RunData] = field(default_factory=list)
    varying: dict[str, Any] = field(default_factory=dict)  # the keys that name it


# ------------------------------------------------------------------------------- reading


def _flatten(d: dict[str, Any]) -> dict[str, Any]:
    """A config's dotted keys, lists as JSON text (so that they compare and group)."""
    return {
        k: json.dumps(v, sort_keys=True) if isinstance(v, list) else v for k, v in dotted(d).items()
    }


def _parquet(path: Path) -> pd.DataFrame | None:
    return pq.read_table(path).to_pandas() if path.is_file() else None


def load_runs(run_dirs: Sequence[Path]) -> list[RunData]:
    runs = []
    for d in run_dirs:
        d = Path(d)
        cfg_file = d / "config.yaml"
        config = _flatten(yaml.safe_load(cfg_file.read_text()) or {}) if cfg_file.is_file() else {}
        runs.append(
            RunData(
                path=d,
                summary=json.loads((d / "summary.json").read_text()),
                config=config,
                metrics=_parquet(d / "metrics.parquet"),
                clients=_parquet(d / "clients.parquet"),
                ledger=_parquet(d / "privacy.parquet"),
                assignments=_parquet(d / "assignments.parquet"),
            )
        )
    return runs


def _ignored(key: str) -> bool:
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES) or key == "algorithm.name"


def group_runs(runs: Sequence[RunData]) -> list[Group]:
    """Runs of one algorithm whose configs differ only in ignored keys (the seed) form a group,
    named by the algorithm and the keys that vary between that algorithm's runs."""
    by_algorithm: dict[str, list[RunData]] = {}
    for r in runs:
        by_algorithm.setdefault(r.algorithm, []).append(r)
    groups: dict[tuple, Group] = {}
    for algorithm, rs in by_algorithm.items():
        keys = sorted({k for r in rs for k in r.config if not _ignored(k)})
        varying = [k for k in keys if len({repr(r.config.get(k)) for r in rs}) > 1]
        for r in rs:
            values = {k: r.config.get(k) for k in varying}
            label = algorithm + "".join(f", {k.split('.')[-1]}={v}" for k, v in values.items())
            key = (algorithm, tuple(repr(v) for v in values.values()))
            group = groups.setdefault(key, Group(label, algorithm, varying=values))
            group.runs.append(r)
            r.group = label
    return list(groups.values())


# ------------------------------------------------------------------------------- numbers


def _mean_std(values: Sequence[Any]) -> tuple[float, float] | None:
    vals = [float(v) for v in values if v is not None and not _isnan(v)]
    if not vals:
        return None
    return float(np.mean(vals)), float(np.std(vals))


def _isnan(v: Any) -> bool:
    try:
        return math.isnan(float(v))
    except (TypeError, ValueError):
        return True


def _final(r: RunData, key: str) -> Any:
    if key in ("rounds", "rounds_seconds", "epsilon", "epsilon_unamplified"):
        value = r.summary.get(key)
        if key == "rounds_seconds" and value is None:
            value = r.summary.get("wall_seconds")
        return value
    return (r.summary.get("final") or {}).get(key)


# (header, key, scale, decimals)
SUMMARY_COLUMNS = (
    ("All %", "accuracy", 100, 1),
    ("majority %", "accuracy_majority", 100, 1),
    ("minority %", "accuracy_minority", 100, 1),
    ("worst client %", "accuracy_min", 100, 1),
    ("test loss", "loss", 1, 4),
    ("ARI", "ari", 1, 2),
    ("eps spent", "epsilon", 1, 2),
    ("wall s", "rounds_seconds", 1, 0),
)


def summary_table(groups: Sequence[Group]) -> tuple[list[str], list[list[str]]]:
    """One row per group: mean ± std over its seeds of the final metrics (accuracy in %)."""
    header = ["group", "seeds", "rounds"] + [c[0] for c in SUMMARY_COLUMNS]
    rows = []
    for g in groups:
        rounds = sorted({str(r.summary.get("rounds")) for r in g.runs})
        row = [g.label, str(len(g.runs)), "/".join(rounds)]
        for _, key, scale, dec in SUMMARY_COLUMNS:
            modes = {r.summary.get("privacy_mode") for r in g.runs}
            if key == "epsilon" and modes <= {"none"}:
                row.append(NO_DP)
                continue
            if key == "epsilon" and modes <= {"dprivacy"}:
                row.append(METRIC_DP)
                continue
            cell = _cell(g, key, scale, dec)
            if key == "epsilon" and unamplified(g):  # distributed: both, labelled
                cell = both_epsilons(cell, _cell(g, "epsilon_unamplified", scale, dec))
            row.append(cell)
        rows.append(row)
    keep = [i for i in range(len(header)) if i < 4 or any(r[i] != "-" for r in rows)]
    if any(r[3] != "-" for r in rows) and "test loss" in header:  # accuracy says it: no loss
        keep = [i for i in keep if header[i] != "test loss"]
    return [header[i] for i in keep], [[r[i] for i in keep] for r in rows]


def _cell(g: Group, key: str, scale: float, dec: int) -> str:
    """Mean (± std where several seeds) of a final value over the group's runs, or "-"."""
    ms = _mean_std([_final(r, key) for r in g.runs])
    if ms is None:
        return "-"
    cell = f"{scale * ms[0]:.{dec}f}"
    return cell + (f" ± {scale * ms[1]:.{dec}f}" if len(g.runs) > 1 else "")


def unamplified(g: Group) -> bool:
    """Whether every run of the group has the eps without amplification (distributed)."""
    return all(r.summary.get("epsilon_unamplified") is not None for r in g.runs)


def per_round(g: Group, column: str) -> pd.DataFrame | None:
    """Mean and std over the group's seeds of ``column`` per round (rounds with a value)."""
    series = []
    for r in g.runs:
        m = r.metrics
        if m is not None and column in m and m[column].notna().any():
            series.append(m.dropna(subset=[column]).set_index("round")[column].astype(float))
    if not series:
        return None
    table = pd.concat(series, axis=1)
    return pd.DataFrame(
        {"mean": table.mean(axis=1), "std": table.std(axis=1, ddof=0), "n": table.count(axis=1)}
    ).sort_index()


def client_epsilon(r: RunData) -> pd.DataFrame | None:
    """Each client's eps spent after each round (clients x rounds), from the ledger: a client's
    last charge in a round says what it has spent; rounds without a charge keep the last."""
    led = r.ledger
    if led is None or not len(led) or not r.accounts_epsilon:
        return None
    led = led[led["client"].notna()]
    if not len(led):
        return None
    rounds = int(max(r.summary.get("rounds") or 0, led["round"].max()))
    spent = led.groupby(["client", "round"])["epsilon"].max().unstack("round")
    spent = spent.reindex(columns=range(0, rounds + 1)).ffill(axis=1).fillna(0.0)  # 0: none
    spent.index = spent.index.astype(int)
    return spent


# ------------------------------------------------------------------------------- figures


class Omitted(Exception):
    """A figure that is not drawn, and the one line that says why."""


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _colors(groups: Sequence[Group]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(groups) <= 10 else "tab20"]
    return {g.label: cmap(i % cmap.N) for i, g in enumerate(groups)}


def _metric(groups: Sequence[Group]) -> tuple[str, float, str]:
    """Accuracy (in %) where the task has one, else the test loss (a regression task)."""
    for g in groups:
        for r in g.runs:
            m = r.metrics
            if m is not None and "accuracy" in m and m["accuracy"].notna().any():
                return "accuracy", 100.0, "test accuracy (%)"
    return "loss", 1.0, "test loss"


def fig_rounds(groups: Sequence[Group]) -> str:
    metric, scale, ylabel = _metric(groups)
    panels = [(metric, "all clients")]
    if metric == "accuracy":
        panels += [("accuracy_minority", "minority cluster"), ("accuracy_min", "worst client")]
    panels = [(c, t) for c, t in panels if any(per_round(g, c) is not None for g in groups)]
    if not panels:
        raise Omitted(f"no run recorded its {ylabel} per round")
    colors = _colors(groups)
    fig = _figure(4.2 * len(panels) + 1.8, 3.8)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (column, title) in zip(axes, panels, strict=True):
        for g in groups:
            s = per_round(g, column)
            if s is None:
                continue
            x, mean, std = s.index.to_numpy(), scale * s["mean"], scale * s["std"]
            ax.plot(x, mean, marker="o", ms=3, lw=2, color=colors[g.label], label=g.label)
            if len(g.runs) > 1:
                ax.fill_between(x, mean - std, mean + std, color=colors[g.label], alpha=0.2, lw=0)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel(ylabel)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    return _png(fig)


def fig_privacy_utility(groups: Sequence[Group]) -> str:
    metric, scale, ylabel = _metric(groups)
    colors = _colors(groups)
    fig = _figure(7.5, 4.2)
    ax = fig.subplots()
    series: dict[str, list[tuple[float, float, float, float, Group]]] = {}
    flat = []
    for g in groups:
        y = _mean_std([(r.summary.get("final") or {}).get(metric) for r in g.runs])
        if y is None:
            continue
        if all(r.summary.get("privacy_mode") == "none" for r in g.runs):
            flat.append((g, y))
            continue
        if not all(r.accounts_epsilon for r in g.runs):
            continue  # metric DP: no (eps, delta) to place it at
        x = _mean_std([r.summary.get("epsilon") for r in g.runs])
        if x is None:
            continue
        rest = {k: v for k, v in g.varying.items() if k != "privacy.epsilon"}
        name = g.algorithm + "".join(f", {k.split('.')[-1]}={v}" for k, v in rest.items())
        x_unamplified = _mean_std([r.summary.get("epsilon_unamplified") for r in g.runs])
        if unamplified(g) and x_unamplified is not None:  # distributed: both, labelled
            series.setdefault(f"{name} ({AMPLIFIED_LABEL})", []).append((*x, *y, g))
            series.setdefault(f"{name} ({UNAMPLIFIED_LABEL})", []).append((*x_unamplified, *y, g))
            continue
        series.setdefault(name, []).append((x[0], x[1], y[0], y[1], g))
    if not series and not flat:
        raise Omitted("no run has both a final test metric and an (eps, delta) it spent")
    for name, points in series.items():
        points.sort(key=lambda p: p[0])
        xs, xerr, ys, yerr = (np.array([p[i] for p in points]) for i in range(4))
        color = colors[points[0][4].label]
        hollow = name.endswith(f"({UNAMPLIFIED_LABEL})")  # the same runs, without amplification
        ax.errorbar(
            xs, scale * ys, xerr=xerr, yerr=scale * yerr, marker="o", capsize=4, lw=1.5,
            color=color, label=name, ls=":" if hollow else "-",
            mfc="white" if hollow else color,
        )  # fmt: skip
    for g, (mean, std) in flat:
        ax.axhline(scale * mean, ls="--", color=colors[g.label], label=f"{g.label} (no DP)")
        if len(g.runs) > 1:
            ax.axhspan(scale * (mean - std), scale * (mean + std), color=colors[g.label], alpha=0.1)
    deltas = sorted({r.summary.get("delta") for g in groups for r in g.runs} - {None})
    if series:  # from 0: a spread of 0.001 in eps is not drawn as a spread of the page's width
        right = max(p[0] + p[1] for points in series.values() for p in points)
        ax.set_xlim(0, 1.15 * right if right > 0 else 1)
    ax.set_xlabel(f"eps spent (largest per client; delta {', '.join(map(str, deltas))})")
    ax.set_ylabel(f"final {ylabel}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def fig_client_accuracy(groups: Sequence[Group]) -> str:
    data, labels, clusters = [], [], []
    for g in groups:
        frames = [r.clients for r in g.runs if r.clients is not None and "accuracy" in r.clients]
        frames = [f[f["accuracy"].notna()] for f in frames]
        frames = [f for f in frames if len(f)]
        if frames:
            both = pd.concat(frames)
            data.append(100 * both["accuracy"].to_numpy(float))
            clusters.append(both.get("true_cluster", pd.Series(0, index=both.index)).to_numpy())
            labels.append(g.label)
    if not data:
        raise Omitted("no run recorded its clients' final test accuracy (clients.parquet)")
    from matplotlib import colormaps

    fig = _figure(max(6.0, 1.3 * len(data) + 2.5), 4.2)
    ax = fig.subplots()
    ax.boxplot(data, showfliers=False, widths=0.5, medianprops={"color": "black"})
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=20 if len(labels) > 4 else 0)
    cmap = colormaps["tab10"]
    rng = np.random.default_rng(0)  # jitter only: where a point sits sideways means nothing
    seen: set[int] = set()
    for i, (values, cl) in enumerate(zip(data, clusters, strict=True), start=1):
        x = i + rng.uniform(-0.18, 0.18, size=len(values))
        for c in np.unique(cl):
            sel = cl == c
            label = f"true cluster {int(c)}" if int(c) not in seen else None
            seen.add(int(c))
            ax.scatter(x[sel], values[sel], s=10, alpha=0.6, color=cmap(int(c) % 10), label=label)
    ax.set_ylabel("client's final test accuracy (%)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def _matched(true: np.ndarray, assigned: np.ndarray) -> np.ndarray:
    """``assigned`` relabelled so that each cluster takes the id of the true cluster it overlaps
    most (Hungarian matching); clusters left over are numbered after the true ones."""
    from scipy.optimize import linear_sum_assignment

    ids = np.unique(assigned)
    truths = np.unique(true)
    overlap = np.array([[np.sum((assigned == a) & (true == t)) for t in truths] for a in ids])
    rows, cols = linear_sum_assignment(-overlap)
    mapping = {ids[r]: truths[c] for r, c in zip(rows, cols, strict=True)}
    extra = int(max(truths.max(), 0)) + 1
    for a in ids:
        if a not in mapping:
            mapping[a] = extra
            extra += 1
    return np.array([mapping[a] for a in assigned])


def fig_assignments(groups: Sequence[Group]) -> str:
    rows, names = [], []
    truth = None
    for g in groups:
        for r in g.runs:
            c = r.clients
            if c is None or "assigned_cluster" not in c or c["assigned_cluster"].isna().any():
                continue
            c = c.sort_values(["true_cluster", "client_id"])
            if truth is None:
                truth = c["true_cluster"].to_numpy(int)
                order = c["client_id"].to_numpy()
            elif not np.array_equal(c["client_id"].to_numpy(), order):
                continue  # another population: not comparable column by column
            rows.append(_matched(truth, c["assigned_cluster"].to_numpy(int)))
            names.append(f"{g.label}, seed {r.seed}")
    if truth is None:
        raise Omitted("no run assigns clients to clusters (e.g. fedavg, local): nothing to draw")
    note = ""
    if len(rows) > MAX_HEATMAP_RUNS:
        note = f" (the first {MAX_HEATMAP_RUNS} of {len(rows)} runs)"
        rows, names = rows[:MAX_HEATMAP_RUNS], names[:MAX_HEATMAP_RUNS]
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm, ListedColormap

    grid = np.vstack([truth, *rows])
    k = int(grid.max()) + 1
    base = colormaps["tab10" if k <= 10 else "tab20"]
    cmap = ListedColormap([base(i % base.N) for i in range(k)])
    fig = _figure(min(14.0, 3.5 + 0.25 * grid.shape[1]), 1.0 + 0.32 * grid.shape[0])
    ax = fig.subplots()
    image = ax.imshow(
        grid, aspect="auto", interpolation="nearest", cmap=cmap,
        norm=BoundaryNorm(np.arange(k + 1) - 0.5, k),
    )  # fmt: skip
    ax.set_yticks(range(grid.shape[0]), ["true cluster", *names], fontsize=8)
    ax.axhline(0.5, color="white", lw=3)
    ax.set_xlabel("client (sorted by true cluster)" + note)
    if grid.shape[1] <= 60:
        ax.set_xticks(range(grid.shape[1]), [str(int(c)) for c in order], fontsize=6)
    else:
        ax.set_xticks([])
    bar = fig.colorbar(image, ax=ax, ticks=range(k), fraction=0.04, pad=0.01)
    bar.set_label("cluster")
    return _png(fig)


def _cluster_colors(k: int) -> tuple[Any, Any]:
    """A colour per cluster id 0..k-1 (grey below: -1, not chosen) and its norm."""
    from matplotlib import colormaps
    from matplotlib.colors import BoundaryNorm, ListedColormap

    base = colormaps["tab10" if k <= 10 else "tab20"]
    cmap = ListedColormap(["lightgrey"] + [base(i % base.N) for i in range(k)])
    return cmap, BoundaryNorm(np.arange(-1, k + 1) - 0.5, k + 1)


def _kept_panels(panels: list[Any], why_none: str) -> tuple[list[Any], bool]:
    """The first MAX_PANELS panels, and whether some were left out; Omitted(why_none) if none."""
    if not panels:
        raise Omitted(why_none)
    return panels[:MAX_PANELS], len(panels) > MAX_PANELS


def _panel_grid(count: int, note: bool) -> tuple[Any, np.ndarray]:
    """A figure of ``count`` panels, three to a row (room for a title line where ``note``)."""
    cols = min(3, count)
    nrows = math.ceil(count / cols)
    fig = _figure(4.3 * cols + 0.5, 3.3 * nrows + (0.3 if note else 0))
    axes = np.atleast_1d(fig.subplots(nrows, cols, squeeze=False)).ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes


def assignment_grid(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    """A run's rounds and its (round x client) clusters, clients sorted by true cluster, each
    round's ids matched to the true clusters; -1 where a client has not chosen yet."""
    clients = run.clients.sort_values(["true_cluster", "client_id"])
    order, truth = clients["client_id"].to_numpy(), clients["true_cluster"].to_numpy(int)
    table = run.assignments.pivot(index="round", columns="client_id", values="cluster")[order]
    rows = []
    for values in table.to_numpy(int):
        chose = values >= 0
        row = np.full(len(values), -1)
        if chose.any():
            row[chose] = _matched(truth[chose], values[chose])
        rows.append(row)
    return table.index.to_numpy(), np.vstack(rows)


def fig_assignment_rounds(groups: Sequence[Group]) -> str:
    panels = []
    for g in groups:
        run = next((r for r in g.runs if r.assignments is not None and r.clients is not None), None)
        if run is not None:
            panels.append((g, run))
    panels, note = _kept_panels(
        panels,
        "no run recorded its assignments round by round (assignments.parquet: clustering "
        "methods; fedavg and local assign none)",
    )
    grids = [(g, *assignment_grid(run)) for g, run in panels]
    k = max(int(grid.max()) for _, _, grid in grids) + 1
    cmap, norm = _cluster_colors(max(k, 1))
    fig, axes = _panel_grid(len(grids), note)
    for ax, (g, rounds, grid) in zip(axes, grids, strict=False):
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        ax.set_title(g.label, fontsize=9)
        ax.set_xlabel("client (sorted by true cluster)")
        ax.set_ylabel("round")
        ticks = np.unique(np.linspace(0, len(rounds) - 1, min(len(rounds), 6)).astype(int))
        ax.set_yticks(ticks, [str(rounds[t]) for t in ticks], fontsize=7)
        ax.set_xticks([])
    bar = fig.colorbar(image, ax=list(axes[: len(grids)]), ticks=range(-1, k), fraction=0.03)
    bar.set_label("cluster (-1: none yet)")
    if note:
        fig.suptitle(f"the first {MAX_PANELS} of {len(groups)} groups", fontsize=9)
    return _png(fig)


def fig_client_epsilon(groups: Sequence[Group]) -> str:
    panels = []
    for g in groups:
        spent = [(r, e) for r in g.runs if (e := client_epsilon(r)) is not None]
        if spent:
            panels.append((g, spent))
    panels, note = _kept_panels(
        panels,
        "no run has a per-client (eps, delta) ledger (privacy.mode none: eps = ∞; dprivacy: "
        "metric leakage, not eps)",
    )
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator

    cmap = colormaps["tab10"]
    fig, axes = _panel_grid(len(panels), note)
    for ax, (g, spent) in zip(axes, panels, strict=False):
        # a client's eps averaged over the group's seeds (same population in each)
        table = pd.concat([e for _, e in spent]).groupby(level=0).mean()
        rounds = table.columns.to_numpy()
        truth = {}
        clients = spent[0][0].clients
        if clients is not None and "true_cluster" in clients:
            truth = dict(zip(clients["client_id"], clients["true_cluster"], strict=True))
        if len(table) <= MAX_CLIENT_LINES:
            for cid, row in table.iterrows():
                color = cmap(int(truth.get(cid, 0)) % 10)
                ax.plot(rounds, row.to_numpy(), color=color, lw=1.2, alpha=0.7)
        else:
            q = np.percentile(table.to_numpy(), [5, 50, 95], axis=0)
            ax.fill_between(rounds, q[0], q[2], alpha=0.3, label="clients, 5-95%")
            ax.plot(rounds, q[1], lw=1.5, label="median client")
        top = per_round(g, "epsilon")
        if top is not None:
            x, y = np.r_[0, top.index.to_numpy()], np.r_[0.0, top["mean"].to_numpy()]
            label = "largest (metrics)"
            if unamplified(g):
                label = f"largest ({AMPLIFIED_LABEL})"
            ax.plot(x, y, color="black", lw=1.5, ls=":", label=label)
        without = per_round(g, "epsilon_unamplified")
        if without is not None:  # distributed: the same noise, no amplification by sampling
            x, y = np.r_[0, without.index.to_numpy()], np.r_[0.0, without["mean"].to_numpy()]
            ax.plot(x, y, color="tab:red", lw=1.5, ls="-.", label=f"largest ({UNAMPLIFIED_LABEL})")
        budgets = {r.summary.get("epsilon_budget") for r in g.runs} - {None}
        for b in budgets:
            ax.axhline(b, ls="--", color="grey", lw=1, label="budget")
        ax.set_title(g.label, fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("eps spent")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    if note:
        fig.suptitle(f"the first {MAX_PANELS} of {len(groups)} groups", fontsize=9)
    return _png(fig)


def find_audits(roots: Sequence[Path]) -> list[Path]:
    """Every audit.parquet (``raysim audit``) at or under the directories read."""
    found: list[Path] = []
    for root in roots:
        root = Path(root)
        if root.is_dir():
            found += sorted(p for p in root.rglob("audit.parquet") if p not in found)
    return found


def _audit_columns(table: pd.DataFrame) -> tuple[str, str] | None:
    if "score" not in table:
        return None
    for name in MEMBER_COLUMNS:
        if name in table and table[name].dropna().isin([0, 1, True, False]).all():
            return "score", name
    flags = [c for c in table if c != "score" and table[c].dtype == bool]
    return ("score", flags[0]) if flags else None


def fig_audits(audits: Sequence[Path], roots: Sequence[Path]) -> str:
    if not audits:
        raise Omitted("no audit.parquet (raysim audit) in the directories read")
    usable = []
    for p in audits:
        table = pd.read_parquet(p)
        cols = _audit_columns(table)
        if cols is not None:
            usable.append((p, table, cols))
    if not usable:
        where = ", ".join(str(p) for p in audits)
        raise Omitted(f"{where}: no score column with an in/out column beside it")
    usable = usable[:MAX_PANELS]
    cols_n = min(3, len(usable))
    nrows = math.ceil(len(usable) / cols_n)
    fig = _figure(4.3 * cols_n + 0.5, 3.3 * nrows)
    axes = np.atleast_1d(fig.subplots(nrows, cols_n, squeeze=False)).ravel()
    for ax in axes[len(usable) :]:
        ax.set_visible(False)
    for ax, (p, table, (score, member)) in zip(axes, usable, strict=False):
        scores = table[score].astype(float)
        inside = table[member].astype(bool)
        bins = np.histogram_bin_edges(scores.dropna(), bins=30)
        ax.hist(scores[inside], bins=bins, alpha=0.6, label=f"in ({int(inside.sum())})")
        ax.hist(scores[~inside], bins=bins, alpha=0.6, label=f"out ({int((~inside).sum())})")
        info = p.parent / "audit.json"
        title = _relative(p.parent, roots)
        if info.is_file():
            meta = json.loads(info.read_text())
            bits = [f"{k} {_short(v)}" for k, v in meta.items() if _scalar(v)][:3]
            title += "\n" + ", ".join(bits) if bits else ""
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("score")
        ax.set_ylabel("count")
        ax.legend(fontsize=7)
    return _png(fig)


def _scalar(v: Any) -> bool:
    return isinstance(v, int | float | str) and not isinstance(v, bool)


def _short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)[:24]


def _relative(path: Path, roots: Sequence[Path]) -> str:
    for root in roots:
        try:
            rel = Path(path).resolve().relative_to(Path(root).resolve())
            return str(Path(Path(root).name) / rel) if str(rel) != "." else Path(root).name
        except ValueError:
            continue
    return str(path)


# ------------------------------------------------------------------------------- page

STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d1d1f;
       margin: 0 auto; max-width: 1180px; padding: 24px 28px 60px; background: #fff; }
h1 { font-size: 1.6em; margin: 0 0 4px; }
h2 { font-size: 1.2em; margin: 34px 0 6px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.meta { color: #555; margin: 0 0 14px; }
.what { color: #444; margin: 4px 0 10px; max-width: 900px; }
.note { color: #8a5a00; background: #fff6e0; border-left: 4px solid #e0a800; padding: 6px 10px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; margin: 8px 0; }
th, td { padding: 5px 10px; border-bottom: 1px solid #e4e4e4; text-align: right; }
th { background: #f4f5f7; font-weight: 600; }
td:first-child, th:first-child { text-align: left; }
tbody tr:hover { background: #fafbff; }
figure { margin: 6px 0 0; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: #555; font-size: 0.9em; }
nav a { margin-right: 14px; }
code { background: #f4f5f7; padding: 1px 4px; border-radius: 3px; }
details { margin-top: 8px; color: #444; }
"""

SECTIONS = (
    ("rounds", "Accuracy per round", "Mean over seeds per round; the band: ± one std over seeds."),
    (
        "privacy-utility",
        "Privacy and utility",
        "Final test metric against the eps spent (largest per client), mean over seeds with ± "
        "one std as error bars; a run without DP is a dashed line (eps = ∞). A distributed run "
        f"is drawn twice: at its noise-cohort eps ({AMPLIFIED_LABEL}) and, hollow, at the same "
        f"noise's eps with no amplification by sampling ({UNAMPLIFIED_LABEL}).",
    ),
    (
        "clients",
        "Accuracy of each client",
        "Each client's final test accuracy, every seed pooled; the box spans the quartiles, "
        "points are coloured by the client's true cluster.",
    ),
    (
        "assignments",
        "Cluster assignment of each client",
        "The server's final assignment (clients.parquet), one row per run; cluster ids are "
        "matched to the true clusters (Hungarian matching on overlap), clusters left over take "
        "the next ids.",
    ),
    (
        "assignment-rounds",
        "Cluster assignment of each client, round by round",
        "Each round's assignment (assignments.parquet: the server's, or where clients choose, "
        "their choices), one panel per group (its first seed's run): a row per round, a column "
        "per client sorted by true cluster, ids matched to the true clusters each round as above; "
        "grey: not chosen yet.",
    ),
    (
        "epsilon",
        "Each client's eps over rounds",
        "From the privacy ledger (privacy.parquet): each client's eps spent after each round, "
        "averaged over seeds, coloured by true cluster (a 5-95% band when there are more than "
        f"{MAX_CLIENT_LINES} clients); the dotted black line is the largest per round "
        "(metrics.parquet), the dashed one the budget; round 0: before the first. Under "
        "distributed DP the dash-dotted red line is the largest eps with no amplification by "
        "sampling (the same noise; the budget is the noise-cohort eps's).",
    ),
    (
        "audit",
        "Privacy audit",
        "Score distributions of the canaries inside and outside training (audit.parquet of "
        "raysim audit).",
    ),
)


def _kind(roots: Sequence[Path], runs: Sequence[RunData]) -> str:
    if len(roots) == 1:
        root = Path(roots[0])
        if (root / "trials.parquet").is_file():
            return "sweep"
        if (root / "compare.json").is_file():
            return "comparison"
        if len(runs) == 1 and (root / "summary.json").is_file():
            return "run"
    return f"{len(runs)} runs"


def _figure_html(section: str, uri: str, title: str) -> str:
    alt = html.escape(title, quote=True)
    return f'<figure><img id="fig-{section}" src="{uri}" alt="{alt}"></figure>'


def render(run_dirs: Sequence[Path], roots: Sequence[Path]) -> str:
    """The page's HTML for the finished runs ``run_dirs`` found under ``roots``."""
    from raysim import __version__

    runs = load_runs(run_dirs)
    groups = group_runs(runs)
    audits = find_audits(roots)
    header, rows = summary_table(groups)
    datasets = sorted({str(r.summary.get("dataset")) for r in runs})
    kind = _kind(roots, runs)
    name = ", ".join(Path(r).name or str(r) for r in roots)
    title = f"raysim report: {name}"
    meta = (
        f"{kind}; {len(runs)} run(s) in {len(groups)} group(s); dataset {', '.join(datasets)}; "
        f"drawn {time.strftime('%Y-%m-%d %H:%M')} by raysim {__version__} from "
        + ", ".join(f"<code>{html.escape(str(Path(r).resolve()))}</code>" for r in roots)
    )
    figures = {
        "rounds": lambda: fig_rounds(groups),
        "privacy-utility": lambda: fig_privacy_utility(groups),
        "clients": lambda: fig_client_accuracy(groups),
        "assignments": lambda: fig_assignments(groups),
        "assignment-rounds": lambda: fig_assignment_rounds(groups),
        "epsilon": lambda: fig_client_epsilon(groups),
        "audit": lambda: fig_audits(audits, roots),
    }
    body = [f"<h1>{html.escape(title)}</h1>", f'<p class="meta">{meta}</p>']
    nav = ['<a href="#summary">Summary</a>'] + [
        f'<a href="#{sid}">{html.escape(t)}</a>' for sid, t, _ in SECTIONS
    ]
    body.append("<nav>" + "".join(nav) + "</nav>")
    body.append('<section id="summary"><h2>Summary</h2>')
    body.append(
        '<p class="what">Final round, mean ± std over seeds (std: <code>np.std</code>, as '
        "compare.md). Accuracy in % of a client's test samples, averaged over clients; worst "
        "client: the lowest; ARI: clusters recovered (1 = every client in its true cluster); "
        "eps spent: the largest per-client eps at the run's delta; under distributed DP, "
        f"A ({AMPLIFIED_LABEL}) / B ({UNAMPLIFIED_LABEL}): A is accounted for the noise cohort "
        "Poisson-sampled from the population and holds only where who took part is hidden from "
        "the server, B is the same noise with every secure sum composed.</p>"
    )
    body.append(_table(header, rows))
    body.append(_runs_list(groups, roots))
    body.extend(_selection_notes(roots))
    body.append("</section>")
    for sid, heading, what in SECTIONS:
        body.append(f'<section id="{sid}"><h2>{html.escape(heading)}</h2>')
        try:
            uri = figures[sid]()
        except Omitted as why:
            body.append(f'<p class="note">Not drawn: {html.escape(str(why))}.</p>')
        else:
            body.append(f'<p class="what">{html.escape(what)}</p>')
            body.append(_figure_html(sid, uri, heading))
        body.append("</section>")
    return PAGE.format(title=html.escape(title), style=STYLE, body="\n".join(body))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f'<table id="summary-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _selection_notes(roots: Sequence[Path]) -> list[str]:
    """A sweep's note on what choosing its best trial costs in privacy (selection.json)."""
    notes = []
    for root in roots:
        path = Path(root) / "selection.json"
        note = json.loads(path.read_text()).get("note") if path.is_file() else None
        if note:
            notes.append(f'<p class="note" id="selection-privacy">{html.escape(note)}.</p>')
    return notes


def _runs_list(groups: Sequence[Group], roots: Sequence[Path]) -> str:
    items = []
    for g in groups:
        paths = ", ".join(
            f"<code>{html.escape(_relative(r.path, roots))}</code> (seed {r.seed})" for r in g.runs
        )
        items.append(f"<li><b>{html.escape(g.label)}</b>: {paths}</li>")
    return f"<details><summary>Runs in each group</summary><ul>{''.join(items)}</ul></details>"


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
{body}
</body>
</html>
"""


# ------------------------------------------------------------------------------- the command


def output_path(read: Sequence[str | Path], out: str | None, overwrite: bool) -> Path:
    """Where the page goes: ``--out``, else ``DIR-report.html`` beside the one DIR read (several:
    ``report.html`` here). Refused (ConfigError) inside a directory being read, or existing
    without ``--overwrite``: a report never writes into what it reads, nor over a file unasked."""
    dirs = [Path(d) for d in read]
    if out is None:
        first = dirs[0].resolve()
        beside = first.with_name(first.name + "-report.html")
        path = beside if len(dirs) == 1 else Path("report.html")
    else:
        path = Path(out)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"--out: an .html file, got {str(path)!r}")
    return check_out(path, dirs, overwrite)


def check_out(path: Path, read: Sequence[str | Path], overwrite: bool) -> Path:
    """``path`` may be written by a report reading ``read``: not inside a directory read, not a
    directory, not an existing file without ``overwrite``, in a directory that exists."""
    where = path.resolve()
    for d in map(Path, read):
        if d.resolve() == where or d.resolve() in where.parents:
            raise ConfigError(
                f"--out {str(path)!r} is inside {str(d)!r}, a directory the report reads: "
                "raysim report never writes into the runs it reads; give --out a path outside it"
            )
    if path.is_dir():
        raise ConfigError(f"--out {str(path)!r} is a directory: give the file to write")
    if path.exists() and not overwrite:
        raise ConfigError(
            f"{str(path)!r} exists: pass --overwrite to replace it, or --out another file"
        )
    if not where.parent.is_dir():
        raise ConfigError(f"--out: directory {str(path.parent)!r} does not exist")
    return path


def write_report(run_dirs: Sequence[Path], roots: Sequence[Path], out: Path) -> Path:
    """Write the page to ``out`` (whole or not at all: a partial file, then renamed)."""
    text = render(run_dirs, roots)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(out)
    return out
