"""What a user waits for: `raysim run` against a plain single-process PyTorch loop, whole process.

Workload W (configs/bench_w.yaml): 1000 Fashion-MNIST clients x 60 training images, the Table-2
CNN, a cohort of 100 per round (sampling without replacement), 1 local epoch of SGD at batch 16,
lr 0.05, FedAvg, 10 rounds, one evaluation at the end. W-DP (--dp): the same with Opacus-style
DP-SGD, z = 1, C = 1. `--clients 10000`: 10,000 clients x 6 training images, cohort 1%.
`--dp-ratio`: W and W-DP by raysim in the same run, interleaved with W's loop (W-DP's Opacus
loop, ~2x raysim's time, is left out): what DP-SGD costs raysim over SGD on one machine in one
hour, with W's own ratios against the loop beside it.

Both sides run as a child process started from the command line, in the same run, `--reps`
times each (the best rep counts: the machine is shared). Measured per side: whole-process wall,
time from the command to the start of round 1, steady s/round (median of rounds 2..R-1; round R
also evaluates), peak PSS of the whole process tree (driver, Ray's daemons and actors: PSS, not
RSS, which counts torch's shared libraries once per process), and achieved GFLOP/s as a
fraction of the machine's peak (FLOPs of the clients' forward+backward passes counted with
torch.utils.flop_counter; peak from a large matmul at the start and the end of this run, with as
many threads as cores, the higher counting), and the host's steal over the rep (from /proc/stat:
CPU time the hypervisor gave to other guests) and the share other processes on this machine used
(its busy time less the measured tree's and this script's: a job at nice 19 still takes CPU,
docs/speed.md). A rep that the host or other processes took more than 5% from runs again, up to
--retries times: on a shared VM, steal swings from 0 to over 30% within minutes.
Both sides import raysim's sources byte-compiled (the script compiles them first, as Python
does on a user's first run unless PYTHONDONTWRITEBYTECODE is set, as it is on this machine).
The loop is `LocalTrainer` per client (torch.optim SGD; DP-SGD through Opacus), 2 torch threads,
in PyTorch's default memory format (the engine trains convolutions channels-last on CPU).

    python benchmarks/engine_vs_loop.py [--dp | --dp-ratio] [--clients 10000] [--reps 2]
                                        [--workers 2] [--retries 2]

The last two lines: `engine/loop speed ratio: <loop s/round / engine s/round>` and
`engine/loop wall ratio: <loop wall / engine wall>` (> 1: raysim is faster); with `--dp-ratio`
a third, `dp/plain round ratio: <W-DP's steady s/round / W's>`, from the best rep of each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "bench_w.yaml"
# --clients from this many on is population scale: W-1M's per-client setup (--cohort clients a
# round, 5 images each, lazy population); the population sweep's smallest size is scaled too
POPULATION_SCALE = 100_000
SWEEP = (1_000, 10_000, 100_000, 1_000_000)


def workload(args: argparse.Namespace) -> list[str]:
    """--set overrides on configs/bench_w.yaml for the chosen mode."""
    sets = [f"rounds={args.rounds}", f"runtime.num_workers={args.workers}"]
    if args.clients == 10000:
        # 7 images each (6 train / 1 test): all 70,000 Fashion-MNIST images once; cohort 1%
        sets += [
            "data.num_clients=10000",
            "data.samples_per_client=7",
            "training.sampling_rate=0.01",
        ]
    elif args.clients >= POPULATION_SCALE:
        # W-1M and the population sweep: 5 images each (4 train / 1 test), made per client
        # when it is sampled or evaluated; a cohort of --cohort, and as many judged at the end
        sets += [
            f"data.num_clients={args.clients}",
            "data.samples_per_client=5",
            f"training.sampling_rate={args.cohort / args.clients!r}",
            f"training.eval_clients={args.cohort}",
            "runtime.population=lazy",
        ]
    elif args.clients != 1000:
        sets += [f"data.num_clients={args.clients}"]
    if args.dp:
        sets += ["privacy.mode=sample", "privacy.noise_multiplier=1", "privacy.clip=1"]
    return sets + list(args.set or [])


# ----------------------------------------------------------------------------------- measuring
def tree_pids(root: int) -> list[int]:
    """root and all its descendants (Ray's gcs_server and raylet are the driver's children, the
    actors the raylet's)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def _machine_ticks(stat: str) -> list[int]:
    """The first eight columns of /proc/stat's `cpu` line (user nice system idle iowait irq
    softirq steal: CPU ticks of the whole machine since boot); [] where unreadable."""
    try:
        with open(stat) as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(steal, total) CPU ticks of the whole machine since boot; None where /proc/stat has no
    steal column. Steal is the time the hypervisor gave this VM's vCPUs to someone else: on a
    shared host it swings from 0 to over 30% within minutes and slows every process alike."""
    ticks = _machine_ticks(stat)
    if len(ticks) < 8:
        return None
    return ticks[7], sum(ticks)  # user nice system idle iowait irq softirq steal


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time stolen by the host between two cpu_ticks()."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def busy_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot: busy is user, nice, system, irq
    and softirq time (not idle, iowait or steal)."""
    ticks = _machine_ticks(stat)
    if len(ticks) < 7:
        return None
    return ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6], sum(ticks)


