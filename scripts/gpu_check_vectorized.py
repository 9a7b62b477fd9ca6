"""The vectorized trainer on CUDA against the same trainer on CPU, in-process (no Ray).

Same inputs (a group of Table-2 CNN clients on 28x28 images, different data sizes), plain SGD
and DP-SGD. Across devices the trainer is compared in float64, where the two must agree to
rounding (1e-10). In float32 they need not: the CNN's max-pool routes a gradient to the larger
of two activations, and where two are within float32 rounding of each other (a near-tie; a
group of 32 clients x 60 images has ~9M pooling windows) each device's rounding picks its own,
so that client's step differs (measured: one client of 32, on the CPU as much as on CUDA, whose
float64 runs agree to 1e-17). So each device's float32 run is compared with float64 per client,
and a device fails when more than one client in eight strays beyond the tolerance (imprecise
kernels, TF32, would move every client; a near-tie moves one). On each device the vectorized
trainer must agree with the per-client one (LocalTrainer) in float32.

DP on CUDA draws its noise from a per-client CUDA generator seeded from the client's CPU
generator (as LocalTrainer does), so CUDA and CPU noise differ by design: across devices DP is
compared at z = 0 on full batches (clipping, averaging); Poisson DP-SGD with noise is compared
with LocalTrainer/Opacus on the same CUDA device (same masks, same noise); and the noise scale
on CUDA is checked against z*C/b.

    python scripts/gpu_check_vectorized.py [--group 32] [--samples 60] [--tol 1e-4]

Exit codes: 0 agree, 1 mismatch, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysim.models import build_model, flat_params  # noqa: E402
from raysim.training import LocalTrainer, TrainConfig, float32_kernels  # noqa: E402
from raysim.training.vectorized import VectorizedTrainer  # noqa: E402


def inputs(group: int, samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    data = []
    for i in range(group):
        n = samples - (i % 4) * 3  # different sizes: padding and different step counts
        x = rng.normal(size=(n, 1, 28, 28)).astype(np.float32)
        data.append((x, rng.integers(0, 10, n).astype(np.int64)))
    init = flat_params(build_model("cnn", (1, 28, 28), 10, seed=0))
    return data, [init.clone() for _ in range(group)]


GRADIENT_BACKENDS = {
    "as the workers run (float32_kernels)": None,
    # cudnn.flags() allows TF32 unless told not to (its allow_tf32 defaults to True)
    "cuDNN (default algorithms)": {"enabled": True, "allow_tf32": False},
    "cuDNN deterministic": {"enabled": True, "deterministic": True, "allow_tf32": False},
    "cuDNN off (native kernels)": {"enabled": False, "allow_tf32": False},
    "cuDNN, TF32 allowed": {"enabled": True, "allow_tf32": True},
}


def gradient(client, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """The full-batch cross-entropy gradient of the seed-0 CNN on one client's data, per
    parameter (conv weights come from cuDNN, the dense layer's from cuBLAS)."""
    x, y = client
    model = build_model("cnn", (1, 28, 28), 10, seed=0).to(device, dtype)
    logits = model(torch.from_numpy(x).to(device, dtype))
    torch.nn.functional.cross_entropy(logits, torch.from_numpy(y).to(device)).backward()
    return {k: p.grad.to("cpu", torch.float64) for k, p in model.named_parameters()}


def gens(group: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1000 + i) for i in range(group)]


def timed(fn, device: str):
    fn()  # warm-up (kernels, allocator)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def vectorized(device: str, dtype: torch.dtype, data, weights, cfg: TrainConfig, seed: int):
    """The group's updates (stacked, on the CPU) from the vectorized trainer, and its timing."""
    vec = VectorizedTrainer(build_model("cnn", (1, 28, 28), 10), "classification", device, dtype)
    g = len(data)
    out, t = timed(lambda: vec.train_group(weights, data, [cfg] * g, gens(g, seed)), device)
    return torch.stack([r.update for r in out]).cpu(), t


def per_client(device: str, data, weights, cfg: TrainConfig, seed: int):
    """The same from LocalTrainer, one client at a time (float32)."""
    ref = LocalTrainer(build_model("cnn", (1, 28, 28), 10), "classification", device)
    out, t = timed(
        lambda: [
            ref.train(w, x, y, cfg, gen)
            for w, (x, y), gen in zip(weights, data, gens(len(data), seed), strict=True)
        ],
        device,
    )
    return torch.stack([r.update for r in out]).cpu(), t


