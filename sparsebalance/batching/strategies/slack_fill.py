"""SAB's slack fill: more stream items into the idle room of an uneven step.

A step whose time is set by one long document (dense attention, M close to PP, the outlier
queue could not give every replica one) leaves the other replicas idle for much of the
step, with token room to spare (SAB plans ``sab_fill`` of the step's tokens). That room
is free: a short document placed there adds nothing to the step's time. After SAB's plan,
the next stream items, in stream order, go one at a time to the bin with token room whose
replica's new 1F1B time is least, as long as it stays below the step's time; the first
item that fits nowhere ends the fill (it stays in the stream, so the stream is still
consumed as a prefix and nothing is carried that was not before).

Only uneven steps (the slowest replica more than ``sab_slack_gap``, default 10%, above
the fastest) are filled, with at most ``sab_slack_items`` (default ``4 x`` bins) items:
balanced steps have no idle room worth a plan, so their planning time is unchanged.
"""

from __future__ import annotations

import numpy as np

from sparsebalance.batching.packing import PackContext
from sparsebalance.batching.strategies.common import Window, _append
from sparsebalance.batching.stream import StreamCursor
from sparsebalance.pipeline import step_ms_rows


def fill_slack(win: Window, assign: np.ndarray, orders: np.ndarray, li: np.ndarray,
               cost, ctx: PackContext, stream: StreamCursor):
    """Append stream items placed in idle room (module docstring).

    Args:
        win, assign: SAB's window and bin per item (-1: waits).
        orders: [dp, M] rank-local bin per position (SAB's order).
        li: [2, n] one layer's fwd/bwd time per window item (ms).

    Returns:
        ``(win, assign, li)`` with the placed stream items appended.
    """
    K, M, dp, S = ctx.num_bins, ctx.micro_batches, ctx.dp, ctx.seq_length
    gap = float(ctx.options.get("sab_slack_gap", 0.1))
    limit = int(ctx.options.get("sab_slack_items", 4 * K))
    if limit <= 0 or stream.exhausted() or ctx.flush:
        return win, assign, li
    placed = assign >= 0
    layer = np.stack([np.bincount(assign[placed], weights=li[p, placed], minlength=K)
                      for p in range(2)], axis=1)
    tok = np.bincount(assign[placed], weights=win.length[placed], minlength=K).astype(np.int64)
    fwd, bwd = cost.stage_times(layer, tok)
    seqs = np.arange(dp)[:, None] * M + orders  # [dp, M] bin per position
    T = step_ms_rows(fwd, bwd, seqs)
    if T.max() <= (1 + gap) * T.min():
        return win, assign, li
    step = float(T.max())
    pos = np.empty(K, dtype=np.int64)
    pos[seqs.ravel()] = np.tile(np.arange(M), dp)
    s_doc, s_off, s_len = stream.peek(limit)
    s_li = cost.layer_item_ms(s_len, s_doc)
    n = 0
    for i in range(s_doc.size):
        L = int(s_len[i])
        cand = np.flatnonzero(tok + L <= S)
        if cand.size == 0:
            break
        f1, b1 = cost.stage_times(layer[cand] + s_li[:, i][None, :], tok[cand] + L)
        rows = seqs[cand // M].copy()
        rows[np.arange(cand.size), pos[cand]] = K + np.arange(cand.size)
        t = step_ms_rows(np.concatenate([fwd, f1]), np.concatenate([bwd, b1]), rows)
        k = int(np.argmin(t))
        if t[k] >= step * (1 - 1e-9):
            break
        b = int(cand[k])
        layer[b] += s_li[:, i]
        tok[b] += L
        fwd[b], bwd[b] = f1[k], b1[k]
        n += 1
        assign = np.append(assign, b)
    if n:
        stream.advance(n)
        win = _append(win, s_doc[:n], s_off[:n], s_len[:n], ctx)
        li = np.concatenate([li, s_li[:, :n]], axis=1)
    return win, assign, li
