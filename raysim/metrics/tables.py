"""``raysim report --format json|csv|markdown``: the report's summary as data a script or a paper
reads. The groups and the mean ± std over seeds are the HTML page's (raysim.metrics.html_report),
so the numbers agree whichever format is asked for."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from raysim.metrics.html_report import (
    SUMMARY_COLUMNS,
    _final,
    _mean_std,
    group_runs,
    load_runs,
    summary_table,
)
from raysim.privacy.report import EPSILON_LABELS

FORMATS = ("html", "json", "csv", "markdown")


def group_records(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """One record per group of seeds: its algorithm, the keys that tell it from the algorithm's
    other groups, and per final metric its mean, std and the seeds that have it. Values are as
    in summary.json (accuracies as fractions), not rounded."""
    records = []
    for g in group_runs(load_runs(run_dirs)):
        record: dict[str, Any] = {
            "group": g.label,
            "algorithm": g.algorithm,
            **{f"config.{k}": v for k, v in g.varying.items()},
            "seeds": sorted((r.seed for r in g.runs), key=repr),
            "runs": [str(r.path) for r in g.runs],
            "privacy_mode": "/".join(sorted({str(r.summary.get("privacy_mode")) for r in g.runs})),
            "rounds": max(int(r.summary.get("rounds") or 0) for r in g.runs),
        }
        keys = [key for _, key, _, _ in SUMMARY_COLUMNS]
        both = any(r.summary.get("epsilon_unamplified") is not None for r in g.runs)
        for key in keys + ["epsilon_unamplified"] * both:  # distributed: both eps
            values = [_final(r, key) for r in g.runs]
            ms = _mean_std(values)
            record[f"{key}_mean"] = None if ms is None else ms[0]
            record[f"{key}_std"] = None if ms is None else ms[1]
            record[f"{key}_n"] = sum(v is not None for v in values)
        if both:
            record["epsilon_labels"] = dict(EPSILON_LABELS)
        records.append(record)
    return records


def render(run_dirs: Sequence[Path], fmt: str) -> str:
    """The summary in ``fmt`` (json, csv or markdown)."""
    if fmt == "markdown":
        header, rows = summary_table(group_runs(load_runs(run_dirs)))
        cells = lambda r: "| " + " | ".join(c.replace("|", "\\|") for c in r) + " |"  # noqa: E731
        return "\n".join([cells(header), "|" + "---|" * len(header), *map(cells, rows)]) + "\n"
    records = group_records(run_dirs)
    if fmt == "json":
        return json.dumps({"groups": records}, indent=1, default=str) + "\n"
    if fmt == "csv":
        flat = [
            {k: ";".join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()}
            for r in records
        ]
        buf = io.StringIO()
        pd.DataFrame(flat).to_csv(buf, index=False)
        return buf.getvalue()
    raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS[1:])}")
