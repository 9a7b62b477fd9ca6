"""Errors raised by the privacy library, and the checks of a request that need no accountant.

Both errors derive from ``ValueError`` so that callers validating a configuration can catch one
type. The checks live here, not beside the calibration, so that checking a request does not load
the accountant (with scipy, in the start-up's serial part of every sample-level DP run).
"""


class PrivacyConfigError(ValueError):
    """A privacy parameter is invalid or inconsistent (e.g. delta >= 1/n, epsilon <= 0)."""


class BudgetError(ValueError):
    """A privacy budget cannot be met, or a charge would exceed it.

    Raised instead of silently continuing, so a run never spends more than its budget.
    """


def check_sample_level_delta(delta: float, smallest_client_dataset: int) -> None:
    """Refuse a sample-level delta >= 1/n: it would allow leaking a whole record of some client."""
    if smallest_client_dataset < 1:
        raise PrivacyConfigError(
            f"smallest client dataset must have >= 1 sample, got {smallest_client_dataset}"
        )
    bound = 1.0 / smallest_client_dataset
    if not 0 < delta < bound:
        raise PrivacyConfigError(
            f"privacy.delta={delta:g} must be in (0, 1/n) = (0, {bound:.3g}) where n="
            f"{smallest_client_dataset} is the smallest client dataset; lower privacy.delta"
        )
