"""The attack grid: targets x methods x noise levels x images, results in Parquet and a PNG.

Every job is independent and seeded by (seed, image, purpose), so a job's result does not depend
on which process runs it or in what order: the dummy start is the same for every nu and method
(only the defence differs) and the Laplace draw of an image is one stream scaled by nu.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from raysim.attacks.dlg import client_gradient, run_attack, sanitize_gradient
from raysim.attacks.metrics import mse, psnr, ssim
from raysim.attacks.models import build_target
from raysim.data.sources import locate_idx, read_idx
from raysim.seeding import numpy_rng, torch_generator

UNDEFENDED = 0.0  # nu = 0: the gradient is released as is (the paper's "nu = 0")


def load_test_images(indices: Sequence[int], root: str | None = None) -> tuple[np.ndarray, ...]:
    """Fashion-MNIST test images as float32 (N, 1, 28, 28) in [0, 1], and their labels."""
    files = locate_idx("fmnist", root)
    images = read_idx(files["t10k-images"])
    labels = read_idx(files["t10k-labels"])
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= len(images)):
        raise ValueError(f"image indices must lie in [0, {len(images)}), got {list(indices)}")
    x = (images[idx].astype(np.float32) / 255.0)[:, None]
    return x, labels[idx].astype(np.int64)


@dataclass(frozen=True)
class Job:
    target: str
    method: str
    nu: float
    index: int  # test-set index of the image
    label: int
    image: np.ndarray  # (1, 28, 28) in [0, 1]
    seed: int
    max_steps: int


def run_job(job: Job) -> dict[str, Any]:
    """One attack on one image; returns a result row (with the reconstruction).

    oneDNN (mkldnn) is off for the attack: on one 28x28 image the double-backward convolutions
    ran 2x faster without it here (LeNet: 5.4 vs 10.6 ms per L-BFGS evaluation, 1 thread).
    """
    was = torch.backends.mkldnn.enabled  # (the flags() context manager warns about TF32)
    torch.backends.mkldnn.enabled = False
    try:
        return _run_job(job)
    finally:
        torch.backends.mkldnn.enabled = was


def _run_job(job: Job) -> dict[str, Any]:
    torch.set_num_threads(1)  # jobs run side by side; one thread each is also reproducible
    model = build_target(job.target, job.seed, job.image.shape)
    x = torch.from_numpy(job.image)[None]
    grads = client_gradient(model, x, job.label)
    noise_ratio = 0.0
    if job.nu > 0:
        rng = numpy_rng(job.seed, 0, job.index, "attack/dprivacy_noise")
        grads, noise_ratio = sanitize_gradient(grads, job.nu, rng)
    gen = torch_generator(job.seed, 0, job.index, "attack/dummy")
    res = run_attack(model, grads, job.image.shape, job.method, gen, job.max_steps)
    err = mse(res.reconstruction, job.image)
    var = float(np.var(job.image.astype(np.float64)))  # the MSE of a flat image at the mean
    return {
        "target": job.target,
        "method": job.method,
        "nu": job.nu,
        "image": job.index,
        "label": job.label,
        "label_pred": res.label,
        "label_correct": res.label == job.label,
        "mse": err,
        "psnr": psnr(res.reconstruction, job.image),
        "ssim": ssim(res.reconstruction, job.image),
        "pixel_var": var,
        "worse_than_grey": err > var,
        "match_loss": res.loss,
        "steps": res.steps,
        "seconds": res.seconds,
        "noise_ratio": noise_ratio,
        "num_params": sum(p.numel() for p in model.parameters()),
        "seed": job.seed,
        "reconstruction": res.reconstruction,
    }


def make_jobs(
    targets: Iterable[str],
    methods: Iterable[str],
    nus: Iterable[float],
    images: np.ndarray,
    labels: np.ndarray,
    indices: Sequence[int],
    seed: int,
    max_steps: int,
) -> list[Job]:
    return [
        Job(t, m, float(nu), int(i), int(y), x, seed, max_steps)
        for t in targets
        for m in methods
        for nu in nus
        for i, x, y in zip(indices, images, labels, strict=True)
    ]


def run_grid(
    jobs: Sequence[Job], workers: int = 1, on_done: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Run every job (in ``workers`` processes if > 1); rows in job order, ``on_done`` per row."""
    if workers <= 1:
        results = map(run_job, jobs)
        pool = None
    else:
        pool = ProcessPoolExecutor(max_workers=min(workers, os.cpu_count() or 1))
        results = pool.map(run_job, jobs, chunksize=1)
    rows = []
    try:
        for row in results:
            rows.append(row)
            if on_done is not None:
                on_done(row)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return rows


