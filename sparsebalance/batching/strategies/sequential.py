"""Order-preserving baselines: ``megatron``, ``concat`` and ``sorted`` (LongAlign)."""

from __future__ import annotations

import numpy as np

from sparsebalance.batching.packing import Carried, PackContext, Packing
from sparsebalance.batching.strategies.common import Window, build_window, finish, settle
from sparsebalance.batching.stream import StreamCursor


def _next_fit(lengths: np.ndarray, num_bins: int, cap: int) -> np.ndarray:
    """Fill bins in order: an item goes to the current bin, or opens the next one when
    it does not fit. Returns the bin of each item (-1 once all bins are closed)."""
    assign = np.full(lengths.size, -1, dtype=np.int64)
    b, load = 0, 0
    for i, L in enumerate(lengths.tolist()):
        if load + L > cap:
            b, load = b + 1, 0
            if b >= num_bins:
                break
        assign[i] = b
        load += L
    return assign


def fill_in_order(carried: Carried, stream: StreamCursor, ctx: PackContext):
    """Next-fit of the step's window in stream order: ``(window, bin of each item)``.
    Only the placed prefix is kept; the unplaced stream items go back to the stream
    untouched (they are not carried)."""
    K, S = ctx.num_bins, ctx.seq_length
    win = build_window(carried, stream, ctx, K * S)
    assign = _next_fit(win.length, K, S)
    n = win.n_carried + int(np.count_nonzero(assign[win.n_carried:] >= 0))
    stream.retreat(len(win) - n)
    win = Window(win.doc[:n], win.offset[:n], win.length[:n], win.age[:n], win.forced[:n],
                 win.n_carried)
    return win, assign[:n]


def pack_megatron(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """Whole items in stream order into micro-batches until the next one does not fit;
    bin j of the step goes to rank j // M. Never defers: unplaced stream items stay in
    the stream (the next step starts with them)."""
    win, assign = fill_in_order(carried, stream, ctx)
    return finish(win, assign, ctx)


def pack_concat(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """Pretraining-style concatenation: every micro-batch exactly ``seq_length`` tokens
    (except at the end of an epoch); items are cut at micro-batch boundaries and the
    rest of a cut item starts the next micro-batch (or the next step, via the stream
    head). Carried items go first (this strategy never defers, so there are none
    unless a caller hands some in)."""
    K, S = ctx.num_bins, ctx.seq_length
    bins: list[list] = [[] for _ in range(K)]
    b, room = 0, S
    pending = zip(carried.doc.tolist(), carried.offset.tolist(), carried.length.tolist(),
                  carried.age.tolist())
    left: list = []
    for doc, off, L, age in pending:
        while L > 0 and b < K:
            t = min(L, room)
            bins[b].append((doc, off, t))
            off, L, room = off + t, L - t, room - t
            if room == 0:
                b, room = b + 1, S
        if L > 0:
            left.append((doc, off, L, age + 1))
    while b < K and not stream.exhausted():
        doc, off, L = (int(x[0]) for x in stream.peek(1))
        t = min(L, room)
        bins[b].append((doc, off, t))
        stream.consume_head_tokens(t)
        room -= t
        if room == 0:
            b, room = b + 1, S
    arr = np.array(left, dtype=np.int64).reshape(len(left), 4)
    return Packing(bins, Carried(*(arr[:, c].copy() for c in range(4))))


def pack_sorted(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """LongAlign's sorted batching: take the window that fills the step's token
    capacity, sort it by length (longest first) and fill micro-batches in that order,
    so each micro-batch holds documents of similar length. Forced items go first."""
    K, S = ctx.num_bins, ctx.seq_length

    def assign_fn(w):
        order = np.lexsort((-w.length, ~w.forced))  # forced first, then longest first
        # First-fit over the sorted order keeps lengths together while leaving no
        # item behind that a later bin could take.
        loads = np.zeros(K, dtype=np.int64)
        assign = np.full(len(w), -1, dtype=np.int64)
        for i in order.tolist():
            L = int(w.length[i])
            fits = np.flatnonzero(loads + L <= S)
            if fits.size:
                b = int(fits[0])
                loads[b] += L
                assign[i] = b
        return assign, None

    win, assign, _ = settle(build_window(carried, stream, ctx, K * S), stream, ctx, assign_fn)
    return finish(win, assign, ctx)
