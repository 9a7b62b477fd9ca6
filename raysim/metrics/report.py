"""The comparison table printed by `raysim run` and `raysim report`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from raysim.metrics.results import load_run

COLUMNS = (
    ("algorithm", "algorithm", "{}"),
    ("rounds", "rounds", "{}"),
    ("eps", "epsilon", "{:.2f}"),
    ("acc", "accuracy", "{:.3f}"),
    ("majority", "accuracy_majority", "{:.3f}"),
    ("minority", "accuracy_minority", "{:.3f}"),
    ("min acc", "accuracy_min", "{:.3f}"),
    ("ARI", "ari", "{:.2f}"),
    ("M", "num_clusters", "{}"),
    ("MSS", "gmm_mss", "{:.1f}"),
    ("E_c", "switch_round", "{}"),
    ("wall s", "wall_seconds", "{:.0f}"),
)


def _cell(fmt: str, value: object) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def comparison_table(run_dirs: Sequence[Path]) -> str:
    rows = []
    for d in run_dirs:
        summary, _ = load_run(Path(d))
        values = {**summary.get("final", {}), **summary}
        label = str(d) + (" (cluster identifiers not private)" if summary.get("warning") else "")
        rows.append([label] + [_cell(fmt, values.get(key)) for _, key, fmt in COLUMNS])
    header = ["run"] + [name for name, _, _ in COLUMNS]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
