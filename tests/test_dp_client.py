"""benchmarks/dp_client.py still runs, and its split by operator still finds the parts of a
DP-SGD step it names (a renamed kernel or a changed fold would leave a row at zero, and the
benchmark would say the per-sample gradients cost nothing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dp_client_times_both_and_splits_the_dp_step() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/dp_client.py", "--clients", "2", "--reps", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "a worker's malloc settings" in out
    ratio = re.search(r"^dp/sgd client ratio: ([0-9.]+)$", out, re.M)
    assert ratio and float(ratio.group(1)) > 0
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(.+?)\s+([0-9.]+)\s+([0-9.]+)$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    sgd, dp = rows["per-sample weight gradients (grouped conv)"]
    assert sgd == 0 and dp > 0
    sgd, dp = rows["noise"]
    assert sgd == 0 and dp > 0
    assert rows["conv forward"][0] > 0 and rows["conv forward"][1] > 0
