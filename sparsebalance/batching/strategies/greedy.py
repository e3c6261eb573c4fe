"""Greedy balancing baselines: ``tokens`` (token count) and ``quadratic`` (sum of
squared lengths, the WLB-LLM / FlexSP attention proxy), plus the capacity-aware
longest-processing-time (LPT) assignment they share with ``wlb`` and ``sab``."""

from __future__ import annotations

import numpy as np

from sparsebalance.batching.packing import Carried, PackContext, Packing
from sparsebalance.batching.strategies.common import Window, build_window, finish, rank_interleaved, settle
from sparsebalance.batching.stream import StreamCursor


def lpt_assign(win: Window, ctx: PackContext, cost: np.ndarray, assign: np.ndarray,
               tok: np.ndarray, load: np.ndarray, idx=None) -> None:
    """Assign items (forced first, then by decreasing ``cost``) to the bin of least
    ``load`` that still has token room; items that fit nowhere stay at -1.

    Args:
        cost: [n] item cost (any unit; the same unit as ``load``).
        assign: [n] bin per item, updated in place (-1 = unassigned).
        tok: [K] tokens per bin, updated in place.
        load: [K] cost per bin, updated in place.
        idx: items to consider (default: all unassigned).
    """
    if idx is None:
        idx = np.flatnonzero(assign < 0)
    idx = np.asarray(idx)
    order = idx[np.lexsort((-cost[idx], ~win.forced[idx]))]
    S = ctx.seq_length
    lengths = win.length
    for i in order.tolist():
        L = lengths[i]
        room = tok <= S - L
        if not room[np.argmin(load)]:
            if not room.any():
                continue
            b = int(np.argmin(np.where(room, load, np.inf)))
        else:
            b = int(np.argmin(load))
        assign[i] = b
        tok[b] += L
        load[b] += cost[i]


def _pack_by_cost(carried: Carried, stream: StreamCursor, ctx: PackContext, cost_fn) -> Packing:
    K, S = ctx.num_bins, ctx.seq_length
    def assign_fn(w):
        assign = np.full(len(w), -1, dtype=np.int64)
        lpt_assign(w, ctx, cost_fn(w.length.astype(np.float64)), assign,
                   np.zeros(K, dtype=np.int64), np.zeros(K))
        return assign, None

    win, assign, _ = settle(build_window(carried, stream, ctx, K * S), stream, ctx, assign_fn)
    return finish(win, assign, ctx, rank_interleaved(ctx))


def pack_tokens(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """Greedy token balance: the window that fills the step's capacity, LPT by length."""
    return _pack_by_cost(carried, stream, ctx, lambda L: L)


def pack_quadratic(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """Greedy balance of the sum of squared lengths (LPT by L^2)."""
    return _pack_by_cost(carried, stream, ctx, lambda L: L * L)
