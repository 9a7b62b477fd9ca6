"""`raysim audit CONFIG`: the configured mode's release path audited with canaries."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from raysim.config import ConfigError

DEFAULT_RUNS = 20_000
ONE_RUN_CANARIES = 500  # --runs 1 without --canaries (capped at what the model's dimension fits)


def check_out(out: Path, overwrite: bool) -> None:
    """Refused before the audit runs: an --out in a system directory, one that is a file, holds
    other files, or holds an audit without --overwrite."""
    from raysim.state.rundir import check_place

    check_place(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / "audit.json").is_file():
        raise ConfigError(f"--out {str(out)!r} holds other files, not an audit's: choose another")
    if not overwrite:
        raise ConfigError(
            f"--out {str(out)!r} already holds an audit: pass --overwrite to replace it, or "
            "choose another --out"
        )


def cmd_audit(args: argparse.Namespace) -> int:
    from raysim.audit import ADVERSARY, PARTICIPATION
    from raysim.cli.common import config_from_args
    from raysim.compose import prepare_named
    from raysim.config import dump_config
    from raysim.state.rundir import out_flag

    if args.adversary not in ADVERSARY:
        raise ConfigError(f"--adversary: one of {', '.join(ADVERSARY)}, got {args.adversary!r}")
    if args.runs is None:
        args.runs = 1 if args.adversary == "black-box" else DEFAULT_RUNS
    if args.runs < 1:
        raise ConfigError(f"--runs: a whole number >= 1, got {args.runs}")
    if args.canaries is not None and args.canaries < 1:
        raise ConfigError(f"--canaries: a whole number >= 1, got {args.canaries}")
    if args.participation not in PARTICIPATION:
        raise ConfigError(f"--participation: one of {', '.join(PARTICIPATION)}")
    if not 0.5 <= args.confidence < 1:
        raise ConfigError(f"--confidence: in [0.5, 1), got {args.confidence}")
    if args.seed < 0:
        raise ConfigError(f"--seed: a whole number >= 0, got {args.seed}")
    if args.config is None:
        raise ConfigError("raysim audit needs a CONFIG (e.g. configs/audit_digits.yaml)")
    cfg = config_from_args(args)
    if args.adversary == "black-box":
        from raysim.audit.blackbox import check_request

        check_request(cfg.privacy.mode, args.runs, args.participation)
    out = (
        Path(args.out)
        if out_flag(args.out)
        else Path("runs") / f"audit-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    check_out(out, args.overwrite)
    if args.adversary == "black-box":
        return _black_box(args, cfg, out)
    prep = prepare_named(cfg)
    canaries = args.canaries
    if canaries is None:
        dim = int(prep.env.init_weights.numel())
        limit = dim // 2 if cfg.privacy.mode == "dprivacy" else dim
        canaries = min(ONE_RUN_CANARIES, limit) if args.runs == 1 else 1
    from tqdm import tqdm

    from raysim.audit.report import write_audit
    from raysim.audit.run import audit

    total = 1 if args.runs == 1 else args.runs
    with tqdm(total=total, desc=f"audit {cfg.privacy.mode}", unit="run") as bar:
        result, rows = audit(
            prep, canaries, args.runs, args.seed, args.participation, args.confidence, bar.update
        )
    write_audit(out, result, rows, dump_config(prep.recorded_config()))
    print(result.line())
    if result.claim_note:
        print(f"claim: {result.claim_note}")
    print(f"results: {out}", file=sys.stderr)
    return 0


def _black_box(args: argparse.Namespace, cfg: Any, out: Path) -> int:
    """Real trainings of the configured experiment with canaries, scored from the final models
    (raysim.audit.blackbox): one with many canaries (--runs 1), or --runs with one each."""
    from tqdm import tqdm

    from raysim.audit.blackbox import blackbox_audit
    from raysim.audit.report import write_audit
    from raysim.compose import prepare_named
    from raysim.config import dump_config

    total, unit = (cfg.rounds, "round") if args.runs == 1 else (args.runs, "run")
    with tqdm(total=total, desc=f"audit {cfg.privacy.mode} (black-box)", unit=unit) as bar:
        result, rows, prep = blackbox_audit(
            cfg, prepare_named, args.canaries, args.seed, args.confidence, bar.update, args.runs
        )
    # the multi-run audit draws each run's seeds from --seed: the config as given, not the last
    recorded = prep.recorded_config() if args.runs == 1 else cfg
    write_audit(out, result, rows, dump_config(recorded))
    print(result.line())
    print(f"claim: {result.claim_note}")
    print(f"results: {out}", file=sys.stderr)
    return 0


def add_audit_parser(sub: argparse._SubParsersAction) -> None:
    from raysim.audit import PARTICIPATION

    p = sub.add_parser("audit", help="empirical lower bound on eps with canaries (docs/audit.md)")
    p.add_argument("config", nargs="?", help="experiment YAML")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key")
    p.add_argument(
        "--runs",
        type=int,
        help=f"releases (default {DEFAULT_RUNS}, black-box 1; 1: the one-run audit of "
        "Steinke et al.)",
    )
    p.add_argument(
        "--canaries",
        type=int,
        help="canaries per release, or canary clients (one run only; default 1 / 500)",
    )
    p.add_argument(
        "--participation",
        default="hidden",
        help=f"{' or '.join(PARTICIPATION)}: whether the adversary is told who took part",
    )
    p.add_argument(
        "--adversary",
        default="white-box",
        help="white-box (what the mode admits to the server; default) or black-box (the final "
        "models of real trainings, one with many canaries or --runs with one each: input-space "
        "canaries for sample and none, canary clients for client and distributed, canary "
        "clients releasing one of a pair for dprivacy)",
    )
    p.add_argument("--confidence", type=float, default=0.95, help="one-sided (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="the audit's seed")
    p.add_argument("--out", help="result directory (default: runs/audit-NAME-TIME)")
    p.add_argument("--overwrite", action="store_true", help="replace the audit in --out")
    p.set_defaults(func=cmd_audit)
