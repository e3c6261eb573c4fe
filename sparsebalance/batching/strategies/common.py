"""Helpers shared by the packing strategies: window assembly and result building."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsebalance.batching.packing import Carried, PackContext, Packing
from sparsebalance.batching.stream import StreamCursor


@dataclass
class Window:
    """Candidate items of one step: carried ones first (oldest first), then stream items."""

    doc: np.ndarray
    """[n] document ids."""
    offset: np.ndarray
    """[n] offsets (tokens)."""
    length: np.ndarray
    """[n] lengths (tokens)."""
    age: np.ndarray
    """[n] steps waited so far (0 for stream items)."""
    forced: np.ndarray
    """[n] bool: must be placed in this step."""
    n_carried: int
    """The first ``n_carried`` items come from the carry queue."""

    def __len__(self) -> int:
        return int(self.doc.size)


def build_window(carried: Carried, stream: StreamCursor, ctx: PackContext,
                 token_budget: int) -> Window:
    """Carried items plus the stream prefix that fits ``token_budget`` minus the carried
    tokens. Consumes those stream items from ``stream``. (A budget below the step's
    tokens, SAB's ``0.9 x``, may admit nothing; :func:`occupy_empty_bins` then admits items.)
    """
    order = np.argsort(-carried.age, kind="stable")
    c_doc, c_off, c_len, c_age = (carried.doc[order], carried.offset[order],
                                  carried.length[order], carried.age[order])
    budget = max(int(token_budget) - int(c_len.sum()), 0)
    s_doc, s_off, s_len = stream.peek_tokens(budget)
    stream.advance(s_doc.size)
    doc = np.concatenate([c_doc, s_doc])
    age = np.concatenate([c_age, np.zeros(s_doc.size, dtype=np.int64)])
    forced = age >= ctx.max_carry_steps
    if ctx.flush:
        forced[: c_doc.size] = True
    return Window(doc, np.concatenate([c_off, s_off]), np.concatenate([c_len, s_len]),
                  age, forced, int(c_doc.size))


def finish(win: Window, assign: np.ndarray, ctx: PackContext,
           mb_order: list | None = None) -> Packing:
    """Turn ``assign[i]`` (bin of item i, or -1 = defer) into a :class:`Packing`.

    Items keep window order inside a bin. ``mb_order`` optionally permutes the
    bins: new bin j holds old bin ``mb_order[j]``.
    """
    K = ctx.num_bins
    idx = np.flatnonzero(assign >= 0)
    idx = idx[np.argsort(assign[idx], kind="stable")]  # by bin, window order inside
    rows = list(map(tuple, np.stack([win.doc[idx], win.offset[idx], win.length[idx]],
                                    axis=1).tolist()))
    ends = np.cumsum(np.bincount(assign[idx], minlength=K)).tolist()
    bins = [rows[a:b] for a, b in zip([0] + ends[:-1], ends)]
    if mb_order is not None:
        bins = [bins[j] for j in mb_order]
    d = np.flatnonzero(assign < 0)
    deferred = Carried(win.doc[d].copy(), win.offset[d].copy(), win.length[d].copy(),
                       win.age[d] + 1)
    return Packing(bins, deferred)


def first_fit_forced(win: Window, ctx: PackContext, loads: np.ndarray,
                     assign: np.ndarray) -> None:
    """Place the forced items first-fit decreasing into the bins with the least tokens.

    Forced items are few and at most ``seq_length`` long each; placing them before
    anything else guarantees they fit whenever their total is at most half the
    step's capacity (see the sampler's carry cap).
    """
    idx = np.flatnonzero(win.forced)
    for i in idx[np.argsort(-win.length[idx], kind="stable")]:
        L = int(win.length[i])
        b = int(np.argmin(loads))
        if loads[b] + L > ctx.seq_length:
            fits = np.flatnonzero(loads + L <= ctx.seq_length)
            if fits.size == 0:
                continue  # the sampler reports an unplaced forced item
            b = int(fits[np.argmin(loads[fits])])
        loads[b] += L
        assign[i] = b


def extend_window(win: Window, stream: StreamCursor, ctx: PackContext, tokens: int) -> Window:
    """Append the stream prefix that fits ``tokens`` more tokens (consumed from ``stream``)."""
    if tokens <= 0:
        return win
    s_doc, s_off, s_len = stream.peek_tokens(int(tokens))
    stream.advance(s_doc.size)
    return _append(win, s_doc, s_off, s_len, ctx)


def _append(win: Window, s_doc: np.ndarray, s_off: np.ndarray, s_len: np.ndarray,
            ctx: PackContext) -> Window:
    """``win`` followed by these stream items (age 0)."""
    if s_doc.size == 0:
        return win
    z = np.zeros(s_doc.size, dtype=np.int64)
    return Window(np.concatenate([win.doc, s_doc]), np.concatenate([win.offset, s_off]),
                  np.concatenate([win.length, s_len]), np.concatenate([win.age, z]),
                  np.concatenate([win.forced, z >= ctx.max_carry_steps]), win.n_carried)


def rank_interleaved(ctx: PackContext) -> list:
    """``mb_order`` for :func:`finish` that deals internal bins round-robin over ranks
    (internal bin b -> rank b % dp), so greedy packers that fill the lowest-numbered
    least-loaded bin first spread heavy items over ranks instead of stacking them on
    rank 0."""
    dp, M = ctx.dp, ctx.micro_batches
    return [(j % M) * dp + j // M for j in range(dp * M)]


def settle(win: Window, stream: StreamCursor, ctx: PackContext, assign_fn):
    """Run ``assign_fn(win) -> (assign, extra)`` and make its deferrals legal.

    An unplaced stream item that may not wait (``max_carry_steps`` = 0) cannot be
    carried, so the window is cut just before the first such item, the items after
    the cut go back to the stream, and the assignment is recomputed on the shorter
    window. Likewise, while the deferred tokens exceed the carry cap, the window is
    cut before its last deferred stream item. Returns ``(win, assign, extra)``.
    """
    while True:
        assign, extra = assign_fn(win)
        unplaced = assign[win.n_carried:] < 0
        bad = np.flatnonzero(unplaced & (win.age[win.n_carried:] + 1 > ctx.max_carry_steps))
        deferred_tok = int(win.length[assign < 0].sum())
        if bad.size:
            # at least the first item when nothing is carried: alone it fits an empty step
            # (a cut to an empty window would repeat on every later step: the epoch stalls)
            cut = max(win.n_carried + int(bad[0]), 1)
            if cut == len(win):
                return win, assign, extra  # a lone item unplaced: the sampler reports it
        elif deferred_tok > ctx.carry_cap_tokens and unplaced.any():
            cut = win.n_carried + int(np.flatnonzero(unplaced)[-1])
        else:
            return win, assign, extra
        stream.retreat(len(win) - cut)
        win = Window(win.doc[:cut], win.offset[:cut], win.length[:cut], win.age[:cut],
                     win.forced[:cut], win.n_carried)


def occupy_empty_bins(win: Window, assign: np.ndarray, extra, stream: StreamCursor,
                      ctx: PackContext, assign_fn):
    """Admit further stream items, one at a time, while a bin is left empty.

    A window below the step's tokens (SAB's ``0.9 x``) admits few items when they are
    near ``seq_length`` long, and can leave whole micro-batches empty although the next
    stream item fits any empty bin. Each round appends the next stream item and reruns
    ``assign_fn`` on the longer window; the round is kept only if it defers no item the
    previous assignment placed and places the new one (so the carried items, the carry
    cap and ``max_carry_steps`` are as :func:`settle` left them), else the item goes back
    to the stream and the rounds end. With every bin occupied nothing changes.
    Returns ``(win, assign, extra)``.
    """
    for _ in range(2 * ctx.num_bins):  # each kept round places one more item
        if np.unique(assign[assign >= 0]).size == ctx.num_bins or stream.exhausted():
            break
        longer = _append(win, *stream.peek(1), ctx)
        stream.advance(1)
        new_assign, new_extra = assign_fn(longer)
        if new_assign[-1] < 0 or np.any((new_assign[:-1] < 0) & (assign >= 0)):
            stream.retreat(1)
            break
        win, assign, extra = longer, new_assign, new_extra
    return win, assign, extra
