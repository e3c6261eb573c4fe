"""``wlb``: WLB-LLM's variable-length packing with outlier-delay queues.

WLB-LLM (Wang et al., 2025) balances pipeline micro-batches by a workload model of
attention plus linear cost instead of token count, lets micro-batches hold different
numbers of tokens, and delays "outlier" (very long) documents in multi-level queues
until enough of them have accumulated to give every unit of parallelism its share.

Our version, behind the common interface:

* outlier levels: items of at least ``seq_length / 2`` and at least
  ``seq_length / 4`` tokens (option ``wlb_levels``, fractions of seq_length);
* a level's queue is released in multiples of ``dp`` items, so every rank gets the
  same number of outliers; an item that has waited ``max_carry_steps`` steps is
  released regardless (WLB-LLM's queues are unbounded; ours honour the carry bound);
* the step's window is topped up with further stream items for the tokens held back;
* workload = the predictor's *dense* per-document cost (attention + linear, no
  sparsity), assigned greedily (LPT) to the least-loaded micro-batch with room.
  Without a predictor, ``L^2 + 8192 L`` (attention quadratic, linear term at the
  cross-over of a 4K-wide layer) stands in.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.batching.packing import Carried, PackContext, Packing
from sparsebalance.batching.strategies.common import build_window, extend_window, finish, rank_interleaved, settle
from sparsebalance.batching.strategies.greedy import lpt_assign
from sparsebalance.batching.stream import StreamCursor


def _hold_outliers(win, ctx: PackContext, levels) -> np.ndarray:
    """Bool mask of items the queues hold back this step."""
    S = ctx.seq_length
    hold = np.zeros(len(win), dtype=bool)
    bounds = sorted((float(f) * S for f in levels), reverse=True) + [0.0]
    for hi, lo in zip([np.inf] + bounds[:-1], bounds[:-1]):
        level = np.flatnonzero((win.length >= lo) & (win.length < hi) & ~win.forced)
        n_forced = int(np.count_nonzero((win.length >= lo) & (win.length < hi) & win.forced))
        # Release whole rounds of dp outliers counting the forced ones, oldest first
        # (the window is ordered oldest first).
        n_release = max(((n_forced + level.size) // ctx.dp) * ctx.dp - n_forced, 0)
        hold[level[n_release:]] = True
    return hold


def pack_wlb(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """WLB-LLM packing of one step (see the module docstring)."""
    K, S = ctx.num_bins, ctx.seq_length
    levels = ctx.options.get("wlb_levels", (0.5, 0.25))
    win = build_window(carried, stream, ctx, K * S)
    for _ in range(4):  # top up for held-back tokens; new outliers may be held again
        hold = _hold_outliers(win, ctx, levels)
        held_tok = int(win.length[hold].sum())
        room = K * S - int(win.length[~hold].sum())
        budget = min(room, ctx.carry_cap_tokens - held_tok)
        before = len(win)
        win = extend_window(win, stream, ctx, budget)
        if len(win) == before:
            break

    def assign_fn(w):
        hold = _hold_outliers(w, ctx, levels)
        # The carry cap is a hard bound: release the oldest held items if exceeded.
        held = np.flatnonzero(hold)
        over = int(w.length[held].sum()) - ctx.carry_cap_tokens
        for i in held.tolist():
            if over <= 0:
                break
            hold[i] = False
            over -= int(w.length[i])
        if ctx.cost is not None:
            cost = ctx.cost.doc_ms(w.length, w.doc, topk=None)
        else:
            L = w.length.astype(np.float64)
            cost = L * L + 8192.0 * L
        assign = np.full(len(w), -1, dtype=np.int64)
        lpt_assign(w, ctx, cost, assign, np.zeros(K, dtype=np.int64), np.zeros(K),
                   idx=np.flatnonzero(~hold))
        return assign, None

    win, assign, _ = settle(win, stream, ctx, assign_fn)
    return finish(win, assign, ctx, rank_interleaved(ctx))
