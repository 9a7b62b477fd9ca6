"""Noise mechanisms used by the simulated algorithms.

All functions are pure: randomness comes only from the ``numpy.random.Generator`` passed in, so a
run is reproducible from its seeds and the same code serves every algorithm. numpy (not torch) is
used throughout: the mechanisms act on flattened updates, sketches and small score tables, and
callers holding tensors convert with ``tensor.detach().cpu().numpy()``.
"""

from __future__ import annotations

import math

import numpy as np

from raysim.privacy.errors import PrivacyConfigError

__all__ = [
    "clip_l2",
    "d_privacy_epsilon",
    "exponential_select",
    "gaussian_mechanism",
    "geometric_clip_update",
    "laplace_euclidean",
    "onehot_noise_multiplier",
    "SKETCH_DIM",
    "private_sketch",
    "sketch_projection",
    "privatize_onehot",
]

# PINA stage 1: the default sketch dimension k (configurable per call).
SKETCH_DIM = 64

# Input coordinates of the random projection generated at a time: bounds memory for large models
# (k * chunk floats); the projection depends only on the seed, not on this value.
_SKETCH_CHUNK = 1 << 16


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise PrivacyConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise PrivacyConfigError(f"{name} must be >= 0, got {value!r}")


def _float_array(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float64)


def clip_l2(x: np.ndarray, bound: float) -> np.ndarray:
    """Scale ``x`` (each row if 2-D) to L2 norm at most ``bound``; the sensitivity DP needs. A
    vector without a finite norm (training that overflowed on a crafted broadcast) becomes
    zero: clipped, every input must be bounded, or its release would tell the server so."""
    _positive("bound", bound)
    x = _float_array(x)
    if x.ndim == 1:
        norm = float(np.linalg.norm(x))
        if not np.isfinite(norm):
            return np.zeros_like(x)
        return x * min(1.0, bound / norm) if norm > 0 else x.copy()
    if x.ndim == 2:
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        scale = np.minimum(1.0, bound / np.maximum(norms, np.finfo(x.dtype).tiny))
        finite = np.isfinite(norms)
        return np.where(finite, x, 0) * np.where(finite, scale, 0).astype(x.dtype)
    raise ValueError(f"clip_l2 takes a vector or a matrix of rows, got shape {x.shape}")


def gaussian_mechanism(
    total: np.ndarray, sensitivity: float, noise_multiplier: float, rng: np.random.Generator
) -> np.ndarray:
    """Return ``total + N(0, (sensitivity * noise_multiplier)^2 I)``, keeping a float dtype."""
    _positive("sensitivity", sensitivity)
    _non_negative("noise_multiplier", noise_multiplier)
    total = _float_array(total)
    noise = rng.normal(0.0, sensitivity * noise_multiplier, size=total.shape)
    return total + noise.astype(total.dtype)


def geometric_clip_update(clip: float, unclipped: float, quantile: float, lr: float) -> float:
    """Adaptive clipping's step (Andrew et al. 2021, eq. 2): ``clip * exp(-lr * (unclipped -
    quantile))``, ``unclipped`` the (noisy) fraction of updates at most ``clip``: a clip that
    more updates than the quantile fit under shrinks, one fewer fit under grows. Geometric, so
    the clip stays positive whatever the noise."""
    _positive("clip", clip)
    return clip * math.exp(-lr * (unclipped - quantile))


def onehot_noise_multiplier(clip: float, noise_multiplier: float) -> float:
    """Noise std over sensitivity for :func:`privatize_onehot`, the value the accountant needs.

    The clipped one-hot has norm ``min(1, clip)`` and the noise std is ``clip * z``; under the
    add/remove-one-client relation the sensitivity is that norm (sqrt(2) times it under
    replace-one, where this value must be divided by sqrt(2)).
    """
    _positive("clip", clip)
    return clip * noise_multiplier / min(1.0, clip)