def rounding(name: str, single: torch.Tensor, double: torch.Tensor, tol: float) -> bool:
    """float32 against float64, per client: a near-tie in a max-pool moves one client, an
    imprecise kernel moves all (module docstring)."""
    per = (single.double() - double).abs().amax(1)
    strays = (per > tol).nonzero().flatten().tolist()
    good = len(strays) <= len(per) // 8
    print(
        f"{name:44s} per client max abs diff: median {float(per.median()):.2e}, "
        f"max {float(per.max()):.2e}; beyond tolerance: clients {strays or 'none'} "
        f"{'ok' if good else 'MISMATCH'}"
    )
    return good


def report(name: str, a: torch.Tensor, b: torch.Tensor, tol: float, timing: str) -> bool:
    diff = float((a - b).abs().max())
    good = diff <= tol
    print(
        f"{name:44s} max abs diff {diff:.2e} (max |update| {float(a.abs().max()):.2e}) "
        f"{'ok' if good else 'MISMATCH'}; {timing}"
    )
    return good


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--tol", type=float, default=1e-4, help="max abs difference of updates")
    p.add_argument("--tol64", type=float, default=1e-10, help="the same in float64")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: dry run
    p.add_argument("--no-cudnn", action="store_true", help="native CUDA kernels throughout")
    args = p.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    torch.backends.cudnn.enabled = not args.no_cudnn
    torch.set_num_threads(1)  # the workers' setting: the CPU bits do not depend on threads
    float32_kernels()  # the workers' setting (raysim.runtime.worker.pick_device): TF32 off
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    print(f"device: {name} (torch {torch.__version__}); group {args.group}, ~{args.samples} each")
    data, weights = inputs(args.group, args.samples)
    ok = True
    print(
        "TF32 allowed: matmul",
        torch.backends.cuda.matmul.allow_tf32,
        "cuDNN",
        torch.backends.cudnn.allow_tf32,
        "| fp32 precision:",
        getattr(torch.backends, "fp32_precision", "-"),
        "| cuDNN enabled",
        torch.backends.cudnn.enabled,
        "(matmul",
        getattr(torch.backends.cuda.matmul, "fp32_precision", "-"),
        "conv",
        getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", "-"),
        ") | cuDNN",
        torch.backends.cudnn.version() if dev == "cuda" else "-",
    )
    # One forward pass on both devices: ~1e-7 relative is float32, ~1e-3 would be TF32.
    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    x = torch.from_numpy(data[0][0])
    with torch.no_grad():
        on_cpu = model(x)
        on_dev = model.to(dev)(x.to(dev)).cpu()
    rel = float((on_cpu - on_dev).abs().max() / on_cpu.abs().max())
    print(f"one forward pass, cpu vs {dev}: max relative difference {rel:.1e}")
    # One gradient against float64 on the CPU, under each convolution back end: which one (if
    # any) strays from float32 accuracy (~1e-6); TF32 did, by 3e-2, on an H200.
    reference = gradient(data[0], torch.float64, "cpu")

    def errors(grad: dict[str, torch.Tensor]) -> str:
        return ", ".join(
            f"{k} {float((grad[k] - r).abs().max() / r.abs().max()):.1e}"
            for k, r in reference.items()
        )

    for label, settings in GRADIENT_BACKENDS.items():
        with nullcontext() if settings is None else torch.backends.cudnn.flags(**settings):
            grad = gradient(data[0], torch.float32, dev)
        print(f"one gradient on {dev}, {label}: max relative difference {errors(grad)}")
    # The same in float64 on the device: ~1e-15 says the kernels' arithmetic is right and only
    # their float32 precision (TF32, Winograd/FFT algorithms) is in question.
    grad = gradient(data[0], torch.float64, dev)
    print(f"one gradient on {dev} in float64: max relative difference {errors(grad)}")
    # CPU and device draw the same batches here (plain SGD permutations, full-batch DP): in
    # float64 the vectorized results must agree across devices (module docstring).
    cross = {
        "plain SGD, one step": TrainConfig(lr=0.05, batch_size=64),
        "plain SGD": TrainConfig(lr=0.05, batch_size=16),
        "plain SGD, momentum 0.9, 2 epochs": TrainConfig(
            lr=0.05, batch_size=16, momentum=0.9, local_epochs=2
        ),
        "DP-SGD full batch, z=0 (clipping)": TrainConfig(
            lr=0.05, batch_size=1, full_batch=True, dp_noise_multiplier=0.0, dp_clip=1.0
        ),
    }
    for label, cfg in cross.items():
        exact = {d: vectorized(d, torch.float64, data, weights, cfg, 1)[0] for d in ("cpu", dev)}
        ok &= report(f"{label}: float64 cpu vs {dev}", exact["cpu"], exact[dev], args.tol64, "")
        for d in ("cpu", dev):
            single, t_vec = vectorized(d, torch.float32, data, weights, cfg, 1)
            ref, t_ref = per_client(d, data, weights, cfg, 1)
            timing = f"vectorized {t_vec:.3f} s, per-client {t_ref:.3f} s"
            ok &= report(f"{label}: {d} vectorized vs per-client", single, ref, args.tol, timing)
            ok &= rounding(f"{label}: {d} float32 vs float64", single, exact["cpu"], args.tol)
    # Poisson DP-SGD with noise: on a GPU the noise comes from a device generator seeded from
    # the client's CPU generator (LocalTrainer's scheme), so compare with LocalTrainer on the
    # same device: same masks, same noise.
    dp = TrainConfig(lr=0.05, batch_size=16, dp_noise_multiplier=1.0, dp_clip=1.0)
    gpu, t_gpu = vectorized(dev, torch.float32, data, weights, dp, 3)
    gpu_ref, t_gpu_ref = per_client(dev, data, weights, dp, 3)
    timing = f"vectorized {dev} {t_gpu:.3f} s, per-client (Opacus) {dev} {t_gpu_ref:.3f} s"
    ok &= report(f"DP-SGD Poisson z=1: {dev} vs Opacus", gpu, gpu_ref, args.tol, timing)
    # Groups of one (algorithms with their own client step) take the layer rules
    # (training.layer_grads) for their per-sample gradients: against Opacus on the device.
    vec = VectorizedTrainer(build_model("cnn", (1, 28, 28), 10), "classification", dev)
    ref = LocalTrainer(build_model("cnn", (1, 28, 28), 10), "classification", dev)
    ref.vectorize = False
    few = range(min(4, len(data)))
    ones, t_one = timed(
        lambda: [vec.train_group([weights[i]], [data[i]], [dp], gens(1, 10 + i))[0] for i in few],
        dev,
    )
    refs, t_ref = timed(
        lambda: [ref.train(weights[i], *data[i], dp, gens(1, 10 + i)[0]) for i in few], dev
    )
    timing = f"layer rules {dev} {t_one:.3f} s, Opacus {dev} {t_ref:.3f} s ({len(few)} clients)"
    ok &= report(
        f"DP-SGD Poisson z=1, groups of one ({'layer rules' if vec._layer_grads else 'vmap'})",
        torch.stack([r.update for r in ones]),
        torch.stack([r.update for r in refs]),
        args.tol,
        timing,
    )
    # Noise scale on the device: one full-batch step, lr 1: update(z) - update(0) ~ N(0, s^2)
    z, c = 2.0, 0.5
    full = TrainConfig(lr=1.0, batch_size=1, full_batch=True, dp_noise_multiplier=z, dp_clip=c)
    quiet = TrainConfig(lr=1.0, batch_size=1, full_batch=True, dp_noise_multiplier=0.0, dp_clip=c)
    vec = VectorizedTrainer(build_model("cnn", (1, 28, 28), 10), "classification", dev)
    g = len(data)
    noisy = vec.train_group(weights, data, [full] * g, gens(g, 2))
    clean = vec.train_group(weights, data, [quiet] * g, gens(g, 2))
    ratios = [
        float((a.update - b.update).std()) / (z * c / len(x))
        for (x, _), a, b in zip(data, noisy, clean, strict=True)
    ]
    good = max(abs(r - 1) for r in ratios) < 0.05
    ok &= good
    print(
        f"DP noise std on {dev} / (zC/b): {min(ratios):.3f}..{max(ratios):.3f} "
        f"{'ok' if good else 'MISMATCH'}"
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
