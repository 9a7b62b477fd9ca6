"""Gradient-inversion attacks (DLG, iDLG) against one client's gradient, with or without the
d-privacy sanitization of Galli et al. (Algorithm 2): `raysim attack dlg`.

The names below load on first use (PEP 562): the command line builds its parser from
``raysim.cli.attack`` on every `raysim` command, and importing the attacks pulls in torch
(~1.2 s), which `raysim run` must not pay before it has checked its config.
"""

from importlib import import_module
from typing import Any

_LAZY = {
    **dict.fromkeys(
        (
            "METHODS",
            "AttackResult",
            "client_gradient",
            "idlg_label",
            "run_attack",
            "sanitize_gradient",
        ),
        "dlg",
    ),
    **dict.fromkeys(("mse", "psnr", "ssim"), "metrics"),
    **dict.fromkeys(("TARGETS", "DLGLeNet", "build_target"), "models"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
