"""The real cluster-launcher flow (scripts/e2e_cluster.sh): `ray up` of cluster-onprem.yaml on
127.0.0.1 + 127.0.0.2 inside private namespaces, `ray job submit`, `ray down`. About 1.5 minutes
and needs root, sshd and rsync: opt in with RAYSIM_E2E=1 (and `-m slow`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "e2e_cluster.sh"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RAYSIM_E2E") != "1", reason="set RAYSIM_E2E=1 to run")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (unshare, sshd)")
@pytest.mark.skipif(
    not shutil.which("rsync") or not Path("/usr/sbin/sshd").exists(),
    reason="apt-get install -y openssh-server rsync",
)
def test_ray_up_job_submit_ray_down(tmp_path):
    env = {**os.environ, "E2E_DIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=660
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "job ok: 2 rounds, 2 workers" in proc.stdout + proc.stderr
