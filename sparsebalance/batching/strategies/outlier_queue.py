"""SAB's outlier queue: which expensive items wait, priced by predicted latency.

Under dense (or near-dense) attention a long document costs several times a micro-batch
of short ones, and with few micro-batches per replica (M close to PP) the 1F1B fill and
drain scale with the slowest micro-batch: one long document in a step stretches its
replica, and the step waits for the slowest replica. Long documents are cheap only in
company, when every micro-batch of the step is about as heavy (WLB-LLM's outlier queues
release them in rounds for that reason).

Here an item *may* wait (be held) when it is not forced, waiting one more step keeps it
within ``max_carry_steps``, and its cost above what its tokens would cost as short
documents is at least ``sab_hold_min`` (default 0.25) of the step's mean micro-batch.
Which ones wait is a priced choice, not a length threshold:

* price of a plan = its predicted step time (1F1B, slowest replica) + the price of
  everything it leaves waiting (held items and items that did not fit);
* price of a waiting item of bottleneck-stage cost ``c`` = ``c (M + PP - 1) / (M dp)``:
  what it adds to a step whose micro-batches are alike (1F1B runs ``M + PP - 1``
  micro-batch slots on each of ``dp`` replicas in parallel), i.e. its cost once it
  leaves with its peers. ``sab_hold_price`` scales it (default 1).

The plans compared hold the ``k`` costliest candidates, ``k = 0..n``: a step that must
take a long document anyway (forced, or many at once) takes the ones that fit under the
step time it already pays; a step of short documents holds a lone long one. ``k`` is
searched on a coarse grid refined around the best (about ten assignments a step).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from sparsebalance.batching.packing import PackContext
from sparsebalance.batching.strategies.common import Window
from sparsebalance.pipeline import step_ms


def hold_candidates(c: np.ndarray, win: Window, ctx: PackContext, mb_const: float) -> np.ndarray:
    """Items that may wait this step, costliest first.

    Args:
        c: [n] bottleneck-stage cost of each window item (ms).
        mb_const: per-micro-batch constant of that stage (ms).
    """
    if c.size == 0:
        return np.zeros(0, dtype=np.int64)
    rho = float(np.min(c / win.length))  # cost per token of the cheapest item: short documents
    excess = c - rho * win.length
    mean_bin = (c.sum() + ctx.num_bins * mb_const) / ctx.num_bins
    floor = float(ctx.options.get("sab_hold_min", 0.25)) * mean_bin
    ok = (~win.forced) & (win.age + 1 <= ctx.max_carry_steps) & (excess >= floor)
    idx = np.flatnonzero(ok)
    return idx[np.argsort(-c[idx], kind="stable")]


def choose_holds(win: Window, c: np.ndarray, li: np.ndarray, lpt: Callable, cost,
                 ctx: PackContext, prof: np.ndarray, mb_const: float) -> np.ndarray:
    """The assignment of the cheapest plan (module docstring); held items are -1.

    Args:
        c: [n] bottleneck-stage cost per item (ms); li: [2, n] one layer's fwd/bwd times.
        lpt: ``lpt(skip, exact=0) -> assign``, SAB's proportional LPT leaving out the
            items where ``skip`` is True (``exact``: items placed by the exact rule).
        prof: [M] SAB's pipeline profile (orders the bins when a plan is timed).
    """
    K, M, dp = ctx.num_bins, ctx.micro_batches, ctx.dp
    cand = hold_candidates(c, win, ctx, mb_const)[: int(ctx.options.get("sab_hold_max", 4 * dp))]
    price = (M + cost.pp - 1) / (M * dp) * float(ctx.options.get("sab_hold_price", 1.0))
    by_rank = np.argsort(prof, kind="stable")
    rr = np.arange(dp)[:, None]
    scores: dict = {}

    def skip(k: int) -> np.ndarray:
        s = np.zeros(c.size, dtype=bool)
        s[cand[:k]] = True
        return s

    def score(k: int) -> None:
        # The heavy items decide the plan's time: the exact rule for K items is enough
        # to compare plans; the chosen plan is recomputed in full below.
        a = lpt(skip(k), exact=K)
        placed = a >= 0
        if k and int(win.length[~placed].sum()) > ctx.carry_cap_tokens:
            scores[k] = np.inf
            return
        layer = np.stack([np.bincount(a[placed], weights=li[p, placed], minlength=K)
                          for p in range(2)], axis=1)
        tok = np.bincount(a[placed], weights=win.length[placed], minlength=K)
        f, b = cost.stage_times(layer, tok)
        f, b = f.reshape(dp, M, -1), b.reshape(dp, M, -1)
        orders = np.empty((dp, M), dtype=np.int64)
        orders[:, by_rank] = np.argsort((f + b).max(axis=2), axis=1, kind="stable")
        T = float(step_ms(f[rr, orders], b[rr, orders]).max())
        scores[k] = T + price * float(c[~placed].sum())

    n = cand.size
    for k in sorted({0, n} | {int(round(x)) for x in np.geomspace(1, max(n, 1), 6)}):
        score(k)
    while True:  # halve the gaps next to the best k until its neighbours are evaluated
        best = min(scores, key=lambda k: (scores[k], k))
        below = [k for k in scores if k < best]
        above = [k for k in scores if k > best]
        new = {(max(below) + best) // 2 if below else best,
               (min(above) + best + 1) // 2 if above else best} - set(scores)
        if not new:
            break
        for k in sorted(new):
            score(k)
    return lpt(skip(best))
