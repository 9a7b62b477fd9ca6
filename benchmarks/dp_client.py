"""Where a W-DP client's time goes: one client's local epoch of DP-SGD against SGD, in process.

A worker trains W's clients one at a time through ``LocalTrainer.train_many``, one torch thread
each. This builds that trainer (the Table-2 CNN, W's clients of 60 Fashion-MNIST images, batch
16, one epoch; DP-SGD at z = 1, C = 1), times plain SGD and DP-SGD on the same clients,
alternating, and then splits each one's time by operator (torch.profiler, self time per client):
the forward and backward convolutions, the per-sample weight gradients (the convolutions with
the batch folded into the groups), pooling and ReLU, the noise, the norms and sums of clipping,
and the rest. Machines differ by several times: compare only the ratio and the shares. The
process is set up as a worker is (``raysim.runtime.worker``: the torch and BLAS threads, and
glibc's malloc keeping what a step frees); ``--malloc-defaults`` keeps glibc's defaults instead,
under which a step faults in again the buffers the one before freed.

    python benchmarks/dp_client.py [--clients 40] [--reps 5] [--threads 1] [--malloc-defaults]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.profiler import profile

from raysim.config import load_config
from raysim.data import build_federated_dataset
from raysim.models import build_model, flat_params
from raysim.runtime.worker import fixed_threads, keep_freed_memory
from raysim.training import LocalTrainer, TrainConfig

CONFIG = "configs/bench_w.yaml"


def category(name: str, shapes: list) -> str:
    """The part of a step an operator belongs to (by name, and for convolutions by shape: a
    per-sample weight gradient folds the batch into the channels, [1, B*C, H, W])."""
    first = shapes[0] if shapes else []
    folded = len(first) == 4 and first[0] == 1
    if name == "aten::convolution_backward":
        return "per-sample weight gradients (grouped conv)" if folded else "conv backward"
    if name in ("aten::mkldnn_convolution", "aten::convolution", "aten::_convolution"):
        return "conv forward"
    if "max_pool" in name or name in ("aten::relu_", "aten::threshold_backward"):
        return "pooling and ReLU"
    if name in ("aten::normal_", "aten::normal"):
        return "noise"
    if name in ("aten::linalg_vector_norm", "aten::mm", "aten::mv", "aten::bmm", "aten::addmm"):
        return "norms, matmuls (clipping, linear layer)"
    if name == "aten::copy_":
        return "copies"
    return "other operators"


def per_client(trainer: LocalTrainer, w, clients, cfg: TrainConfig, seed: int) -> float:
    """Seconds per client for one pass over ``clients``."""
    start = time.perf_counter()
    for i, (x, y) in enumerate(clients):
        gen = torch.Generator().manual_seed(seed + i)
        trainer.train_many([w], [(x, y)], [cfg], [gen])
    return (time.perf_counter() - start) / len(clients)


def breakdown(trainer: LocalTrainer, w, clients, cfg: TrainConfig) -> Counter:
    """Self CPU milliseconds per client, by category."""
    with profile(record_shapes=True) as prof:
        per_client(trainer, w, clients, cfg, 10_000)
    out: Counter = Counter()
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith("aten::"):
            out[category(e.key, e.input_shapes)] += e.self_cpu_time_total / 1e3 / len(clients)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker's: 1)")
    p.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="keep glibc's malloc defaults (a worker keeps the memory a step frees)",
    )
    args = p.parse_args()
    fixed_threads(args.threads)
    kept = not args.malloc_defaults and keep_freed_memory()
    cfg = load_config(CONFIG, [])
    ds = build_federated_dataset(cfg.data, cfg.seed)
    model = build_model("cnn", ds.feature_shape, ds.num_classes, seed=0)
    trainer = LocalTrainer(model, ds.task)
    w = flat_params(model).clone()
    clients = [ds.client_train(c) for c in range(args.clients)]
    t = cfg.training
    plain = TrainConfig(lr=t.lr, batch_size=t.batch_size, local_epochs=t.local_epochs)
    dp = TrainConfig(
        lr=t.lr,
        batch_size=t.batch_size,
        local_epochs=t.local_epochs,
        dp_noise_multiplier=1.0,
        dp_clip=1.0,
    )
    runs = {"sgd": plain, "dp-sgd": dp}
    for c in runs.values():  # warm-up: oneDNN's kernels, the allocator's pools
        for _ in range(2):
            per_client(trainer, w, clients, c, 0)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(args.reps):  # alternating: a busy spell hits both alike
        for k, c in runs.items():
            times[k].append(per_client(trainer, w, clients, c, 1000 * rep))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    malloc = "a worker's malloc settings" if kept else "glibc's malloc defaults"
    print(
        f"{args.clients} W clients, {args.threads} torch thread(s), {malloc}, "
        f"median of {args.reps} passes"
    )
    for k in runs:
        print(
            f"{k:7s} {med[k]:6.2f} ms/client (passes {min(times[k]) * 1e3:.2f}-"
            f"{max(times[k]) * 1e3:.2f})"
        )
    print(f"dp/sgd client ratio: {med['dp-sgd'] / med['sgd']:.2f}")
    parts = {k: breakdown(trainer, w, clients, c) for k, c in runs.items()}
    names = sorted(set(parts["sgd"]) | set(parts["dp-sgd"]), key=lambda n: -parts["dp-sgd"][n])
    print(f"\n{'self time by operator, ms/client (profiled)':45s} {'sgd':>7s} {'dp-sgd':>7s}")
    for n in names:
        print(f"{n:45s} {parts['sgd'][n]:7.2f} {parts['dp-sgd'][n]:7.2f}")
    total = {k: sum(v.values()) for k, v in parts.items()}
    print(f"{'total':45s} {total['sgd']:7.2f} {total['dp-sgd']:7.2f}")


if __name__ == "__main__":
    main()