def results_frame(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The rows without reconstructions (those go in the PNG), one per attack."""
    return pd.DataFrame([{k: v for k, v in r.items() if k != "reconstruction"} for r in rows])


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (target, method, nu): medians and extremes of MSE and SSIM, label accuracy."""
    g = df.groupby(["target", "method", "nu"], sort=True)
    return g.agg(
        images=("image", "size"),
        mse_median=("mse", "median"),
        mse_max=("mse", "max"),
        ssim_median=("ssim", "median"),
        ssim_min=("ssim", "min"),
        ssim_max=("ssim", "max"),
        label_acc=("label_correct", "mean"),
        worse_than_grey=("worse_than_grey", "sum"),
        seconds_median=("seconds", "median"),
    ).reset_index()


def plot_grid(rows: Sequence[dict[str, Any]], originals: dict[int, np.ndarray], path: Path) -> None:
    """Fig.-5-style grid: one column per image, the original on top, then one row per nu."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nus = sorted({r["nu"] for r in rows})
    cols = sorted({r["image"] for r in rows})
    by = {(r["nu"], r["image"]): r for r in rows}
    fig, axes = plt.subplots(
        len(nus) + 1, len(cols), figsize=(1.1 * len(cols), 1.15 * (len(nus) + 1)), squeeze=False
    )
    for j, idx in enumerate(cols):
        axes[0, j].imshow(originals[idx][0], cmap="gray", vmin=0, vmax=1)
        for i, nu in enumerate(nus, start=1):
            r = by.get((nu, idx))
            if r is not None:
                axes[i, j].imshow(r["reconstruction"][0], cmap="gray", vmin=0, vmax=1)
                axes[i, j].set_title(f"{r['ssim']:.2f}", fontsize=6, pad=1)
    labels = ["original"] + ["no defence" if nu == 0 else f"ν={nu:g}" for nu in nus]
    for i, lab in enumerate(labels):
        axes[i, 0].set_ylabel(lab, fontsize=7)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    r0 = rows[0]
    fig.suptitle(f"{r0['method'].upper()} vs {r0['target']} (titles: SSIM)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: Sequence[dict[str, Any]], jobs: Sequence[Job], out: Path) -> pd.DataFrame:
    """results.parquet, summary.csv, reconstructions.npz (row order of the Parquet file) and
    one grid PNG per (target, method); returns the frame."""
    out.mkdir(parents=True, exist_ok=True)
    df = results_frame(rows)
    df.to_parquet(out / "results.parquet", index=False)
    np.savez_compressed(
        out / "reconstructions.npz",
        reconstructions=np.stack([r["reconstruction"] for r in rows]),
        originals=np.stack([j.image for j in jobs]),
    )
    summary(df).to_csv(out / "summary.csv", index=False)
    originals = {j.index: j.image for j in jobs}
    for (t, m), _ in df.groupby(["target", "method"]):
        sel = [r for r in rows if r["target"] == t and r["method"] == m]
        plot_grid(sel, originals, out / f"grid_{t}_{m}.png")
    return df


__all__ = [
    "Job",
    "UNDEFENDED",
    "load_test_images",
    "make_jobs",
    "plot_grid",
    "results_frame",
    "run_grid",
    "run_job",
    "summary",
    "write_outputs",
]
