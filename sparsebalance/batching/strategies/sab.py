"""``sab``: sparsity-aware batching by predicted latency.

Objective, lexicographic: (1) the largest per-rank predicted pipeline (1F1B) step
time, (2) the spread of micro-batch times, (3) the order of micro-batches within a
rank. Cost of an item = what it adds to the *bottleneck* pipeline stage (fwd + bwd,
from the predictor at the planned budget, i.e. with its sparsity), because in 1F1B
the slowest stage paces the steady state.

Steps of one plan:

1. Window: carried items (oldest first, forced ones must go) plus the stream prefix
   that fills ``sab_fill`` (default 0.9, about what megatron packing reaches) of the
   step's tokens. If the assignment (step 3) leaves a micro-batch empty, as when items
   are near ``seq_length`` long and few fit the budget, further stream items are
   admitted one at a time and the assignment rerun, while each is placed without
   deferring anything (:func:`~sparsebalance.batching.strategies.common.occupy_empty_bins`).
   With the outlier queue on (option ``sab_hold``, default True), the window is topped
   up by the tokens of the items that may wait, so that holding them leaves short
   documents to fill their room.
2. Shape: in 1F1B the fill and drain bubbles scale with the first micro-batch's
   forward and the last one's backward, so equal micro-batches are not optimal:
   :func:`pipeline_profile` finds the per-position share of a rank's work that
   minimises the 1F1B time (a deterministic pattern search on the pipeline model).
   Option ``sab_profile="flat"`` plans equal micro-batches instead.
3. Assign: items by decreasing cost (forced first) to the bin with the least
   ``load / target share`` that has token room (proportional LPT); items that fit
   nowhere are deferred. The outlier queue
   (:mod:`~sparsebalance.batching.strategies.outlier_queue`) first decides which
   expensive items wait: of the plans that hold the k costliest of them, the one of
   least predicted step time + price of what it leaves waiting.
4. Order: per rank, match bins to positions by cost rank, then improve by pair swaps
   evaluated exactly with the vectorised 1F1B model.
5. Improve: up to ``sab_moves`` (default 8) single-item moves off the slowest rank
   (to another rank, or to another micro-batch of the same rank) chosen by the batched
   1F1B model while they lower (step time, sum of rank times); re-order touched ranks.
   A move never takes a micro-batch's last item: emptying the first micro-batch
   shortens the 1F1B fill, but wastes a slot of the step that a waiting item could use.
   While the slowest rank is more than 10% above the fastest (a step set by a long
   document), up to ``sab_moves_uneven`` (default 56) further moves shift short documents
   off the slow replicas into the idle ones.
6. Fill: in such an uneven step the next stream items go into the idle replicas' token
   room while none raises the step time
   (:mod:`~sparsebalance.batching.strategies.slack_fill`).

Held items and items that fit nowhere are carried, bounded by ``max_carry_steps`` (no
item waits more steps; once the epoch's stream is exhausted every carried item is
placed before the next epoch starts) and the carry cap (half the step's tokens). The
queue pays where one expensive document stretches a step: dense or near-dense attention
with few micro-batches per replica (M close to PP), where a lone long document
stretches the 1F1B fill and drain of its replica.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from sparsebalance.batching.packing import Carried, PackContext, Packing
from sparsebalance.batching.strategies.common import (
    Window,
    build_window,
    extend_window,
    finish,
    occupy_empty_bins,
    rank_interleaved,
    settle,
)
from sparsebalance.batching.strategies.outlier_queue import choose_holds, hold_candidates
from sparsebalance.batching.strategies.slack_fill import fill_slack
from sparsebalance.batching.stream import StreamCursor
from sparsebalance.pipeline import simulate, step_ms_rows, step_ms_scaled


@lru_cache(maxsize=64)
def pipeline_profile(M: int, fwd: tuple, bwd: tuple) -> np.ndarray:
    """Per-position work shares (mean 1) that minimise 1F1B time of one rank.

    Args:
        M: micro-batches per rank.
        fwd, bwd: per-stage times of a typical micro-batch (ms); position m runs
            ``x_m`` times them.

    Returns:
        [M] shares, mean 1, each >= 0.05.
    """
    f0, b0 = np.asarray(fwd), np.asarray(bwd)
    x = np.ones(M)
    if M < 2:  # one micro-batch per step: nothing to shape
        return x

    def t(xs):  # [C, M] shapes -> [C] 1F1B times
        return step_ms_scaled(xs, f0, b0)

    best = float(t(x[None, :])[0])
    ii, jj = np.nonzero(~np.eye(M, dtype=bool))  # every ordered pair i != j
    rows = np.arange(ii.size)
    step = 0.2
    while step > 0.005:
        # Candidate (i, j) moves d of j's share to i, keeping j's share >= 0.05.
        cand = np.repeat(x[None, :], ii.size, axis=0)
        d = np.maximum(np.minimum(step, x[jj] - 0.05), 0.0)
        cand[rows, ii] += d
        cand[rows, jj] -= d
        tt = t(cand)
        k = int(np.argmin(tt))
        if tt[k] < best - 1e-9:
            best, x = float(tt[k]), cand[k]
        else:
            step /= 2
    return x / x.mean()


def _proportional_lpt(c: np.ndarray, length: np.ndarray, forced: np.ndarray,
                      share: np.ndarray, const: float, S: int, exact: int = 0,
                      skip: np.ndarray | None = None) -> np.ndarray:
    """Items (forced first, then by decreasing cost ``c``) to the bin with token room
    that minimises ``(load + c) / share``; returns the bin per item (-1: no room, or
    ``skip`` [n] bool marks it as held back).

    The first ``exact`` items (default ``4 * K``, the heavy ones, where the choice
    matters) use that rule exactly; the rest are small relative to a bin, where it
    is close to "least ``load / share`` first", done K items at a time.
    """
    K = share.size
    exact = exact or 4 * K
    order = np.lexsort((-c, ~forced))
    if skip is not None:
        order = order[~skip[order]]
    assign = np.full(c.size, -1, dtype=np.int64)
    tok = np.zeros(K, dtype=np.int64)
    load = np.full(K, const)
    length_l, c_l = length.tolist(), c.tolist()

    def place(i: int) -> None:
        # The least (load + c) / share among the bins with room. The least overall is
        # that bin whenever it has room (first index on ties either way); only when
        # it has none is the room of every bin needed.
        v = (load + c_l[i]) / share
        b = int(v.argmin())
        if tok[b] > S - length_l[i]:
            room = tok <= S - length_l[i]
            if not room.any():
                return
            b = int(np.argmin(np.where(room, v, np.inf)))
        assign[i] = b
        tok[b] += length_l[i]
        load[b] += c_l[i]

    for i in order[:exact].tolist():
        place(i)
    # Small items in rounds of K: the round's i-th largest item goes to the bin with
    # the i-th smallest load / share if it has room; misfits wait for the next round.
    # A round that places nothing ends the rounds; the exact rule takes what is left.
    pending = order[exact:]
    while pending.size:
        chunk = pending[:K]
        bins = np.argsort(load / share, kind="stable")[:chunk.size]
        fits = tok[bins] + length[chunk] <= S
        if not fits.any():
            break
        b, it = bins[fits], chunk[fits]
        assign[it] = b
        tok[b] += length[it]
        load[b] += c[it]
        pending = np.concatenate([chunk[~fits], pending[K:]])
    for i in pending.tolist():
        place(i)
    return assign


def order_ranks(fwd: np.ndarray, bwd: np.ndarray, prof: np.ndarray, rounds: int = 64,
                init: np.ndarray | None = None):
    """Order of each rank's bins: cost-rank matched to ``prof`` (or ``init``), then
    best-improvement pair swaps until no swap helps any rank (a local optimum per rank;
    ``rounds`` only bounds the loop). All ranks are evaluated in one batched
    pipeline-model call per round.

    Args:
        fwd, bwd: [R, M, pp] bin stage times of R ranks.
        init: [R, M] starting orders (default: matched to ``prof``).
    Returns:
        (orders [R, M] bin index per position, times [R] 1F1B step time per rank).
    """
    R, M = fwd.shape[:2]
    w = (fwd + bwd).max(axis=2)
    orders = np.empty((R, M), dtype=np.int64)
    orders[:, np.argsort(prof, kind="stable")] = np.argsort(w, axis=1, kind="stable")
    if init is not None:
        orders = np.array(init, dtype=np.int64)
    # One table of every rank's bins: candidates are rows of it, not copies of times.
    fr, br = fwd.reshape(R * M, -1), bwd.reshape(R * M, -1)
    best = step_ms_rows(fr, br, np.arange(R)[:, None] * M + orders)
    if M < 2:
        return orders, best
    iu, ju = np.triu_indices(M, 1)
    c = np.arange(iu.size)
    active = np.ones(R, dtype=bool)
    for _ in range(rounds):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        cand = np.repeat(orders[idx][:, None, :], iu.size, axis=1)  # [r, C, M]
        cand[:, c, iu], cand[:, c, ju] = orders[idx][:, ju], orders[idx][:, iu]
        tt = step_ms_rows(fr, br, (idx[:, None, None] * M + cand).reshape(-1, M)
                          ).reshape(idx.size, iu.size)  # [r, C]
        k = np.argmin(tt, axis=1)
        t_new = tt[np.arange(idx.size), k]
        better = t_new < best[idx] - 1e-9
        upd = idx[better]
        orders[upd] = cand[np.flatnonzero(better), k[better]]
        best[upd] = t_new[better]
        active[idx[~better]] = False
    return orders, best


def pack_sab(carried: Carried, stream: StreamCursor, ctx: PackContext) -> Packing:
    """SAB packing of one step (see the module docstring)."""
    cost = ctx.cost
    if cost is None:
        raise ValueError("strategy 'sab' needs a predictor")
    K, S, M, dp = ctx.num_bins, ctx.seq_length, ctx.micro_batches, ctx.dp
    fill = float(ctx.options.get("sab_fill", 0.9))
    hold = bool(ctx.options.get("sab_hold", True)) and not ctx.flush
    win = build_window(carried, stream, ctx, int(K * S * fill))
    const = cost.stage_const_ms().sum(axis=0)  # [pp] fwd+bwd constant per micro-batch
    perm = np.array(rank_interleaved(ctx))

    def costs(w):
        li = cost.layer_item_ms(w.length, w.doc)  # [2, n]
        st = cost.stage_item_ms(w.length, w.doc, layer_item=li)  # [pp, n]
        bott = int(np.argmax(st.sum(axis=1) + K * const))
        return li, st[bott], bott

    base = len(win)
    if hold:
        # Top the window up by the tokens that may wait, so that holding them leaves
        # short documents to fill their room (WLB-LLM tops up likewise).
        _, c, bott = costs(win)
        cand = hold_candidates(c, win, ctx, float(const[bott]))
        room = ctx.carry_cap_tokens - int(win.length[:win.n_carried].sum())
        win = extend_window(win, stream, ctx, min(int(win.length[cand].sum()), room))

    def assign_fn(w):
        li, c, bott = costs(w)
        # Typical micro-batch: the window's mean bin.
        f_typ, b_typ = cost.stage_times(li.sum(axis=1)[None, :] / K,
                                        np.array([w.length.sum() / K]))
        # The profile depends on the stage times' proportions only: quantise them (to
        # 5% of the largest) so consecutive steps share the cached search.
        scale = float(max(f_typ.max(), b_typ.max(), 1e-12))
        if ctx.options.get("sab_profile", "pipeline") == "flat":
            prof = np.ones(M)
        else:
            prof = pipeline_profile(M, tuple(np.round(f_typ[0] / scale * 20) / 20),
                                    tuple(np.round(b_typ[0] / scale * 20) / 20))
        share = np.tile(prof, dp)[perm]

        def lpt(skip=None, exact=0):
            local = _proportional_lpt(c, w.length, w.forced, share, float(const[bott]), S,
                                      exact=exact, skip=skip)
            return np.where(local >= 0, perm[np.maximum(local, 0)], -1)

        assign = (choose_holds(w, c, li, lpt, cost, ctx, prof, float(const[bott])) if hold
                  else lpt())
        return assign, (li, prof)

    win, assign, extra = settle(win, stream, ctx, assign_fn)
    # Give back the top-up the plan did not need (what it placed beyond ``sab_fill`` of
    # the step): unused, it would fill the step beyond sab_fill whenever nothing waits.
    over = int(win.length[assign >= 0].sum()) - int(K * S * fill)
    if hold and over > 0 and len(win) > base:
        tail = np.cumsum(win.length[base:][::-1])
        drop = int(np.searchsorted(tail, over, side="right"))
        if drop:
            stream.retreat(drop)
            keep = len(win) - drop
            win = Window(win.doc[:keep], win.offset[:keep], win.length[:keep], win.age[:keep],
                         win.forced[:keep], win.n_carried)
            win, assign, extra = settle(win, stream, ctx, assign_fn)
    win, assign, (li, prof) = occupy_empty_bins(win, assign, extra, stream, ctx, assign_fn)
    orders = _rebalance(cost, li, win.length, assign, ctx, prof,
                        int(ctx.options.get("sab_moves", 8)),
                        int(ctx.options.get("sab_moves_uneven", 56)))
    win, assign, li = fill_slack(win, assign, orders, li, cost, ctx, stream)
    mb_order = [r * M + int(j) for r in range(dp) for j in orders[r]]
    return finish(win, assign, ctx, mb_order)


def _rebalance(cost, li: np.ndarray, length: np.ndarray, assign: np.ndarray,
               ctx: PackContext, prof: np.ndarray, max_moves: int, uneven_moves: int = 0,
               max_items: int = 24) -> np.ndarray:
    """Order every rank, then move single items off the slowest rank while that lowers
    (step time, sum of rank times) lexicographically. Updates ``assign`` in place.

    ``max_moves`` moves at most, plus up to ``uneven_moves`` more while the slowest rank is
    more than 10% above the fastest rank: a step whose time is set by a long document
    (dense attention, M close to PP: the outlier queue could not give every replica one)
    leaves the other replicas idle, and each move shifts a short document off the slow
    replicas into that idle room. Balanced steps (most steps, and every step at large M)
    stop at ``max_moves``, so their planning time is unchanged.

    Each round evaluates every (item of the slowest rank, other bin with token room)
    move (at most ``max_items`` items, spread over the cost order) at once with the
    batched 1F1B model, keeping the bins' positions; the best move is applied if it
    improves, and the touched ranks are re-ordered at the end. Moves inside the
    slowest rank reshape its micro-batches for the pipeline; moves to other ranks
    balance ranks. Moves that cannot be the best one are not timed (:func:`_score_moves`).
    Returns ``[dp, M]`` bin (rank-local) per position.
    """
    K, M, dp, S = ctx.num_bins, ctx.micro_batches, ctx.dp, ctx.seq_length
    placed = assign >= 0
    a = assign[placed]
    layer = np.stack([np.bincount(a, weights=li[p, placed], minlength=K) for p in range(2)],
                     axis=1)  # bincount: np.add.at is ~50x slower for thousands of items
    tok = np.bincount(a, weights=length[placed], minlength=K).astype(np.int64)
    count = np.bincount(a, minlength=K)  # items per bin: a move never empties a bin
    fwd, bwd = cost.stage_times(layer, tok)
    orders, T = order_ranks(fwd.reshape(dp, M, -1), bwd.reshape(dp, M, -1), prof)
    touched: set = set()
    for it in range(max_moves + uneven_moves):
        if it >= max_moves and T.max() <= 1.1 * T.min():
            break
        r = int(np.argmax(T))
        items = np.flatnonzero((assign >= 0) & (assign // M == r))
        if items.size == 0:
            break
        if items.size > max_items:  # evenly spaced over the cost order: big and small
            by_cost = items[np.argsort(li[0, items] + li[1, items], kind="stable")]
            items = by_cost[np.linspace(0, items.size - 1, max_items).round().astype(np.int64)]
        a = assign[items]  # [n] source bins
        pos = np.empty(K, dtype=np.int64)
        for q in range(dp):
            pos[q * M + orders[q]] = np.arange(M)
        # Each source bin's [n, pp] stage times without its item.
        fa, ba = cost.stage_times(layer[a] - li[:, items].T, tok[a] - length[items])
        # Candidates are sequences of rows of one table: the K bins, then each source bin
        # without its item (K + i), then each destination bin with it (K + n + candidate).
        n1 = np.arange(items.size)
        src_seq = np.repeat((r * M + orders[r])[None], items.size, axis=0)  # [n, M]
        src_seq[n1, pos[a]] = K + n1
        # Destination bins (any other bin) with token room.
        cand_item, dst_bin = np.meshgrid(np.arange(items.size), np.arange(K), indexing="ij")
        cand_item, dst_bin = cand_item.ravel(), dst_bin.ravel()
        ok = ((dst_bin != a[cand_item]) & (tok[dst_bin] + length[items[cand_item]] <= S)
              & (count[a[cand_item]] > 1))
        cand_item, dst_bin = cand_item[ok], dst_bin[ok]
        if cand_item.size == 0:
            break
        dst_bin_fwd, dst_bin_bwd = cost.stage_times(layer[dst_bin] + li[:, items[cand_item]].T,
                                                    tok[dst_bin] + length[items[cand_item]])
        q = dst_bin // M
        same = q == r
        # Destination rank's [candidate, M] rows; for a move inside rank r both bins change.
        dst_seq = (q * M)[:, None] + orders[q]
        n2 = np.arange(cand_item.size)
        dst_seq[same] = src_seq[cand_item[same]]
        dst_seq[n2, pos[dst_bin]] = K + items.size + n2
        # A move to another rank only adds work there (no stage gets faster): its rank's
        # new time is at least the longest old path through any op of the destination
        # bin plus that op's growth (and at least T[q]).
        df, db = dst_bin_fwd - fwd[dst_bin], dst_bin_bwd - bwd[dst_bin]
        bounded = ~same & np.all((df >= 0) & (db >= 0), axis=1)
        if bounded.any():
            rank_bins = (np.arange(dp) * M)[:, None] + orders
            tl = simulate(fwd[rank_bins], bwd[rank_bins])
            path = tl.step_ms - tl.slack_ms  # [dp, 2, M, pp] longest path through each op
            p_dst = pos[dst_bin]
            grow = np.maximum(path[q, 0, p_dst] + df, path[q, 1, p_dst] + db).max(axis=1)
            # Computed otherwise than the engine's sums: a margin far above their rounding.
            lb_dst = np.maximum(T[q], grow * (1 - 1e-9))
        else:
            lb_dst = T[q]
        t_src, t_dst = _score_moves(np.concatenate([fwd, fa, dst_bin_fwd]),
                                    np.concatenate([bwd, ba, dst_bin_bwd]), src_seq, dst_seq,
                                    cand_item, q, r, T, bounded, lb_dst)
        t_src_m = np.where(same, t_dst, t_src[cand_item])
        # New step time (max over ranks) and, to break ties, the new sum of rank times.
        others = np.repeat(T[None, :], cand_item.size, axis=0)
        others[n2, r] = t_src_m
        others[n2, q] = t_dst
        new_step = others.max(axis=1)
        new_sum = others.sum(axis=1)
        k = int(np.lexsort((new_sum, new_step))[0])
        if (new_step[k], new_sum[k]) >= (T.max() - 1e-9, T.sum() - 1e-6):
            break
        i, dest = int(items[cand_item[k]]), int(dst_bin[k])
        src = int(assign[i])
        assign[i] = dest
        layer[src] -= li[:, i]
        layer[dest] += li[:, i]
        tok[src] -= length[i]
        tok[dest] += length[i]
        count[src] -= 1
        count[dest] += 1
        for j in (src, dest):
            f1, b1 = cost.stage_times(layer[j][None], tok[j:j + 1])
            fwd[j], bwd[j] = f1[0], b1[0]
        T[r], T[dest // M] = t_src_m[k], t_dst[k]
        touched.update((r, dest // M))
    # Positions were kept during the moves; re-ordering from them can only help.
    if touched:
        t = sorted(touched)
        orders[t], _ = order_ranks(fwd.reshape(dp, M, -1)[t], bwd.reshape(dp, M, -1)[t], prof,
                                   init=orders[t])
    return orders


def _score_moves(fwd_rows, bwd_rows, src_seq, dst_seq, cand_item, q, r, T, bounded, lb_dst):
    """1F1B times of the moves of :func:`_rebalance`: ``(t_src [n], t_dst [c])``, where
    ``t_dst`` is +inf for the candidates that cannot be the best move.

    The best move is the least (new step time, new sum of rank times), first candidate on
    ties. A move to another rank ``q`` that only adds work there (``bounded``) has a lower
    bound ``lb_dst`` of its rank's new time; with it in place of that time, both keys are
    lower bounds too (the same arithmetic on smaller inputs: sums and maxima are monotone,
    rounding included). Candidates are timed in chunks in the order of those bounds; a candidate
    whose bounds exceed a timed candidate's keys cannot win and is not timed. The winner
    and its times are those of timing every candidate (``tests/batching/test_sab_pinned.py``).

    Args:
        fwd_rows, bwd_rows: table of micro-batch stage times (:func:`step_ms_rows`).
        src_seq: [n, M] the slowest rank ``r`` without each item; dst_seq: [c, M] the
            destination rank of each candidate with its item (both bins changed for a
            move inside rank r); cand_item: [c] item of each candidate; q: [c] its
            destination rank; T: [dp] current rank times; bounded: [c] bool, the
            candidates that ``lb_dst`` [c] bounds (the others are all timed).
    """
    t_src = step_ms_rows(fwd_rows, bwd_rows, src_seq)
    c = cand_item.size
    n2 = np.arange(c)
    t_dst = np.full(c, np.inf)
    same = q == r
    lb = np.repeat(T[None, :], c, axis=0)
    lb[n2, r] = t_src[cand_item]
    lb[n2, q] = np.where(bounded, lb_dst, lb[n2, q])
    lb_step, lb_sum = lb.max(axis=1), lb.sum(axis=1)
    timed = ~bounded  # e.g. moves inside rank r: one bin gets lighter
    todo = np.flatnonzero(bounded)
    todo = todo[np.lexsort((todo, lb_sum[todo], lb_step[todo]))]
    first = todo[:max(T.size, 32)]
    timed[first] = True
    todo = todo[first.size:]
    while True:
        new = np.flatnonzero(timed & np.isinf(t_dst))
        if new.size:
            t_dst[new] = step_ms_rows(fwd_rows, bwd_rows, dst_seq[new])
        done = np.flatnonzero(timed)
        o = np.repeat(T[None, :], done.size, axis=0)
        o[np.arange(done.size), r] = np.where(same[done], t_dst[done], t_src[cand_item[done]])
        o[np.arange(done.size), q[done]] = t_dst[done]
        st, su = o.max(axis=1), o.sum(axis=1)
        j = int(np.lexsort((su, st))[0])
        b_step, b_sum = st[j], su[j]
        # Sums of [c, dp] and [timed, dp] rows: allow for a different summation order.
        keep = (lb_step[todo] < b_step) | ((lb_step[todo] == b_step)
                                           & (lb_sum[todo] <= b_sum * (1 + 1e-12)))
        todo = todo[keep]
        if todo.size == 0:
            return t_src, t_dst
        nxt = todo[:max(todo.size // 4, 64)]
        timed[nxt] = True
        todo = todo[nxt.size:]
