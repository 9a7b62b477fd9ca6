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
# (and, in sample mode, the clients' seed fixed: their DP-SGD noise is otherwise drawn from the
# OS, run to run)
BLACK_BOX_TRAIN = ["rounds=5", "training.local_epochs=5", "training.lr=0.5"]
BLACK_BOX_ROWS: list[tuple[str, list[str], tuple[float, ...]]] = [
    ("sample", ["privacy.mode=sample"], (2.0, 8.0)),
    ("none", ["privacy.mode=none"], (0.0,)),  # no noise: the attack's power, for scale
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


def black_box_table(client_seed: int = 0) -> list[AuditResult]:
    """The black-box rows (``--adversary black-box``, default canaries, audit seed 0)."""
    from raysim.audit.blackbox import blackbox_audit
    from raysim.compose import for_algorithm, prepare_named
    from raysim.config import load_config

    out = []
    for _, sets, budgets in BLACK_BOX_ROWS:
        for eps in budgets:
            extra = [f"privacy.epsilon={eps}"] if eps else []
            if sets != ["privacy.mode=none"]:  # none: the run's seed serves the clients
                extra.append(f"privacy.client_seed={client_seed}")
            cfg = for_algorithm(load_config(CONFIG, [*sets, *BLACK_BOX_TRAIN, *extra]))
            out.append(blackbox_audit(cfg, prepare_named, seed=0)[0])
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
        "| mode | adversary | canaries | claimed eps | audited eps >= (95%) | tightness |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        claim = "∞" if r.claimed_epsilon == float("inf") else f"{r.claimed_epsilon:.3g}"
        tight = "" if r.tightness != r.tightness else f"{r.tightness:.3f}"
        lines.append(
            f"| {r.mode} | {r.adversary} | {r.canaries} | {claim} | {r.lower_bound:.3g} | {tight} |"
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
        # optional: the clients' seeds to measure (the table at the first; the bounds at all)
        seeds = [int(s) for s in sys.argv[2:]] or [0]
        runs = [black_box_table(s) for s in seeds]
        print(black_box_markdown(runs[0]))
        if len(seeds) > 1:
            for i, r in enumerate(runs[0]):
                bounds = ", ".join(f"{run[i].lower_bound:.3g}" for run in runs)
                print(f"{r.mode} claimed {r.claimed_epsilon:.3g}: bounds over seeds: {bounds}")
    else:
        print(markdown(full_table()))
