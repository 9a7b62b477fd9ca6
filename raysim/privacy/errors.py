"""Errors raised by the privacy library.

Both derive from ``ValueError`` so that callers validating a configuration can catch one type.
"""


class PrivacyConfigError(ValueError):
    """A privacy parameter is invalid or inconsistent (e.g. delta >= 1/n, epsilon <= 0)."""


class BudgetError(ValueError):
    """A privacy budget cannot be met, or a charge would exceed it.

    Raised instead of silently continuing, so a run never spends more than its budget.
    """
