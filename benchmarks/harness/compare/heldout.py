"""Held-out loss at equal wall-clock: run order, held-out documents and the seed statistics.

Pure pieces of ``benchmarks/heldout_loss.py`` (no torch, no processes): which arm runs
when, which documents are held out, and the interval math over seeds (scipy's t).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


def interleaved_order(arms: Sequence[str], seeds: Sequence[int]) -> List[Tuple[str, int]]:
    """(arm, seed) in launch order: seed-major, the arm order rotated by one per seed,
    so every arm runs first, middle and last equally often (over ``len(arms)`` seeds)
    and a drift of the shared machine hits every arm alike."""
    arms = list(arms)
    out = []
    for i, seed in enumerate(seeds):
        r = i % len(arms)
        out += [(a, seed) for a in arms[r:] + arms[:r]]
    return out


def heldout_documents(lengths: np.ndarray, train_ids: np.ndarray, valid_ids: np.ndarray,
                      min_length: int, max_docs: int) -> np.ndarray:
    """The first ``max_docs`` documents of the valid split longer than ``min_length`` tokens.

    Raises ValueError if the splits overlap or no valid document is long enough.
    """
    if np.intersect1d(train_ids, valid_ids).size:
        raise ValueError("the train and valid splits share documents")
    lengths = np.asarray(lengths)
    long_ = valid_ids[lengths[valid_ids] > min_length]
    if long_.size == 0:
        raise ValueError(f"no held-out document is longer than {min_length} tokens "
                         f"({valid_ids.size} in the valid split)")
    return long_[:max_docs]


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile: ``t`` with P(T <= t) = ``q`` (0.5 < q < 1), ``df`` degrees of freedom."""
    from scipy.stats import t

    if not 0.5 < q < 1 or df < 1:
        raise ValueError(f"need 0.5 < q < 1 and df >= 1, got q={q}, df={df}")
    return float(t.ppf(q, df))


def mean_interval(values: Sequence[float], level: float = 0.95) -> dict:
    """Mean over seeds with its t-interval: ``{"mean", "ci95": [lo, hi] or None, "n", "sd"}``
    (no interval with fewer than two values)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("no values")
    mean = float(v.mean())
    if v.size < 2:
        return {"mean": mean, "ci95": None, "n": 1, "sd": None}
    sd = float(v.std(ddof=1))
    half = t_quantile(0.5 + level / 2, v.size - 1) * sd / math.sqrt(v.size)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": int(v.size), "sd": sd}


def paired_difference(a: Dict[int, float], b: Dict[int, float]) -> Optional[dict]:
    """``a - b`` over the seeds both have (same seed = same init and document order):
    :func:`mean_interval` of the per-seed differences plus ``per_seed`` and a
    ``verdict``: "beyond noise" when the 95% interval excludes 0, else "within noise"
    ("unknown" with one seed). None if they share no seed."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = [a[s] - b[s] for s in seeds]
    out = mean_interval(d)
    ci = out["ci95"]
    out["verdict"] = ("unknown (one seed)" if ci is None
                      else "beyond noise" if ci[0] > 0 or ci[1] < 0 else "within noise")
    out["per_seed"] = {str(s): x for s, x in zip(seeds, d)}
    return out
