#!/usr/bin/env bash
# End-to-end check of the Ray cluster launcher on ONE machine (root, Linux, about 1-2 minutes):
# inside private network/PID/mount namespaces (unshare) it starts sshd on 127.0.0.1 and
# 127.0.0.2, runs `ray up` of cluster-onprem.yaml (head 127.0.0.1, one worker 127.0.0.2),
# `ray job submit` of a short `raysim run` whose two workers need both nodes, then `ray down`.
#
#   apt-get install -y openssh-server rsync      # once
#   sudo scripts/e2e_cluster.sh                  # exit 0: the flow works; logs in $E2E_DIR
#
# Nothing leaks out: `ray stop`/`ray down` only see the namespace's processes, /root is a
# private overlay, /tmp/ray a private bind mount, and the namespace's processes die with the
# script.
# It uses the repository's .venv (VENV=... to change); setup_commands are emptied because the
# "nodes" share this machine's installation.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$REPO/.venv}
if [[ -z "${RAYSIM_E2E_INSIDE:-}" ]]; then
  [[ $(id -u) == 0 ]] || { echo "e2e_cluster.sh: needs root (unshare, sshd)" >&2; exit 2; }
  for tool in /usr/sbin/sshd rsync unshare; do
    command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y openssh-server rsync" >&2; exit 2; }
  done
  E2E_DIR=${E2E_DIR:-$(mktemp -d /tmp/raysim-e2e.XXXXXX)}
  echo "e2e: logs and state in $E2E_DIR" >&2
  exec env RAYSIM_E2E_INSIDE=1 E2E_DIR="$E2E_DIR" VENV="$VENV" \
    timeout "${E2E_TIMEOUT_S:-600}" unshare --net --pid --fork --mount-proc --propagation private \
    bash "${BASH_SOURCE[0]}" "$@"
fi

W=$E2E_DIR
step() { echo "== $(date +%T) $*" >&2; }
ip link set lo up

step "private home and Ray temp dir"
mkdir -p "$W/home" "$W/work" "$W/raytmp" /tmp/ray
# HOME of root (from /etc/passwd) gets ssh keys, ray's bootstrap files and the file mounts: an
# overlay keeps them out of the real /root while the venv's interpreter (often under
# /root/.pyenv) stays visible.
mount -t overlay overlay -o "lowerdir=/root,upperdir=$W/home,workdir=$W/work" /root
mkdir -p /root/.ssh
mount --bind "$W/raytmp" /tmp/ray     # this machine's other Ray sessions stay untouched
ssh-keygen -q -t ed25519 -N '' -f "$W/key"
ssh-keygen -q -t ed25519 -N '' -f "$W/hostkey"
cp "$W/key.pub" /root/.ssh/authorized_keys
rm -f /root/.ray/auth_token
chmod 700 /root/.ssh && chmod 600 /root/.ssh/authorized_keys
cat > /root/.bashrc <<RC
export PATH="$VENV/bin:\$PATH"
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 RAY_UP_enable_autoscaler_v2=0
RC
echo '. ~/.bashrc' > /root/.profile
. /root/.bashrc

step "sshd on 127.0.0.1 and 127.0.0.2"
mkdir -p /run/sshd
cat > "$W/sshd_config" <<CFG
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey $W/hostkey
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile $W/sshd.pid
CFG
/usr/sbin/sshd -f "$W/sshd_config" -E "$W/sshd.log"

step "cluster config from cluster-onprem.yaml"
python - "$REPO/cluster-onprem.yaml" "$W/cluster.yaml" "$W/key" <<'PY'
import sys, yaml
src, dst, key = sys.argv[1:]
c = yaml.safe_load(open(src))
c["cluster_name"] = "raysim-e2e"
c["provider"].update(head_ip="127.0.0.1", worker_ips=["127.0.0.2"])
c["auth"] = {"ssh_user": "root", "ssh_private_key": key}
c["min_workers"] = c["max_workers"] = 1
c["setup_commands"] = []  # the nodes share this machine's venv
# One machine: both nodes share /tmp/ray, so no `ray stop` when the worker starts (it would
# stop the head too), and every node says which address it is. One CPU each: the run's two
# workers (1 CPU each) must use both nodes.
c["head_start_ray_commands"] = [
    "ray stop",
    "ray start --head --port=6379 --autoscaling-config=~/ray_bootstrap_config.yaml"
    " --dashboard-host=127.0.0.1 --node-ip-address=127.0.0.1 --num-cpus=1",
]
c["worker_start_ray_commands"] = [
    "ray start --address=$RAY_HEAD_IP:6379 --node-ip-address=127.0.0.2 --num-cpus=1"
]
yaml.safe_dump(c, open(dst, "w"), sort_keys=False)
PY
cd "$REPO"
status=1
cleanup() {
  step "ray down"
  ray down -y "$W/cluster.yaml" >"$W/down.log" 2>&1 || echo "ray down failed: $W/down.log" >&2
  rm -f /tmp/cluster-raysim-e2e.state /tmp/cluster-raysim-e2e.lock
  step "result: $([[ $status == 0 ]] && echo PASS || echo FAIL) (exit $status)"
}
trap cleanup EXIT

step "ray up"
ray up -y --no-config-cache "$W/cluster.yaml" >"$W/up.log" 2>&1 || { tail -30 "$W/up.log"; exit 1; }

step "waiting for 2 alive nodes"
for _ in $(seq 60); do
  n=$(python -c "import ray; ray.init('127.0.0.1:6379', log_to_driver=False); \
print(sum(x['Alive'] for x in ray.nodes()))" 2>/dev/null || echo 0)
  [[ $n == 2 ]] && break
  sleep 2
done
[[ $n == 2 ]] || { echo "only $n node(s) came up; see $W/up.log and /tmp/ray on the nodes" >&2; exit 1; }

step "ray job submit: raysim run on both nodes"
ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
  raysim run --out "$W/job-run" --set algorithm.name=fedavg --set rounds=2 --set data.dataset=digits \
  --set data.num_clients=8 --set data.cluster_sizes=[4,4] --set model.name=mlp \
  --set privacy.mode=none --set runtime.address=auto --set runtime.num_workers=2 \
  --set runtime.cpus_per_worker=1 --set runtime.progress=false \
  --set runtime.round_timeout_s=120 >"$W/job.log" 2>&1 || { tail -40 "$W/job.log"; exit 1; }
tail -5 "$W/job.log"
python - "$W/job-run/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["rounds"] == 2 and s["workers"] == 2, s
print(f"job ok: {s['rounds']} rounds, {s['workers']} workers, accuracy {s['final_accuracy']:.3f}")
PY
ray exec "$W/cluster.yaml" 'ray status' >"$W/exec.log" 2>&1 && grep -E "node_|Active" "$W/exec.log" | head -5 || true
status=0
