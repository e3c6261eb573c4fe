"""The paper's anchor-guided thresholding (SparseBalance DST).

For each pipeline stage, the anchor is ``A = agg`` (mean, max or min) of the
predicted latency (forward + backward) at ``k0`` over the micro-batches of that
stage on every replica (with one replica: over micro-batches, as in the paper).
Each op then gets the allowed budget whose predicted latency is closest to ``A``,
restricted to ``[(1 - p) k0, (1 + p) k0]``; ties go to the budget nearest ``k0``.
Hence MAX only raises budgets (every latency is at most the anchor) and MIN only
cuts them.
"""

from __future__ import annotations

import numpy as np

from .instance import Instance
from .plan import Plan, make_plan

AGGS = {"mean": np.mean, "max": np.max, "min": np.min}


def anchor_indices(inst: Instance, agg: str = "mean", p: float = 0.1) -> np.ndarray:
    """Level indices [D, M, S] of the anchor plan."""
    if agg not in AGGS:
        raise ValueError(f"agg must be one of {sorted(AGGS)}, got {agg!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p}")
    lat = inst.fwd + inst.bwd  # [L, D, M, S]
    lat0 = lat[inst.k0_index]
    anchor = AGGS[agg](lat0, axis=(0, 1))  # [S]
    lv = inst.levels.astype(float)
    lo, hi = (1.0 - p) * inst.k0, (1.0 + p) * inst.k0
    inside = (lv >= lo - 1e-9) & (lv <= hi + 1e-9)
    inside[inst.k0_index] = True
    dist = np.abs(lat - anchor[None, None, None, :])
    # Lexicographic key: latency distance, then distance of the budget from k0, then k.
    scale = float(np.max(lat)) or 1.0
    dist = np.round(dist / scale, 12)
    order = np.lexsort((lv, np.abs(lv - inst.k0)))  # level order of the tie-breaks
    rank = np.empty(len(lv), dtype=float)
    rank[order] = np.arange(len(lv))
    key = np.where(inside[:, None, None, None], dist, np.inf)
    flat = key.reshape(len(lv), -1)
    best = np.lexsort((np.broadcast_to(rank[:, None], flat.shape), flat), axis=0)[0]
    return best.reshape(lat0.shape).astype(np.int64)


def anchor_plan(inst: Instance, agg: str = "mean", p: float = 0.1) -> Plan:
    """The anchor plan, evaluated (see module docstring)."""
    return make_plan(inst, anchor_indices(inst, agg, p), "anchor")


def policy(inst: Instance, dst) -> Plan:
    """``DST_POLICIES["anchor"]``: the anchor plan under ``dst`` (a
    :class:`sparsebalance.config.DSTConfig`: ``anchor``, ``p``)."""
    return anchor_plan(inst, agg=dst.anchor, p=dst.p)
