"""Client updates per second: raysim's engine against a plain single-process PyTorch loop.

Both do the same client computations (the Table-2 CNN on 28x28 inputs: Fashion-MNIST where it
is installed, else synthetic images of that shape; local (DP-)SGD from the round's model) on
the same machine, in the same run. The loop gets every core as torch threads; the engine gets
one single-threaded worker actor per core. Usage:

    python benchmarks/engine_vs_loop.py [--clients 1000] [--rounds 2] [--dp] [--workers N]

The last line is `engine/loop speed ratio: <number>` (> 1: the engine is faster).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from algorithms import Environment, get_algorithm  # noqa: E402
from raysim.config import load_config  # noqa: E402
from raysim.experiment import prepare  # noqa: E402
from raysim.models import build_model  # noqa: E402
from raysim.runtime.coordinator import Coordinator  # noqa: E402
from raysim.seeding import torch_generator  # noqa: E402
from raysim.training import LocalTrainer  # noqa: E402


def dataset_name() -> str:
    try:
        from raysim.data.sources import locate_idx

        locate_idx("fmnist", None)
        return "fmnist"
    except Exception:  # noqa: BLE001 - not installed: fall back to synthetic 28x28 images
        return "synthetic_images"


def config(args: argparse.Namespace):
    name = dataset_name()
    sets = [
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
    if name == "fmnist":
        sets += ["data.dataset=fmnist", f"data.samples_per_client={args.samples}"]
    else:  # same shapes, generated: the benchmark measures arithmetic, not accuracy
        sets += ["data.dataset=mnist", f"data.samples_per_client={args.samples}"]
    return name, load_config(None, sets)


def plain_loop(prep, rounds: int) -> float:
    """The reference: one process, every core, the same per-client computation."""
    cfg, ds, algo = prep.cfg, prep.dataset, prep.algorithm
    torch.set_num_threads(os.cpu_count() or 1)
    trainer = LocalTrainer(build_model("cnn", ds.feature_shape, ds.num_classes), ds.task)
    model = prep.env.init_weights.clone()
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
            .remote(cfg, prep.algorithm, [ray.put(prep.dataset)], prep.env.true_clusters, 0.0)
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
    args = p.parse_args()
    name, cfg = config(args)
    prep = prepare(cfg, get_algorithm("fedavg"), Environment)
    updates = args.clients * args.rounds
    print(
        f"data: {name}, clients: {args.clients}, rounds: {args.rounds}, dp: {args.dp}, "
        f"cores: {os.cpu_count()}, workers: {args.workers}"
    )
    plain_loop(prep, 1) if args.clients <= 50 else None  # warm-up of the loop's own caches
    loop_s = plain_loop(prep, args.rounds)
    engine_s = engine(prep, args.rounds)
    print(f"plain loop: {updates / loop_s:.1f} client updates/s ({loop_s:.1f} s)")
    print(f"engine:     {updates / engine_s:.1f} client updates/s ({engine_s:.1f} s)")
    print(f"engine/loop speed ratio: {loop_s / engine_s:.2f}")


if __name__ == "__main__":
    main()
