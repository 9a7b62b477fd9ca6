"""Reconstruction quality: MSE, PSNR and SSIM of images in [0, 1].

SSIM follows Wang et al. (2004) as scikit-image computes it with ``gaussian_weights=True``:
an 11x11 Gaussian window with sigma 1.5, K1 = 0.01, K2 = 0.03, population (not sample)
covariances, the map averaged over the pixels whose window lies inside the image.
scikit-image is used when installed; otherwise the small torch version below (scikit-image is
not a dependency of the project and is only needed for this one function). Both agree to float
precision on the cropped interior, which the tests check against a scipy implementation.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

WINDOW = 11
SIGMA = 1.5
K1, K2 = 0.01, 0.03


def mse(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))


def psnr(x: np.ndarray, y: np.ndarray, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB; ``inf`` for identical images."""
    err = mse(x, y)
    return math.inf if err == 0 else 10.0 * math.log10(data_range**2 / err)


def _gaussian_window(size: int = WINDOW, sigma: float = SIGMA) -> torch.Tensor:
    r = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(r**2) / (2 * sigma**2))
    g /= g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim_torch(x: np.ndarray, y: np.ndarray, data_range: float = 1.0) -> float:
    """Mean SSIM of two 2-D images (valid convolution, i.e. the cropped interior)."""
    a = torch.as_tensor(np.asarray(x, np.float64))[None, None]
    b = torch.as_tensor(np.asarray(y, np.float64))[None, None]
    w = _gaussian_window()
    mu_a, mu_b = F.conv2d(a, w), F.conv2d(b, w)
    var_a = F.conv2d(a * a, w) - mu_a**2
    var_b = F.conv2d(b * b, w) - mu_b**2
    cov = F.conv2d(a * b, w) - mu_a * mu_b
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return float((num / den).mean())


def ssim(x: np.ndarray, y: np.ndarray, data_range: float = 1.0) -> float:
    """Mean SSIM of two images of shape (H, W) or (1, H, W)."""
    a, b = np.squeeze(np.asarray(x, np.float64)), np.squeeze(np.asarray(y, np.float64))
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"ssim takes two equal 2-D images, got {a.shape} and {b.shape}")
    try:
        from skimage.metrics import structural_similarity
    except ImportError:
        return ssim_torch(a, b, data_range)
    return float(
        structural_similarity(
            a,
            b,
            data_range=data_range,
            gaussian_weights=True,
            sigma=SIGMA,
            use_sample_covariance=False,
        )
    )
