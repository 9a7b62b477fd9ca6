"""What a process imports: a client worker of a run without DP never loads the accountant, and
the coordinator's round loop loads neither scipy.stats nor scikit-learn until it uses them."""

from __future__ import annotations

import subprocess
import sys

import raysim.privacy


def test_every_public_privacy_name_resolves() -> None:
    for name in raysim.privacy.__all__:
        assert getattr(raysim.privacy, name) is not None, name


def test_worker_imports_leave_out_the_accountant_and_scipy_stats() -> None:
    """What a client worker imports (the algorithms it unpickles, the worker) and the round
    loop load neither dp_accounting nor scipy.stats: ~1 s and ~50 MiB in every process."""
    code = (
        "import sys, algorithms, raysim.runtime.worker, raysim.rounds; "
        "print(sorted(m for m in ('dp_accounting', 'scipy.stats', 'scipy.signal', 'opacus', "
        "'sklearn') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
