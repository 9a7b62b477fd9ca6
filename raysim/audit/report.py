"""`raysim audit`'s files: audit.parquet (one row per canary or run), audit.json (the claim, the
bound and how it was reached), audit.png (the in/out score distributions and the threshold), and
the line `raysim report` prints for an audit directory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from raysim.audit.run import AuditResult

AUDIT_JSON = "audit.json"


def write_audit(out: Path, result: AuditResult, rows: dict[str, np.ndarray], config: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from raysim.state.rundir import json_safe

    out.mkdir(parents=True, exist_ok=True)
    kind = "run" if result.method == "multi_run" else "canary"
    table = pd.DataFrame(
        {kind: rows["index"], "included": rows["included"], "score": rows["score"]}
    )
    table.to_parquet(out / "audit.parquet", index=False)
    info = {**result.to_dict(), "line": result.line()}
    (out / AUDIT_JSON).write_text(json.dumps(json_safe(info), indent=2, allow_nan=False) + "\n")
    (out / "config.yaml").write_text(config)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    s, inc = np.asarray(rows["score"]), np.asarray(rows["included"], bool)
    bins = np.linspace(float(s.min()), float(s.max()), 60) if len(s) > 1 else 10
    ax.hist(s[~inc], bins=bins, alpha=0.6, label="without canary", density=True)
    ax.hist(s[inc], bins=bins, alpha=0.6, label="with canary", density=True)
    if result.threshold is not None:
        ax.axvline(result.threshold, color="k", ls="--", label="threshold")
    ax.set_xlabel("score")
    ax.set_title(
        f"{result.mode}: eps >= {result.lower_bound:.2f} (claimed {result.claimed_epsilon:.3g})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "audit.png", dpi=100)
    plt.close(fig)


def audit_line(directory: Path) -> str | None:
    """The one line `raysim report` prints for a directory holding an audit (None: none)."""
    path = Path(directory) / AUDIT_JSON
    if not path.is_file():
        return None
    info: dict[str, Any] = json.loads(path.read_text())
    claimed = info.get("claimed_epsilon")
    tight = info.get("tightness")
    extra = (
        ""
        if tight is None or (isinstance(tight, float) and math.isnan(tight))
        else (f", tightness {tight:.2f}")
    )
    return f"{directory}: {info['line']}{extra}" if claimed is not None or info else None
