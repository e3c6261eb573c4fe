"""Non-negative least squares for the small linear cost models, numpy only.

The models have at most a handful of features (attended pairs, tokens, documents,
a constant), so the exact NNLS solution is found by solving the unconstrained
problem on every subset of features and keeping the best feasible one — 2^4 = 16
tiny solves, no iterative solver to tune.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import numpy as np

MAX_FEATURES = 8
"""Subset enumeration is exponential; more features would need an iterative NNLS."""


def nnls(X: np.ndarray, y: np.ndarray, weights: Optional[np.ndarray] = None) -> np.ndarray:
    """Minimise ``sum(w * (X c - y)^2)`` subject to ``c >= 0``.

    Args:
        X: [n, f] features (f <= MAX_FEATURES).
        y: [n] targets.
        weights: [n] non-negative row weights (default 1).

    Returns:
        [f] non-negative coefficients.
    """
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X must be [n, f] with n = len(y), got {X.shape} and {y.shape}")
    n, f = X.shape
    if f > MAX_FEATURES:
        raise ValueError(f"at most {MAX_FEATURES} features, got {f}")
    if n == 0:
        raise ValueError("no samples to fit")
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != (n,) or (w < 0).any():
        raise ValueError("weights must be [n] and non-negative")
    sw = np.sqrt(w)
    Xw, yw = X * sw[:, None], y * sw
    # Scale columns so the solve is well conditioned (pairs ~1e9, constant ~1).
    scale = np.linalg.norm(Xw, axis=0)
    scale[scale == 0] = 1.0
    Xs = Xw / scale
    best, best_res = np.zeros(f), float(yw @ yw)
    for r in range(1, f + 1):
        for cols in itertools.combinations(range(f), r):
            c, *_ = np.linalg.lstsq(Xs[:, cols], yw, rcond=None)
            if (c < 0).any():
                continue
            res = float(np.sum((Xs[:, cols] @ c - yw) ** 2))
            if res < best_res - 1e-12 * max(best_res, 1.0):
                best_res = res
                best = np.zeros(f)
                best[list(cols)] = c
    return best / scale


def relative_nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """NNLS minimising relative error ``sum(((X c - y) / y)^2)`` (targets > 0): the
    planners care about percentage error, and small micro-batches would otherwise
    be ignored next to large ones."""
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if (y <= 0).any():
        raise ValueError("relative fit needs positive targets")
    return nnls(X, y, weights=1.0 / y ** 2)


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, as a fraction."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    if p.shape != m.shape or p.size == 0:
        raise ValueError("predicted and measured must be non-empty and of equal shape")
    return float(np.mean(np.abs(p - m) / m))


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape != b.shape or a.size < 2:
        raise ValueError("need two equal-length sequences of >= 2 values")

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # average ties
            m = x == v
            if m.sum() > 1:
                r[m] = r[m].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = np.sqrt((ra @ ra) * (rb @ rb))
    return float(ra @ rb / den) if den else 0.0