def process_ticks(pid: int) -> int | None:
    """CPU ticks (user + system) a live process has used; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    except (OSError, IndexError, ValueError):
        return None


def others_share(
    before: tuple[int, int] | None, after: tuple[int, int] | None, ours: float
) -> float | None:
    """The share of the machine's CPU time used by processes other than ``ours`` (ticks of the
    measured tree and of this script) between two busy_ticks(): another job on the machine.
    Nice does not keep one away (docs/speed.md: autogroup scheduling)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, after[0] - before[0] - ours) / (after[1] - before[1])


def _own_and_reaped_ticks() -> tuple[float, float]:
    """CPU ticks of this process, and of every descendant reaped by it (or by its reaped
    descendants, down the line)."""
    hz = os.sysconf("SC_CLK_TCK")
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime) * hz, (kids.ru_utime + kids.ru_stime) * hz


def run_child(cmd: list[str], poll: list[Path] = ()) -> dict:
    """Run cmd; peak PSS of its tree (sampled every second), wall, the time the first of the
    files `poll` appeared, and the host's steal over the run."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    ticks, busy, (own0, reaped0) = cpu_ticks(), busy_ticks(), _own_and_reaped_ticks()
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak, seen, tick, pids = 0, None, 0, [proc.pid]
    used: dict[int, int] = {}  # the tree's processes: CPU ticks at their last reading
    while proc.poll() is None:
        # every 1 s: the tree and its PSS (one reading of a Ray tree's smaps costs ~40 ms of CPU,
        # 11 processes, that the run would otherwise have; the loop's tree is one process)
        if tick % 20 == 0:
            pids = tree_pids(proc.pid)
            peak = max(peak, pss_bytes(pids))
        # every 0.05 s: the known processes' CPU ticks (one small read each), so that a process
        # that ends between two tree scans, and whose ticks do not reach this script through
        # its parent's wait (Ray's processes), misses at most its last 0.05 s
        for pid in pids:
            used[pid] = max(used.get(pid, 0), process_ticks(pid) or 0)
        if seen is None and any(p.exists() for p in poll):
            seen = time.time()
        tick += 1
        time.sleep(0.05)
    wall = time.time() - t0
    steal = steal_share(ticks, cpu_ticks())
    own, reaped = _own_and_reaped_ticks()
    # the tree's CPU: what its reaped processes used (exact where each was reaped by its
    # parent), or the sum of the readings (which miss a process's last second) where that is more
    tree = max(reaped - reaped0, sum(used.values()))
    others = others_share(busy, busy_ticks(), tree + own - own0)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    return {
        "t0": t0,
        "wall": wall,
        "peak_pss": peak,
        "seen": seen,
        "steal": steal,
        "others": others,
        "stdout": out.decode(),
    }


def byte_compile() -> bool:
    """Byte-compile raysim's and the algorithms' sources into their __pycache__, as Python does
    on a user's first run. Where PYTHONDONTWRITEBYTECODE is set (it is on the development
    machine) nothing writes them, and every process of every run compiles them again: round 1
    ~0.5-0.7 s later (docs/speed.md), a cost no user with Python's defaults pays twice. True if
    they were written (or were already there)."""
    import compileall

    return all([compileall.compile_dir(ROOT / pkg, quiet=1) for pkg in ("raysim", "algorithms")])


def engine_rep(args: argparse.Namespace, tmp: Path, rep: int, tag: str = "engine") -> dict:
    out = tmp / f"{tag}-{rep}"
    # a rep run again (quiet_rep) writes where its contended try did: raysim refuses an --out
    # that holds a run, so the try's directories go first
    for path in (out, out.with_name(out.name + ".incomplete")):
        shutil.rmtree(path, ignore_errors=True)
    sets = [x for s in workload(args) for x in ("--set", s)]
    cmd = [sys.executable, "-m", "raysim.cli.main", "run", str(CONFIG), "--out", str(out), *sets]
    # metrics.parquet appears in the staging directory (OUT.incomplete) as round 1 ends; OUT
    # itself only when the run is over
    res = run_child(cmd, poll=[out.with_name(out.name + ".incomplete") / "metrics.parquet"])
    import pyarrow.parquet as pq

    rounds = pq.read_table(out / "metrics.parquet").column("round_seconds").to_pylist()
    first_end = res["seen"] if res["seen"] is not None else res["t0"] + res["wall"]
    res["first_round"] = first_end - res["t0"] - rounds[0]
    res["rounds"] = rounds
    res["startup"] = json.loads((out / "summary.json").read_text()).get("startup_seconds")
    return res


def loop_rep(args: argparse.Namespace, rep: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--loop-child", *sys.argv[1:]]
    res = run_child(cmd)
    child = json.loads(res["stdout"].strip().splitlines()[-1])
    res["first_round"] = child["first_round_start"] - res["t0"]
    res["rounds"] = child["rounds"]
    return res


def steady(rounds: list[float]) -> float:
    inner = rounds[1:-1] or rounds
    return statistics.median(inner)


def peak_gflops(threads: int) -> float:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(old)
    return 2 * 4096**3 / best / 1e9


def flops_per_round(args: argparse.Namespace) -> float:
    """Forward + backward FLOPs of the cohort's local training (the useful arithmetic; DP's
    per-sample clipping and noise are not counted, so DP shows as lower efficiency)."""
    import torch
    from torch.nn import functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from raysim.models import build_model

    model = build_model("cnn", (1, 28, 28), 10)
    x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(model(x), y).backward()
    per_sample = fc.get_total_flops() / 16
    from raysim.config import load_config
    from raysim.data.partition import num_train_for
    from raysim.privacy.sampling import cohort_size

    cfg = load_config(CONFIG, workload(args))
    n = cfg.data.samples_per_client
    train_per_client = num_train_for(n, cfg.data.train_fraction)
    cohort = cohort_size(cfg.data.num_clients, cfg.training.sampling_rate)
    return per_sample * train_per_client * cohort


CONTENDED = 0.05  # steal (or others' use) above this share makes a rep's times unreliable


def _steal_note(res: dict) -> str:
    note = "" if res["steal"] is None else f", host steal {100 * res['steal']:.0f}%"
    if res.get("others") is not None:
        note += f", other processes {100 * res['others']:.0f}%"
    return note


def contention(res: dict) -> float:
    """The larger of the host's steal and the other processes' share during a rep (0 unread)."""
    return max(res["steal"] or 0.0, res.get("others") or 0.0)


def quiet_rep(side: str, rep: int, args: argparse.Namespace, run: Callable[[], dict]) -> dict:
    """run(), again while the host (steal) or other processes on this machine took more than
    CONTENDED of the CPU during it (at most ``args.retries`` more times): times from a contended
    machine say little about raysim."""
    for _ in range(args.retries):
        res = run()
        if contention(res) <= CONTENDED:
            return res
        note = _steal_note(res)
        print(f"{side:7s} rep {rep}: wall {res['wall']:.1f} s{note}, run again", flush=True)
    return run()  # the last try counts, contended or not (main() warns)


# ------------------------------------------------------------------------------ the plain loop
def loop_child(args: argparse.Namespace) -> None:
    """The reference a user would write: one process, LocalTrainer per client, FedAvg."""
    import numpy as np
    import torch

    torch.set_num_threads(args.loop_threads)
    from raysim.config import load_config
    from raysim.data import build_population
    from raysim.metrics.evaluation import evaluation_cohort
    from raysim.models import build_model, flat_params
    from raysim.privacy.sampling import sample_cohort
    from raysim.seeding import SERVER, numpy_rng, torch_generator
    from raysim.training import LocalTrainer, TrainConfig

    cfg = load_config(CONFIG, workload(args))
    ds = build_population(cfg.data, cfg.seed, cfg.runtime.population)
    model = build_model("cnn", ds.feature_shape, ds.num_classes, seed=0)
    trainer = LocalTrainer(model, ds.task)
    trainer.channels_last = False  # PyTorch's default memory format, as a user's loop has it
    weights = flat_params(model)
    t = cfg.training
    train = TrainConfig(
        lr=t.lr,
        batch_size=t.batch_size,
        local_epochs=t.local_epochs,
        dp_noise_multiplier=1.0 if args.dp else None,
        dp_clip=1.0,
    )
    first, rounds = None, []
    for r in range(1, cfg.rounds + 1):
        start = time.perf_counter()
        if first is None:
            first = time.time()
        cohort = sample_cohort(
            ds.num_clients, t.sampling_rate, t.sampling, numpy_rng(cfg.seed, r, SERVER, "plan")
        )
        updates, sizes = [], []
        for c in cohort:
            x, y = ds.client_train(int(c))
            res = trainer.train(weights, x, y, train, torch_generator(cfg.seed, r, int(c), "train"))
            updates.append(res.update)
            sizes.append(res.num_samples)
        w = torch.tensor(np.asarray(sizes) / np.sum(sizes), dtype=torch.float32)
        weights = weights + (torch.stack(updates) * w[:, None]).sum(0)
        if r == cfg.rounds:  # the engine evaluates at the last round: every client, or a cohort
            judged = evaluation_cohort(cfg, ds.num_clients)
            for c in range(ds.num_clients) if judged is None else judged:
                trainer.evaluate(weights, *ds.client_test(int(c)))
        rounds.append(time.perf_counter() - start)
    print(json.dumps({"first_round_start": first, "rounds": rounds}))


# -------------------------------------------------------------------------------------- main
def population_sweep(args: argparse.Namespace) -> None:
    """Round time and peak PSS against the population at a fixed cohort: flat where nothing
    grows with the clients who are not sampled. Every size runs W-1M's per-client setup."""
    if not byte_compile():
        print("warning: raysim's sources could not be byte-compiled; each process compiles them")
    rows: dict[int, list[dict]] = {n: [] for n in SWEEP}
    with tempfile.TemporaryDirectory(prefix="raysim-sweep-") as tmp:
        for rep in range(args.reps):  # interleaved: a busy spell hits every size alike
            for n in SWEEP:
                sized = argparse.Namespace(**{**vars(args), "clients": max(n, POPULATION_SCALE)})
                sized.set = [*(args.set or []), f"data.num_clients={n}"]
                sized.set += [f"training.sampling_rate={min(1.0, args.cohort / n)!r}"]
                run = partial(engine_rep, sized, Path(tmp), rep)
                rows[n].append(quiet_rep(f"N={n}", rep, args, run))
    print(f"population sweep, cohort {args.cohort}, {args.rounds} rounds, best of {args.reps}:")
    best = {}
    for n, reps in rows.items():
        best[n] = {
            "wall": min(r["wall"] for r in reps),
            "first_round": min(r["first_round"] for r in reps),
            "steady": min(steady(r["rounds"]) for r in reps),
            "peak_pss": min(r["peak_pss"] for r in reps),
        }
        b = best[n]
        print(
            f"  N={n:>9,}: wall {b['wall']:.1f} s, first round at {b['first_round']:.1f} s, "
            f"steady {b['steady']:.2f} s/round, peak PSS {b['peak_pss'] / 2**30:.2f} GiB"
            + "".join(_steal_note(r) for r in reps[-1:])
        )
    large, small = best[SWEEP[-1]], best[10_000]
    print(f"W-1M/W-10K steady ratio: {large['steady'] / small['steady']:.2f}")
    print(f"W-1M/W-10K peak PSS ratio: {large['peak_pss'] / small['peak_pss']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--clients",
        type=int,
        default=1000,
        help="1000 (W), 10000, or from 100000 on population scale (1000000: W-1M)",
    )
    p.add_argument("--cohort", type=int, default=1000, help="population scale: clients a round")
    p.add_argument(
        "--population-sweep",
        action="store_true",
        help="raysim alone at 10^3..10^6 clients, population scale, one run each per rep",
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dp", action="store_true", help="W-DP: DP-SGD at z = 1, C = 1")
    p.add_argument(
        "--dp-ratio",
        action="store_true",
        help="W and W-DP by raysim in one run (and W's loop): prints the dp/plain round ratio",
    )
    p.add_argument("--loop-threads", type=int, default=2)
    p.add_argument("--set", action="append", help="extra config override for raysim (and loop)")
    p.add_argument("--skip-loop", action="store_true", help="engine only (no ratios)")
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="a rep during which the host (steal) or other processes took over 5%% of the CPU "
        "runs again, "
        "up to this many times",
    )
    p.add_argument("--loop-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dp and args.dp_ratio:
        p.error("--dp-ratio runs W and W-DP itself: leave out --dp")
    if args.loop_child:
        loop_child(args)
        return
    if args.population_sweep:
        population_sweep(args)
        return
    if not byte_compile():
        print("warning: raysim's sources could not be byte-compiled; each process compiles them")
    cores = os.cpu_count() or 1
    peak = peak_gflops(cores)
    flops = flops_per_round(args)
    mode = "W and W-DP" if args.dp_ratio else "W-DP" if args.dp else "W"
    print(
        f"workload {mode}, {args.clients} clients, {args.rounds} rounds, workers {args.workers}, "
        f"cores {cores}; matmul peak {peak:.1f} GFLOP/s; {flops / 1e9:.1f} GFLOP per round"
    )
    sides: dict[str, list[dict]] = {"loop": [], "raysim": []}
    dp_args = argparse.Namespace(**{**vars(args), "dp": True})
    if args.dp_ratio:
        sides["raysim-dp"] = []
    with tempfile.TemporaryDirectory(prefix="raysim-bench-") as tmp:
        for rep in range(args.reps):  # interleaved: a busy spell hits both sides alike
            if not args.skip_loop:
                run = partial(loop_rep, args, rep)
                sides["loop"].append(quiet_rep("loop", rep, args, run))
            run = partial(engine_rep, args, Path(tmp), rep)
            sides["raysim"].append(quiet_rep("raysim", rep, args, run))
            if args.dp_ratio:
                run = partial(engine_rep, dp_args, Path(tmp), rep, "engine-dp")
                sides["raysim-dp"].append(quiet_rep("raysim-dp", rep, args, run))
    end_peak = peak_gflops(cores)  # a busy spell at the start would understate the peak
    if end_peak > peak:
        print(f"matmul peak at the end: {end_peak:.1f} GFLOP/s (this one counts)")
        peak = end_peak
    best = {}
    for name, reps in sides.items():
        if not reps:
            continue
        for i, r in enumerate(reps):
            s = steady(r["rounds"])
            gf = flops / s / 1e9
            print(
                f"{name:9s} rep {i}: wall {r['wall']:.1f} s, "
                f"first round at {r['first_round']:.1f} s, steady {s:.2f} s/round "
                f"({gf:.1f} GFLOP/s, {100 * gf / peak:.0f}% of peak), "
                f"peak PSS {r['peak_pss'] / 2**30:.2f} GiB{_steal_note(r)}"
            )
            if r.get("startup"):  # where the time before round 1 went (docs/speed.md)
                steps = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in r["startup"].items())
                print(f"{'':9s}        start-up, s from the command: {steps}")
        best[name] = {
            "wall": min(r["wall"] for r in reps),
            "steady": min(steady(r["rounds"]) for r in reps),
            "first_round": min(r["first_round"] for r in reps),
            "peak_pss": min(r["peak_pss"] for r in reps),
        }
    stolen = [r["steal"] for reps in sides.values() for r in reps if r["steal"] is not None]
    if stolen and max(stolen) > CONTENDED:
        print(
            f"warning: the host took up to {100 * max(stolen):.0f}% of this VM's CPU time during a "
            "rep (steal); times and ratios are not comparable with a quiet machine's, rerun later"
        )
    taken = [r["others"] for reps in sides.values() for r in reps if r.get("others") is not None]
    if taken and max(taken) > CONTENDED:
        print(
            f"warning: other processes used up to {100 * max(taken):.0f}% of the CPU during a rep; "
            "times and ratios are not comparable with a quiet machine's: stop them and rerun"
        )
    print(
        "best of reps:",
        json.dumps({k: {m: round(v, 3) for m, v in d.items()} for k, d in best.items()}),
    )
    if "loop" in best:
        print(f"engine/loop speed ratio: {best['loop']['steady'] / best['raysim']['steady']:.2f}")
        print(f"engine/loop wall ratio: {best['loop']['wall'] / best['raysim']['wall']:.2f}")
    if "raysim-dp" in best:
        ratio = best["raysim-dp"]["steady"] / best["raysim"]["steady"]
        print(f"dp/plain round ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
