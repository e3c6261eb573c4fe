"""Exact reference for small instances: enumerate every budget table.

Replicas interact only through the step time (the slowest one) and the total
attention, so each replica's ``L ** (M * S)`` tables are enumerated on their own
(vectorised, in chunks, with the same longest-path engine), reduced to "best
attention at step time <= T", and combined: the optimum of objective (1) is the
smallest T at which the replicas' best attentions sum to the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import numpy as np

from sparsebalance.pipeline.graph import build_graph, earliest
from sparsebalance.tuning.instance import Instance

MAX_TABLES = 2_000_000
CHUNK = 65536


@dataclass
class Frontier:
    """Per-replica trade-off: for step-time thresholds, the best attention."""

    times: List[np.ndarray]
    """Per replica, sorted makespans of all tables, ms."""
    best_attn: List[np.ndarray]
    """Per replica, prefix maximum of attention along ``times``."""
    baseline_attn: float
    """Total attention of the static plan."""

    def optimum(self, eps: float) -> float:
        """Minimal step time keeping ``(1 - eps)`` of the static attention."""
        target = (1.0 - eps) * self.baseline_attn
        cand = np.unique(np.concatenate(self.times))
        total = np.zeros(len(cand))
        for t, a in zip(self.times, self.best_attn):
            pos = np.searchsorted(t, cand, side="right") - 1
            total += np.where(pos >= 0, a[np.maximum(pos, 0)], -np.inf)
        ok = np.flatnonzero(total >= target - 1e-9 * max(abs(target), 1.0))
        return float(cand[ok[0]])


def frontier(inst: Instance) -> Frontier:
    """Enumerate every table of every replica (raises if there are too many)."""
    M, S, L = inst.microbatches, inst.stages, len(inst.levels)
    n = M * S
    count = L ** n
    if count > MAX_TABLES:
        raise ValueError(f"{count} tables per replica exceeds {MAX_TABLES}: instance too large")
    g = build_graph(inst.schedule, inst.pp, M, inst.vpp, inst.group)
    powers = L ** np.arange(n, dtype=np.int64)
    times, best = [], []
    for d in range(inst.dp):
        F = inst.fwd[:, d].reshape(L, n)
        B = inst.bwd[:, d].reshape(L, n)
        A = inst.attn[:, d].reshape(L, n)
        spans, atts = [], []
        for lo in range(0, count, CHUNK):
            code = np.arange(lo, min(lo + CHUNK, count), dtype=np.int64)
            X = (code[None, :] // powers[:, None]) % L  # [n, chunk]
            cols = np.arange(n)[:, None]
            dur = np.concatenate([F[X, cols], B[X, cols]], axis=0)
            _, ef = earliest(g, dur, inst.p2p_ms)
            spans.append(ef[:-1].max(axis=0))
            atts.append(A[X, cols].sum(axis=0))
        t, a = np.concatenate(spans), np.concatenate(atts)
        order = np.argsort(t, kind="stable")
        times.append(t[order])
        best.append(np.maximum.accumulate(a[order]))
    base = float(inst.attn[inst.k0_index].sum())
    return Frontier(times, best, base)
