"""Client updates per second: raysim's engine against a plain single-process PyTorch loop.

Both do the same client computations (the Table-2 CNN on 28x28 inputs: Fashion-MNIST where it
is installed, else synthetic images of that shape; local (DP-)SGD from the round's model) on
the same machine, in the same run. The loop runs with one torch thread and with one per core
(the faster counts); the engine gets one single-threaded worker actor per core. Usage:

    python benchmarks/engine_vs_loop.py [--clients 1000] [--rounds 2] [--dp] [--workers N]

The last line is `engine/loop speed ratio: <number>` (> 1: the engine is faster).
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from algorithms import Environment, get_algorithm  # noqa: E402
from raysim.config import load_config  # noqa: E402
from raysim.data.sources import SEARCH_DIRS, find_idx_files  # noqa: E402
from raysim.experiment import prepare  # noqa: E402
from raysim.models import build_model  # noqa: E402
from raysim.runtime.coordinator import Coordinator  # noqa: E402
from raysim.seeding import torch_generator  # noqa: E402
from raysim.training import LocalTrainer  # noqa: E402


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def data_root(clients: int, samples: int) -> tuple[str, str | None]:
    """Fashion-MNIST where installed; else random 28x28 images in IDX files of the same shape
    (the benchmark measures arithmetic, not accuracy)."""
    if any(find_idx_files(d, "fmnist") for d in SEARCH_DIRS["fmnist"]):
        return "fmnist", None
    root = Path(tempfile.mkdtemp(prefix="raysim-bench-"))
    rng = np.random.default_rng(0)
    n = clients * samples
    for part, count in (("train", n), ("t10k", 10)):
        write_idx(root / f"{part}-images-idx3-ubyte", rng.integers(0, 256, (count, 28, 28)))
        write_idx(root / f"{part}-labels-idx1-ubyte", rng.integers(0, 10, count))
    return "synthetic 28x28", str(root)


def config(args: argparse.Namespace):
    name, root = data_root(args.clients, args.samples)
    sets = [
        "data.dataset=fmnist",
        f"data.samples_per_client={args.samples}",
        f"data.num_clients={args.clients}",
        "data.cluster_sizes=null",
        "data.shift=none",
        "model.name=cnn",
        "algorithm.name=fedavg",
        f"privacy.mode={'sample' if args.dp else 'none'}",
        "privacy.delta=1e-3",
        "training.batch_size=32",
        f"training.local_epochs={args.epochs}",
        f"rounds={args.rounds + 100}",  # no final evaluation inside the timed rounds
        "training.eval_every=100000",
        f"runtime.num_workers={args.workers}",
        "runtime.round_timeout_s=3000",
    ]
    if root is not None:
        sets.append(f"data.root={root}")
    return name, load_config(None, sets)


def plain_loop(prep, rounds: int, threads: int) -> float:
    """The reference: one process, the same per-client computation."""
    cfg, ds, algo = prep.cfg, prep.dataset, prep.algorithm
    torch.set_num_threads(threads)
    trainer = LocalTrainer(build_model("cnn", ds.feature_shape, ds.num_classes), ds.task)
    model = prep.env.init_weights.clone()
    x, y = ds.client_train(0)  # warm-up (Opacus wrapping, allocator), as the engine gets one
    trainer.train(model, x, y, algo.train_config(0), torch_generator(cfg.seed, 0, 0, "train"))
    start = time.perf_counter()
    for r in range(1, rounds + 1):
        updates, weights = [], []
        for c in range(ds.num_clients):
            x, y = ds.client_train(c)
            res = trainer.train(
                model, x, y, algo.train_config(c), torch_generator(cfg.seed, r, c, "train")
            )
            updates.append(res.update)
            weights.append(res.num_samples)
        w = torch.tensor(np.asarray(weights) / np.sum(weights), dtype=torch.float32)
        model = model + (torch.stack(updates) * w[:, None]).sum(0)
    return time.perf_counter() - start


def engine(prep, rounds: int) -> float:
    cfg = prep.cfg
    ray.init(
        address="local",
        num_cpus=cfg.runtime.num_workers,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        coord = (
            ray.remote(Coordinator)
            .options(num_cpus=0)
            .remote(cfg, prep.algorithm, [ray.put(prep.dataset)], prep.truth, 0.0)
        )
        ray.get(coord.info.remote(), timeout=600)
        ray.get(coord.step.remote(), timeout=3000)  # warm-up: actors, Opacus wrapping, caches
        start = time.perf_counter()
        for _ in range(rounds):
            ray.get(coord.step.remote(), timeout=3000)
        return time.perf_counter() - start
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dp", action="store_true", help="DP-SGD (Opacus) on the clients")
    p.add_argument("--loop-threads", type=int, nargs="*", help="torch threads of the loop(s)")
    args = p.parse_args()
    name, cfg = config(args)
    prep = prepare(cfg, get_algorithm("fedavg"), Environment)
    updates = args.clients * args.rounds
    print(
        f"data: {name}, clients: {args.clients}, rounds: {args.rounds}, dp: {args.dp}, "
        f"cores: {os.cpu_count()}, workers: {args.workers}"
    )
    # The loop with every core as torch threads and with one thread: on a busy machine extra
    # threads can slow small convolutions down; the faster of the two is the reference.
    threads = args.loop_threads or sorted({1, os.cpu_count() or 1})
    loops = {t: plain_loop(prep, args.rounds, t) for t in threads}
    for t, sec in loops.items():
        print(f"plain loop, {t} thread(s): {updates / sec:.1f} client updates/s ({sec:.1f} s)")
    loop_s = min(loops.values())
    engine_s = engine(prep, args.rounds)
    print(f"engine:     {updates / engine_s:.1f} client updates/s ({engine_s:.1f} s)")
    print(f"engine/loop speed ratio: {loop_s / engine_s:.2f}")


if __name__ == "__main__":
    main()
