"""Build a planning instance from packed micro-batches and a latency predictor.

For every (replica, micro-batch, virtual stage) and every allowed budget: forward
and backward time from ``LatencyPredictor`` (``layers_of(stage) * layer_ms +
extras_ms``, times the predictor's online correction for that stage and phase,
i.e. exactly ``stage_ms``), and retained attention = layers of the stage x kept
(query, key) pairs of block top-k routing (``sparsebalance.attention.routing``).
For the interleaved schedule the model is split into ``pp * vpp`` chunks and
stage ``j = v * pp + rank`` is chunk ``j``. Under context parallelism
(``predictor.set_context_parallel``) the op times are those of the slowest rank of
a CP group, K/V exchange included; retained attention stays the whole model's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..attention.routing import kept_pairs
from .instance import Instance


def build_instance(predictor, lengths: Sequence[Sequence[Sequence[int]]], *, pp: int, k0: int,
                   levels: Optional[Sequence[int]] = None, kmin: Optional[int] = None,
                   kmax: Optional[int] = None, schedule: str = "1f1b", vpp: int = 1,
                   p2p_ms: float = 0.0, group: Optional[int] = None) -> Instance:
    """Instance for document ``lengths[dp][microbatch]`` (token counts of one micro-batch).

    ``levels`` default: every integer in ``[kmin, kmax]`` (defaults ``k0 // 2``, ``2 * k0``).
    """
    D = len(lengths)
    if D == 0 or len({len(r) for r in lengths}) != 1 or len(lengths[0]) == 0:
        raise ValueError("lengths must be a non-empty [dp][microbatch] nesting of equal sizes")
    M, S = len(lengths[0]), pp * vpp
    kmin = k0 // 2 if kmin is None else int(kmin)
    kmax = 2 * k0 if kmax is None else int(kmax)
    lv = sorted(set(range(kmin, kmax + 1) if levels is None else (int(x) for x in levels))
                | {int(k0)})
    L = len(lv)
    layers = np.array([predictor.shape.layers_of(j, S) for j in range(S)], dtype=float)
    # All documents of the step in one array; per-micro-batch sums by segment.
    docs = [np.asarray(lengths[d][m], dtype=np.int64) for d in range(D) for m in range(M)]
    if any(x.ndim != 1 or len(x) == 0 for x in docs):
        raise ValueError("every micro-batch needs a non-empty list of document lengths")
    flat = np.concatenate(docs)
    starts = np.cumsum([0] + [len(x) for x in docs[:-1]])
    tabs = {n: np.empty((L, D, M, S)) for n in ("fwd", "bwd", "attn")}
    for phase in ("fwd", "bwd"):
        # Extras live on the first and last (virtual) stage only (predictor interface).
        extras = np.zeros((D * M, S))
        for j in {0, S - 1}:
            extras[:, j] = [predictor.extras_ms(x, j, S, phase) for x in docs]
        corr = np.array([predictor.correction(j, phase) for j in range(S)])
        const = predictor.layer_const_ms(phase)
        for li, k in enumerate(lv):
            per_layer = np.add.reduceat(predictor.layer_doc_ms(flat, k, phase), starts) + const
            tabs[phase][li] = ((per_layer[:, None] * layers + extras) * corr).reshape(D, M, S)
    for li, k in enumerate(lv):
        pairs = np.add.reduceat(kept_pairs(flat, k, predictor.block_size), starts).astype(float)
        tabs["attn"][li] = (pairs[:, None] * layers).reshape(D, M, S)
    return Instance(schedule=schedule, pp=pp, vpp=vpp, dp=D, microbatches=M, k0=int(k0),
                    kmin=kmin, kmax=kmax, levels=np.array(lv, dtype=np.int64), p2p_ms=p2p_ms,
                    group=group, **tabs)
