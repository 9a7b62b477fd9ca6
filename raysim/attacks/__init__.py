"""Gradient-inversion attacks (DLG, iDLG) against one client's gradient, with or without the
d-privacy sanitization of Galli et al. (Algorithm 2): `raysim attack dlg`."""

from raysim.attacks.dlg import (
    METHODS,
    AttackResult,
    client_gradient,
    idlg_label,
    run_attack,
    sanitize_gradient,
)
from raysim.attacks.metrics import mse, psnr, ssim
from raysim.attacks.models import TARGETS, DLGLeNet, build_target

__all__ = [
    "METHODS",
    "TARGETS",
    "AttackResult",
    "DLGLeNet",
    "build_target",
    "client_gradient",
    "idlg_label",
    "mse",
    "psnr",
    "run_attack",
    "sanitize_gradient",
    "ssim",
]
