"""What an algorithm declares to the privacy mode before the run: its DP-SGD schedule and the
releases it plans. Part of the algorithm's side of the contract (with ``raysim.privacy.view``,
what it receives): algorithms import these, never a mode (``raysim.privacy.modes``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raysim.privacy.phase import Phase


@dataclass(frozen=True)
class PrivacyNeeds:
    """What an algorithm's schedule asks the mode to calibrate for."""

    dpsgd_schedule: Callable[[int], Sequence[Phase]]  # a client's DP-SGD phases by train size
    selections: tuple[int, float] = (0, 0.0)  # (count, eps each) of exponential-mechanism choices
    id_noise_ratio: float | None = None  # client mode: sigma_ids / sigma_model (None: no ids)
    # client mode: identifiers released at this noise-to-signal WITHOUT accounting (0: exact);
    # None: no unaccounted release is allowed (``ClientLevel.release_ids_unaccounted`` refuses)
    unaccounted_id_noise: float | None = None
    # distributed mode: how many secure sums the run releases (None: one per round), and the
    # share of epsilon one local Gaussian release per client takes (PINA's sketch; 0: none)
    secure_releases: int | None = None
    local_release_share: float = 0.0
    local_round: int | None = None  # the round clients release it in (no secure sum that round)
    local_dim: int | None = None  # its dimension
    # the setting (``key=value``) by which the server keeps the clients' cluster choices from
    # round to round (None: it never needs them); a mode that hides them refuses it
    server_knows_choices: str | None = None
