"""The docs' table (docs/audit.md): every mode at two budgets, claimed vs audited."""

from __future__ import annotations

from typing import Any

from raysim.audit.run import AuditResult, audit

CONFIG = "configs/audit_digits.yaml"
ROWS: list[tuple[str, list[str], str]] = [
    ("client", [], "hidden"),
    ("distributed", ["privacy.mode=distributed"], "hidden"),
    (
        "distributed q=0.5",
        ["privacy.mode=distributed", "training.sampling_rate=0.5", "privacy.noise_cohort_size=6"],
        "hidden",
    ),
    (
        "distributed q=0.5",
        ["privacy.mode=distributed", "training.sampling_rate=0.5", "privacy.noise_cohort_size=6"],
        "told",
    ),
    ("sample", ["privacy.mode=sample", "privacy.delta=1e-3"], "hidden"),
    ("dprivacy", ["privacy.mode=dprivacy"], "hidden"),
]


# the black-box rows: one real training each, long enough for the canaries to be memorised
# (and, where the clients draw their own noise, the clients' seed fixed: sample mode's DP-SGD
# noise and dprivacy's d-private noise are otherwise drawn from the OS, run to run); then the
# multi-run rows, many trainings of the config's own single round with one canary each
BLACK_BOX_TRAIN = ["rounds=5", "training.local_epochs=5", "training.lr=0.5"]
BLACK_BOX_ROWS: list[tuple[str, list[str], tuple[float, ...], int]] = [
    ("sample", ["privacy.mode=sample", *BLACK_BOX_TRAIN], (2.0, 8.0), 1),
    ("none", ["privacy.mode=none", *BLACK_BOX_TRAIN], (0.0,), 1),  # no noise: for scale
    ("dprivacy", ["privacy.mode=dprivacy", *BLACK_BOX_TRAIN], (2.0, 8.0), 1),
    ("sample", ["privacy.mode=sample"], (2.0,), 200),
    ("client", ["privacy.mode=client"], (2.0, 8.0), 1000),
]


# the canary-client rows (client, distributed): the same training; under distributed the noise
# cohort is the whole population, the config's 12 clients and the 500 canary slots (q = 1), or
# half of it (q = 0.5, the claim amplified by sampling)
CANARY_CLIENT_ROWS: list[tuple[str, list[str], tuple[float, ...]]] = [
    ("client", ["privacy.mode=client"], (2.0, 8.0)),
    (
        "distributed",
        ["privacy.mode=distributed", "privacy.noise_cohort_size=512", "privacy.population=512"],
        (2.0, 8.0),
    ),
    (
        "distributed q=0.5",
        [
            "privacy.mode=distributed",
            "training.sampling_rate=0.5",
            "privacy.noise_cohort_size=256",
            "privacy.population=512",
        ],
        (2.0, 8.0),
    ),
]


def full_table(runs: int = 20_000, budgets: tuple[float, ...] = (2.0, 8.0)) -> list[AuditResult]:
    from raysim.compose import for_algorithm, prepare_named
    from raysim.config import load_config

    out = []
    for _, sets, participation in ROWS:
        for eps in budgets:
            cfg = for_algorithm(load_config(CONFIG, [*sets, f"privacy.epsilon={eps}"]))
            result, _ = audit(prepare_named(cfg), runs=runs, seed=0, participation=participation)
            out.append(result)
    return out


def markdown(results: list[AuditResult]) -> str:
    lines = [
        "| mode | participation | delta | claimed eps | audited eps >= (95%) | tightness |",
        "|---|---|---|---|---|---|",
    ]
    labels = [label for label, _, _ in ROWS for _ in (0, 1)]
    for label, r in zip(labels, results, strict=True):
        row: Any = (label, r.participation, f"{r.delta:g}", f"{r.claimed_epsilon:.3g}")
        lines.append("| " + " | ".join(row) + f" | {r.lower_bound:.3g} | {r.tightness:.2f} |")
    return "\n".join(lines)


