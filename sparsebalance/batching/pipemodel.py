"""Exact 1F1B timing of one data-parallel rank, batched over candidate orders.

Megatron-core's non-interleaved 1F1B runs, on stage ``s`` of ``pp``,
``w = min(pp - s - 1, M)`` warm-up forwards, then ``M - w`` (forward, backward)
pairs, then ``w`` cool-down backwards. ``F(m, s)`` waits for ``F(m, s-1)`` and
``B(m, s)`` for ``B(m, s+1)``; p2p time is ignored. The packers evaluate many
micro-batch orders, so the recurrence is unrolled once per ``(M, pp)`` into a
topological op list and then evaluated with one vector operation per op over a
batch of candidates. ``sparsebalance.pipeline`` (the scheduling helper's model) is
the reference the plans are finally reported with when it is importable.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=64)
def _op_graph(M: int, pp: int) -> tuple:
    """Topological op list: (is_bwd, mb, stage, prev_op_on_stage, dep_op) per op."""
    seqs = []
    for s in range(pp):
        w = min(pp - s - 1, M)
        seq = [(0, m) for m in range(w)]
        for i in range(M - w):
            seq += [(0, w + i), (1, i)]
        seq += [(1, m) for m in range(M - w, M)]
        seqs.append(seq)
    index: dict = {}
    ops: list = []
    ptr = [0] * pp
    while len(ops) < 2 * M * pp:
        progressed = False
        for s in range(pp):
            while ptr[s] < len(seqs[s]):
                kind, m = seqs[s][ptr[s]]
                if kind == 0:
                    dep = (0, m, s - 1) if s > 0 else None
                else:
                    dep = (1, m, s + 1) if s < pp - 1 else None
                if dep is not None and dep not in index:
                    break
                prev = index.get((seqs[s][ptr[s] - 1][0], seqs[s][ptr[s] - 1][1], s), -1) \
                    if ptr[s] > 0 else -1
                index[(kind, m, s)] = len(ops)
                ops.append((kind, m, s, prev, index[dep] if dep is not None else -1))
                ptr[s] += 1
                progressed = True
        if not progressed:  # cannot happen for 1F1B; guards against an endless loop
            raise RuntimeError("1F1B op graph has a cycle")
    return tuple(ops)


@lru_cache(maxsize=64)
def _levels(M: int, pp: int) -> tuple:
    """Ops grouped by topological level (ops of one level are independent).

    Returns a tuple of (op ids, prev ids, dep ids, is_bwd, mb, stage) arrays per level;
    a missing prev/dep points at the extra slot ``2 * M * pp`` that always holds 0.
    """
    ops = _op_graph(M, pp)
    n = len(ops)
    level = np.zeros(n, dtype=np.int64)
    for i, (_, _, _, prev, dep) in enumerate(ops):
        level[i] = 1 + max(level[prev] if prev >= 0 else -1, level[dep] if dep >= 0 else -1)
    out = []
    for lv in range(int(level.max()) + 1):
        ids = np.flatnonzero(level == lv)
        sel = [ops[i] for i in ids]
        out.append((ids,
                    np.array([o[3] if o[3] >= 0 else n for o in sel]),
                    np.array([o[4] if o[4] >= 0 else n for o in sel]),
                    np.array([o[0] for o in sel], dtype=bool),
                    np.array([o[1] for o in sel]),
                    np.array([o[2] for o in sel])))
    return tuple(out)


def one_f_one_b_ms(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """Step time of 1F1B for a batch of candidates.

    Args:
        fwd: [..., M, pp] forward time of micro-batch m on stage s (ms), in run order.
        bwd: [..., M, pp] backward times (ms).

    Returns:
        [...] time from the first forward to the last backward (ms).
    """
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    M, pp = fwd.shape[-2:]
    batch = fwd.shape[:-2]
    # [..., 2 * M * pp] durations in op-graph order, ops last for cheap gathers.
    dur = np.stack([fwd, bwd], axis=-3).reshape(batch + (2 * M * pp,))
    end = np.zeros(batch + (2 * M * pp + 1,))
    for ids, prev, dep, is_bwd, m, s in _levels(M, pp):
        start = np.maximum(end[..., prev], end[..., dep])
        end[..., ids] = start + dur[..., is_bwd * (M * pp) + m * pp + s]
    return end.max(axis=-1)
