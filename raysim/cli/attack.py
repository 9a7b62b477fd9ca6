"""`raysim attack dlg`: run the DLG/iDLG grid and write results.parquet, summary.csv, PNGs."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from raysim.config import ConfigError

DEFAULT_NUS = "0,1e-3,1e-2,0.1,1,3,10"


def _nus(text: str) -> list[float]:
    try:
        nus = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"--nu: expected comma-separated numbers >= 0, got {text!r}") from exc
    if not nus or not all(math.isfinite(v) and v >= 0 for v in nus):
        raise ConfigError(
            f"--nu: expected comma-separated numbers >= 0 (0: no defence), got {text!r}"
        )
    return _once("--nu", nus)


def _once(flag: str, items: list) -> list:
    """``items``, refused where one is given twice (its rows would count it twice)."""
    twice = sorted({v for v in items if items.count(v) > 1}, key=str)
    if twice:
        raise ConfigError(f"{flag}: {', '.join(map(str, twice))} given twice")
    return items


def _images(text: str) -> list[int]:
    """'0-9' or '0,3,7' (test-set indices)."""
    try:
        if "-" in text:
            lo, hi = (int(v) for v in text.split("-", 1))
            out = list(range(lo, hi + 1))
        else:
            out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"--images: expected 'A-B' or 'i,j,k', got {text!r}") from exc
    if "-" in text and not out:
        raise ConfigError(f"--images: the range {text!r} ends before it starts")
    if not out or min(out) < 0 or max(out) >= 10000:
        raise ConfigError(f"--images: indices must lie in [0, 10000), got {text!r}")
    return _once("--images", out)


def _choices(flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if not items or bad:
        raise ConfigError(f"{flag}: unknown {bad or text!r}; allowed: {', '.join(allowed)}")
    return _once(flag, items)


def cmd_attack_dlg(args: argparse.Namespace) -> int:
    from raysim.attacks.dlg import METHODS
    from raysim.attacks.harness import load_test_images, make_jobs, run_grid, summary, write_outputs
    from raysim.attacks.models import TARGETS
    from raysim.data.sources import DataNotFoundError

    targets = _choices("--targets", args.targets, TARGETS)
    methods = _choices("--methods", args.methods, METHODS)
    nus, indices = _nus(args.nu), _images(args.images)
    if args.max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    root = None if args.data_root is None else Path(args.data_root).expanduser()
    if root is not None and not root.is_dir():  # none is made
        why = "is not a directory" if root.exists() else "does not exist"
        raise ConfigError(f"--data-root {args.data_root!r} {why}")
    from raysim.state.rundir import out_flag

    out = (
        Path(args.out)
        if out_flag(args.out)
        else Path("runs") / f"attack-dlg-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    check_out(out, args.overwrite)
    try:
        images, labels = load_test_images(indices, args.data_root)
    except DataNotFoundError as exc:  # its hint names the config key; here it is a flag
        raise ConfigError(str(exc).replace("data.root=DIR", "--data-root DIR")) from exc
    jobs = make_jobs(targets, methods, nus, images, labels, indices, args.seed, args.max_steps)

    def progress(row: dict) -> None:
        print(
            f"{row['target']} {row['method']} nu={row['nu']:g} image {row['image']}: "
            f"MSE {row['mse']:.2e} SSIM {row['ssim']:.3f} label {row['label_pred']}/"
            f"{row['label']} ({row['steps']} steps, {row['seconds']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    rows = run_grid(jobs, args.workers, progress)
    df = write_outputs(rows, jobs, out)
    print(summary(df).to_string(index=False))
    print(f"results: {out}")
    return 0


def check_out(out: Path, overwrite: bool) -> None:
    """Refused before the grid runs: an --out in a system directory, that is a file, holds
    anything but an attack's results, or holds an attack's results without --overwrite."""
    from raysim.state.rundir import check_place

    check_place(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / "results.parquet").is_file():
        raise ConfigError(f"--out {str(out)!r} holds other files, not an attack's: choose another")
    if not overwrite:
        raise ConfigError(
            f"--out {str(out)!r} already holds an attack's results: pass --overwrite to replace "
            "them, or choose another --out"
        )


def add_attack_parser(sub: argparse._SubParsersAction) -> None:
    attack = sub.add_parser("attack", help="gradient-inversion attacks on one client's gradient")
    asub = attack.add_subparsers(dest="attack_command", metavar="{dlg}", required=True)
    dlg = asub.add_parser("dlg", help="DLG / iDLG on Fashion-MNIST test images, per noise level")
    dlg.add_argument("--targets", default="lenet", help="comma-separated: lenet, cnn")
    dlg.add_argument("--methods", default="idlg,dlg", help="comma-separated: dlg, idlg")
    dlg.add_argument("--nu", default=DEFAULT_NUS, help="d-privacy noise multipliers; 0 = none")
    dlg.add_argument("--images", default="0-9", help="test-set indices: 'A-B' or 'i,j,k'")
    dlg.add_argument("--seed", type=int, default=0)
    dlg.add_argument("--max-steps", type=int, default=300, help="L-BFGS steps (20 evals each)")
    dlg.add_argument("--workers", type=int, default=1, help="processes (one thread each)")
    dlg.add_argument("--data-root", help="directory with the Fashion-MNIST IDX files")
    dlg.add_argument("--out", help="result directory (default: runs/attack-dlg-TIME)")
    dlg.add_argument("--overwrite", action="store_true", help="replace the results in --out")
    dlg.set_defaults(func=cmd_attack_dlg)