def black_box_table(seed: int = 0) -> list[AuditResult]:
    """The black-box rows (``--adversary black-box``, default canaries): the one-run rows at
    audit seed 0 and clients' seed ``seed``, the multi-run rows at audit seed ``seed`` (each
    run's seeds drawn from it)."""
    from raysim.audit.blackbox import blackbox_audit
    from raysim.compose import for_algorithm, prepare_named
    from raysim.config import load_config
    from raysim.privacy.modes import mode_class

    out = []
    for _, sets, budgets, runs in BLACK_BOX_ROWS:
        for eps in budgets:
            extra = [f"privacy.epsilon={eps}"] if eps else []
            cfg = for_algorithm(load_config(CONFIG, [*sets, *extra]))
            if runs == 1 and not mode_class(cfg.privacy.mode).trusted_server:
                cfg = for_algorithm(
                    load_config(CONFIG, [*sets, *extra, f"privacy.client_seed={seed}"])
                )
            audit_seed = 0 if runs == 1 else seed
            out.append(blackbox_audit(cfg, prepare_named, seed=audit_seed, runs=runs)[0])
    return out


def canary_client_table(seed: int = 0) -> list[AuditResult]:
    """The canary-client rows (``--adversary black-box``, 500 canary clients, audit ``seed``;
    the clients' seed 0 under distributed, whose noise it draws)."""
    from raysim.audit.blackbox import blackbox_audit
    from raysim.compose import for_algorithm, prepare_named
    from raysim.config import load_config

    out = []
    for _, sets, budgets in CANARY_CLIENT_ROWS:
        for eps in budgets:
            extra = [f"privacy.epsilon={eps}"]
            if "privacy.mode=distributed" in sets:
                extra.append("privacy.client_seed=0")
            cfg = for_algorithm(load_config(CONFIG, [*sets, *BLACK_BOX_TRAIN, *extra]))
            out.append(blackbox_audit(cfg, prepare_named, seed=seed)[0])
    return out


def canary_client_markdown(results: list[AuditResult]) -> str:
    lines = [
        "| mode | canary clients | claimed eps | audited eps >= (95%) | tightness |",
        "|---|---|---|---|---|",
    ]
    labels = [label for label, _, budgets in CANARY_CLIENT_ROWS for _ in budgets]
    for label, r in zip(labels, results, strict=True):
        lines.append(
            f"| {label} | {r.canaries} | {r.claimed_epsilon:.3g} | {r.lower_bound:.3g} | "
            f"{r.tightness:.2f} |"
        )
    return "\n".join(lines)


def black_box_markdown(results: list[AuditResult]) -> str:
    lines = [
        "| mode | method | canaries | runs | claimed eps | audited eps >= (95%) | tightness |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        claim = "∞" if r.claimed_epsilon == float("inf") else f"{r.claimed_epsilon:.3g}"
        tight = "" if r.tightness != r.tightness else f"{r.tightness:.3f}"
        lines.append(
            f"| {r.mode} | {r.method} | {r.canaries} | {r.runs} | {claim} | "
            f"{r.lower_bound:.3g} | {tight} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--canary-clients"]:
        # optional: the audit's seeds (the table at the first; the bounds at all)
        seeds = [int(s) for s in sys.argv[2:]] or [0]
        runs = [canary_client_table(s) for s in seeds]
        print(canary_client_markdown(runs[0]))
        if len(seeds) > 1:
            labels = [label for label, _, budgets in CANARY_CLIENT_ROWS for _ in budgets]
            for i, (label, r) in enumerate(zip(labels, runs[0], strict=True)):
                bounds = ", ".join(f"{run[i].lower_bound:.3g}" for run in runs)
                print(f"{label} claimed {r.claimed_epsilon:.3g}: bounds over seeds: {bounds}")
    elif sys.argv[1:2] == ["--black-box"]:
        # optional: the seeds to measure (the clients' for the one-run rows, the audit's for
        # the multi-run rows; the table at the first, the bounds at all)
        seeds = [int(s) for s in sys.argv[2:]] or [0]
        runs = [black_box_table(s) for s in seeds]
        print(black_box_markdown(runs[0]))
        if len(seeds) > 1:
            for i, r in enumerate(runs[0]):
                bounds = ", ".join(f"{run[i].lower_bound:.3g}" for run in runs)
                what = f"{r.mode} {r.method} ({r.runs} runs)"
                print(f"{what} claimed {r.claimed_epsilon:.3g}: bounds over seeds: {bounds}")
    else:
        print(markdown(full_table()))