def privatize_onehot(
    cluster_ids: np.ndarray,
    num_clusters: int,
    clip: float,
    noise_multiplier: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Noisy cluster identifiers of RR-Cluster (Algorithm 2, lines 8-9).

    Each client's one-hot vector ``s`` is clipped as ``s / max(1, ||s|| / C_s)`` (so its norm is
    ``min(1, C_s)``), every one of its ``num_clusters`` coordinates gets independent
    ``N(0, (C_s * z)^2)`` noise, and only the argmax of the noisy vector is returned (post-
    processing): the clustering and rebalancing that follow see a noisy id, never the true one.
    In RR-Cluster the trusted server applies this to the ids clients send. One int per client.
    """
    if num_clusters < 1:
        raise PrivacyConfigError(f"num_clusters must be >= 1, got {num_clusters}")
    _positive("clip", clip)
    _non_negative("noise_multiplier", noise_multiplier)
    ids = np.asarray(cluster_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= num_clusters):
        raise ValueError(f"cluster ids must lie in [0, {num_clusters}), got {ids}")
    scores = rng.normal(0.0, clip * noise_multiplier, size=(ids.size, num_clusters))
    scores[np.arange(ids.size), ids] += min(1.0, clip)
    return np.argmax(scores, axis=1)


def exponential_select(
    utilities: np.ndarray, epsilon: float, sensitivity: float, rng: np.random.Generator
) -> int | np.ndarray:
    """Exponential mechanism: pick index i with probability proportional to exp(eps*u_i/(2*Δu)).

    Implemented as report-noisy-max with Gumbel noise of scale ``2 * sensitivity / epsilon``,
    which has exactly that distribution and is numerically safe for large utilities. Higher
    utility is better (pass ``-loss`` to prefer low loss). A 2-D input is one row per client and
    gives one index per row.
    """
    _positive("epsilon", epsilon)
    _positive("sensitivity", sensitivity)
    u = np.asarray(utilities, dtype=np.float64)
    if u.ndim not in (1, 2) or u.shape[-1] == 0:
        raise ValueError(f"utilities must be a non-empty vector or matrix, got shape {u.shape}")
    noisy = u + rng.gumbel(0.0, 2.0 * sensitivity / epsilon, size=u.shape)
    choice = np.argmax(noisy, axis=-1)
    return int(choice) if u.ndim == 1 else choice


def d_privacy_epsilon(dim: int, nu: float, radius: float) -> float:
    """Per-unit-distance epsilon of Galli et al. (Alg. 2): ``eps = n / (nu * ||delta||)``.

    With this choice points within the radius ``||delta||`` of the update are
    ``eps * ||delta|| = n / nu`` indistinguishable and the expected noise norm is
    ``nu * ||delta||``. A zero radius gives ``inf`` (no noise): the update reveals nothing beyond
    the model it started from.
    """
    if dim < 1:
        raise PrivacyConfigError(f"dim must be >= 1, got {dim}")
    _positive("nu", nu)
    _non_negative("radius", radius)
    return math.inf if radius == 0 else dim / (nu * radius)


def laplace_euclidean(
    dim: int, epsilon: float, rng: np.random.Generator, size: int | None = None
) -> np.ndarray:
    """Noise of the Laplace mechanism under Euclidean distance in R^n (density ∝ exp(-eps*||x||)).

    Sampled as a norm ~ Gamma(shape=n, scale=1/eps) times a direction uniform on the sphere
    (Galli et al., Prop. 3.1). Shape ``(dim,)`` or ``(size, dim)``; ``eps = inf`` gives zeros.
    """
    if dim < 1:
        raise PrivacyConfigError(f"dim must be >= 1, got {dim}")
    _positive("epsilon", epsilon)
    shape = (dim,) if size is None else (size, dim)
    if math.isinf(epsilon):
        return np.zeros(shape)
    direction = rng.standard_normal(shape)
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    norm = rng.gamma(shape=dim, scale=1.0 / epsilon, size=None if size is None else (size, 1))
    return direction * norm


def _project(update: np.ndarray, k: int, projection_seed: int) -> np.ndarray:
    """Apply the seeded k x d Gaussian projection (entries N(0, 1/k)) to each row of ``update``."""
    proj_rng = np.random.default_rng(projection_seed)
    d = update.shape[-1]
    out = np.zeros(update.shape[:-1] + (k,))
    for start in range(0, d, _SKETCH_CHUNK):
        stop = min(d, start + _SKETCH_CHUNK)
        # column-major draw: the matrix is the same whatever the chunk size
        block = proj_rng.standard_normal((stop - start, k))
        out += update[..., start:stop] @ block
    return out / math.sqrt(k)


def private_sketch(
    update: np.ndarray,
    k: int,
    projection_seed: int,
    clip: float,
    noise_multiplier: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """DP sketch of a model update (PINA stage 1): project, clip to ``clip``, add Gaussian noise.

    The projection is a Johnson-Lindenstrauss map shared by all clients through
    ``projection_seed`` (it is public, so it costs no privacy); clipping after projecting bounds
    the sketch's sensitivity by ``clip`` whatever the projection did to the norm, and the noise is
    ``N(0, (clip * z)^2)`` per coordinate. 2-D input: one sketch per row. PINA's stage 1 uses
    ``k = SKETCH_DIM`` and ``projection_seed = raysim.seeding.public_seed(seed, round,
    "sketch_projection")``, the same for every client of the round.
    """
    if k < 1:
        raise PrivacyConfigError(f"k must be >= 1, got {k}")
    u = np.asarray(update, dtype=np.float64)
    if u.ndim not in (1, 2):
        raise ValueError(f"update must be a vector or a matrix of rows, got shape {u.shape}")
    return gaussian_mechanism(
        sketch_projection(u, k, projection_seed, clip), clip, noise_multiplier, rng
    )


def sketch_projection(update: np.ndarray, k: int, projection_seed: int, clip: float) -> np.ndarray:
    """The sketch before its noise: the seeded projection, clipped to ``clip`` (what a client
    adds to a secure sum, e.g. PINA's DP Lloyd's stage 1, or uses locally)."""
    if k < 1:
        raise PrivacyConfigError(f"k must be >= 1, got {k}")
    u = np.asarray(update, dtype=np.float64)
    if u.ndim not in (1, 2):
        raise ValueError(f"update must be a vector or a matrix of rows, got shape {u.shape}")
    return clip_l2(_project(u, k, projection_seed), clip)
