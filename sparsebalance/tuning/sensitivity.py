"""Sensitivity-aware DST: among the plans of equal step time, the one whose kept pairs sit
where a pair is worth most.

A document's *sensitivity* ``s`` is the loss (nats per token) it gives up under a
reference sparse budget against dense attention (``SensitivityEstimator`` predicts it per
document; a sensitivity study measures it). First-order model: the loss a document gives up
grows linearly in the pairs dropped, calibrated at the reference budget, so a dropped pair
of document ``d`` costs ``s_d n_d / D_d`` nats (``n_d`` tokens, ``D_d`` pairs the reference
budget drops). A micro-batch runs one budget for all its documents, so its *weight* is
``w = sum_d s_d n_d / sum_d D_d``: nats per dropped (query, key) pair (per head and layer),
and the predicted loss of a plan against the static one is::

    loss_proxy = sum over ops of w_m x (attn_static - attn_plan) / layers     (nats, summed)

(:func:`loss_proxy`; ``attn`` counts pairs over the stage's layers). Maximising the weighted
kept pairs ``sum w_m x attn`` at a fixed step time is minimising it. Equal per-token
sensitivities do not give equal weights: a pair is a larger share of a short document's
attention, so under this model it is worth more there (the loss is linear in the *share* of a
document's pairs dropped); equal *weights* leave the plan as it is.

:func:`sensitivity_indices` takes any policy's plan and moves budget towards the sensitive
micro-batches *without changing what the policy planned*: the step time stays at most the
plan's and the total kept pairs at least the plan's, and the weighted pairs only grow:

1. raise into the float the plan leaves (``raise_indices``: free-float passes and
   total-float rounds, unweighted): more pairs at the same step time. The swaps keep at
   least this many pairs, so against "the plan + the same raise" the refinement only moves
   pairs, it does not add any (``benchmarks/sensitivity_sim.py`` reports both comparisons);
2. swaps (local search): one op one level down, another of a more sensitive micro-batch
   one level up, on the same replica, kept only if the replica still meets the plan's step
   time and the total pairs stay at or above step 1's. This is where the sensitive
   micro-batches get raised first (a raise step 1 gave to a less sensitive op moves to a
   more sensitive one whenever the float allows), and where the least sensitive straggler
   op is cut (a cut on a sensitive micro-batch swapped for an equally fast cut on a less
   sensitive one is such a move). Value of a swap: its gain in weighted pairs, best first;
   time is not traded (each swap must fit the same step time), so no per-millisecond
   ratio is needed. Within a fixed compute budget.

A comparison *at equal kept pairs* (``benchmarks/real_accuracy.py --sensitivity estimate``) skips
step 1 (``raise_first=False``) and holds the swaps' total within ``pairs_tol`` of the plan's
(``pairs_tol``): then the refinement only moves pairs between micro-batches and stages.

A weight may also be given per op ([D, M, S]): then a swap may move a level from a stage whose
layers pay little per dropped pair to one whose layers pay much (a stage profile,
:mod:`sparsebalance.tuning.stage_sensitivity`), by the same rule.

With no weights, or equal weights, the plan is returned as it is (the invariant the tests
hold). The anchor rule has a single answer per op and no deadline of its own; it gets the
same refinement at its own step time.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import numpy as np

from ..pairs import causal_pairs, kept_pairs
from .critical_path import _TOL, _Batch, raise_indices
from .instance import Instance
from .plan import Plan, make_plan


def microbatch_weights(lengths: Sequence[Sequence[Sequence[int]]],
                       sensitivity: Sequence[Sequence[Sequence[float]]], ref_topk: int,
                       block_size: int) -> np.ndarray:
    """[D, M] nats per dropped pair of each micro-batch (module docstring).

    Args:
        lengths: ``[dp][microbatch][document]`` tokens (a padding segment gets sensitivity 0).
        sensitivity: the same nesting: each document's loss under ``ref_topk`` (nats per token).
        ref_topk, block_size: the budget the sensitivities were measured at.

    A micro-batch whose documents the reference budget keeps whole (too short to drop a
    pair) gets the mean weight of the others (1.0 if none): its pairs barely move anyway.
    """
    D, M = len(lengths), len(lengths[0])
    num, den = np.zeros((D, M)), np.zeros((D, M))
    for r in range(D):
        for m in range(M):
            L = np.asarray(lengths[r][m], dtype=np.int64)
            s = np.asarray(sensitivity[r][m], dtype=float)
            if s.shape != L.shape:
                raise ValueError(f"micro-batch ({r}, {m}): {s.size} sensitivities for {L.size} documents")
            dropped = (causal_pairs(L) - kept_pairs(L, ref_topk, block_size)).astype(float)
            num[r, m], den[r, m] = float((s * L * (dropped > 0)).sum()), float(dropped.sum())
    w = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
    fill = float(w[den > 0].mean()) if (den > 0).any() else 1.0
    return np.where(den > 0, w, fill)


def weighted_attention(inst: Instance, idx: np.ndarray, weight: np.ndarray) -> float:
    """``sum w x attn`` of level indices ``idx`` [D, M, S] (weight [D, M] or [D, M, S])."""
    return float((inst.at(idx)[2] * inst.op_weight(weight)).sum())


def loss_proxy(inst: Instance, idx: np.ndarray, weight: np.ndarray, num_layers: int) -> float:
    """Predicted loss of ``idx`` minus that of the static plan (nats, summed over tokens;
    negative: lower loss): ``sum w_m (attn_static - attn) / num_layers``."""
    base = np.full_like(np.asarray(idx), inst.k0_index)
    return (weighted_attention(inst, base, weight) - weighted_attention(inst, idx, weight)) / num_layers


def _uniform(weight: Optional[np.ndarray]) -> bool:
    return weight is None or bool(np.all(weight == weight.flat[0]))


def sensitivity_indices(inst: Instance, idx: np.ndarray, weight: Optional[np.ndarray] = None,
                        shift_rounds: int = 8, max_moves: int = 64, budget: float = 5e6,
                        chunk: int = 1024, raise_first: bool = True,
                        pairs_tol: Optional[float] = None) -> np.ndarray:
    """Level indices [D, M, S]: ``idx`` refined towards sensitive micro-batches (module
    docstring) at its own step time and kept pairs.

    Args:
        weight: [D, M] weights, or [D, M, S] per op (default ``inst.weight``); None or
            equal: ``idx`` unchanged.
        shift_rounds: total-float rounds of the raise.
        max_moves: most swaps per replica.
        budget: the swap search stops after timing this many (op x candidate) cells
            (a share of ``budget / dp`` per replica; 5e6 is about 0.2 s of CPU).
        chunk: swaps timed per sweep, best estimated gain first.
        raise_first: step 1 (the unweighted raise into the float); False: the swaps start
            from ``idx`` itself.
        pairs_tol: None: the swaps keep the total kept pairs at or above step 1's; a
            fraction: within ``a0 x (1 -/+ pairs_tol)`` of step 1's ``a0`` (both ways, so
            that a comparison against ``idx`` is at equal kept pairs).
    """
    weight = inst.weight if weight is None else np.asarray(weight, dtype=float)
    idx = np.asarray(idx, dtype=np.int64)
    if _uniform(weight):
        return idx
    D, M, S = inst.dp, inst.microbatches, inst.stages
    one = _Batch(inst, 1, weight)
    X = idx.reshape(D, M * S).T.copy()
    t0, a0, w0 = (float(f(X)[0]) for f in (one.makespan, one.attention, one.weighted))
    # 1. Unweighted raise into the leftover float: the swaps' floor is its pairs, so all
    #    they change is where pairs sit, not how many.
    Y = X.copy()
    if raise_first:
        Y = raise_indices(inst, idx, deadline=t0, shift_rounds=shift_rounds).reshape(D, M * S).T.copy()
        a0 = max(a0, float(one.attention(Y)[0]))
    # pairs the swaps may give up overall; with pairs_tol also the most they may add
    spare, cap = (0.0, None) if pairs_tol is None else (pairs_tol * a0, 2 * pairs_tol * a0)
    for r in range(D):  # each replica gets an equal share of the compute budget
        sub = dataclasses.replace(inst, dp=1, fwd=inst.fwd[:, r:r + 1], bwd=inst.bwd[:, r:r + 1],
                                  attn=inst.attn[:, r:r + 1], weight=weight[r:r + 1])
        Y[:, r:r + 1], spare, _ = _swaps(sub, Y[:, r:r + 1], t0, spare, max_moves, budget / D, chunk, cap)
    # Guard: the refinement is kept only if it does what it promises.
    t, a, w = (float(f(Y)[0]) for f in (one.makespan, one.attention, one.weighted))
    tol = _TOL * max(t0, 1.0)
    lo, hi = (a0 * (1 - _TOL), np.inf) if pairs_tol is None else (a0 * (1 - pairs_tol - _TOL),
                                                                  a0 * (1 + pairs_tol + _TOL))
    if t <= t0 + tol and lo <= a <= hi and w >= w0:
        return Y.T.reshape(D, M, S)
    return idx


def _swaps(sub: Instance, X: np.ndarray, deadline: float, spare: float, max_moves: int,
           budget: float, chunk: int, cap: Optional[float] = None):
    """Swap search on one replica (``sub``: dp 1) from X [MS, 1] that may give up ``spare``
    pairs (and, with ``cap``, hold at most ``cap`` spare): (X, pairs still spare, cells spent)."""
    one = _Batch(sub, 1, sub.weight)
    A, W = one.Ar[:, :, 0], one.Wr[:, :, 0]  # [L, MS]
    L, MS = A.shape
    wt = sub.op_weight()[0].reshape(-1)  # [MS] weight of each op
    cells, spent = one.g.num_nodes, 0.0
    ms = np.arange(MS)
    for _ in range(max_moves):
        x = X[:, 0]
        up = x < L - 1
        down = x > 0
        ga = np.where(up, A[np.minimum(x + 1, L - 1), ms] - A[x, ms], 0.0)   # pairs of one level up
        gw = np.where(up, W[np.minimum(x + 1, L - 1), ms] - W[x, ms], 0.0)
        la = np.where(down, A[x, ms] - A[np.maximum(x - 1, 0), ms], 0.0)    # pairs of one level down
        lw = np.where(down, W[x, ms] - W[np.maximum(x - 1, 0), ms], 0.0)
        i, j = np.nonzero(down[:, None] & up[None, :] & (wt[:, None] < wt[None, :]))
        dA, dW = ga[j] - la[i], gw[j] - lw[i]
        ok = (dA >= -spare - _TOL * max(abs(spare), 1.0)) & (dW > 0)
        if cap is not None:
            ok &= spare + dA <= cap + _TOL * max(cap, 1.0)
        i, j, dA, dW = i[ok], j[ok], dA[ok], dW[ok]
        order = np.argsort(-dW, kind="stable")
        moved = False
        for start in range(0, len(order), chunk):
            sel = order[start:start + chunk]
            if spent + len(sel) * cells > budget:
                return X, spare, spent
            spent += len(sel) * cells
            cand = np.repeat(X, len(sel), axis=1)
            cols = np.arange(len(sel))
            cand[i[sel], cols] -= 1
            cand[j[sel], cols] += 1
            span = _Batch(sub, len(sel)).makespan(cand)
            fit = np.flatnonzero(span <= deadline * (1 + _TOL))
            if len(fit):
                k = fit[0]  # sel is sorted by weighted gain
                X, spare = cand[:, k:k + 1].copy(), spare + float(dA[sel[k]])
                moved = True
                break
        if not moved:
            break
    return X, spare, spent


def sensitivity_plan(inst: Instance, plan: Plan, weight: Optional[np.ndarray] = None) -> Plan:
    """``plan`` refined by :func:`sensitivity_indices` (policy name gets ``+sensitivity``)."""
    idx = inst.indices(plan.budget)
    out = sensitivity_indices(inst, idx, weight)
    if out is idx:
        return plan
    return make_plan(inst, out, f"{plan.policy}+sensitivity")


def plan_tables(predictor, lengths: Sequence[Sequence[Sequence[int]]],
                sensitivity: Sequence[Sequence[Sequence[float]]], *, pp: int, k0: int, ref_topk: int,
                eps: float = 0.0, **instance_kw) -> Dict[str, np.ndarray]:
    """The budget tables of one step of micro-batches for an accuracy harness.

    Args:
        predictor: latency predictor (``sparsebalance.predictor.get_predictor``).
        lengths: ``[dp][microbatch][document]`` tokens.
        sensitivity: the same nesting, each document's loss (nats per token) under
            ``ref_topk`` at the predictor's block size (estimated or measured).
        pp, k0: pipeline ranks and static budget; ``instance_kw``: more of
            :func:`~sparsebalance.tuning.from_predictor.build_instance` (vpp, schedule, levels, ...).

    Returns:
        ``{"static", "slack-only", "sensitivity"}`` -> ``[dp, M, stages]`` int tables (as
        :func:`budget_tables`), and ``"weight"`` -> the ``[dp, M]`` weights.
    """
    from .from_predictor import build_instance

    w = microbatch_weights(lengths, sensitivity, ref_topk, predictor.block_size)
    inst = build_instance(predictor, lengths, pp=pp, k0=k0, weight=w, **instance_kw)
    return {**budget_tables(inst, w, eps), "weight": w}


def budget_tables(inst: Instance, weight: np.ndarray, eps: float = 0.0) -> Dict[str, np.ndarray]:
    """The budget table ``[D, M, S]`` of each policy on one step: ``static``,
    ``slack-only`` (the critical-path plan) and ``sensitivity`` (it, refined by ``weight``
    [D, M]). What an accuracy harness runs the same micro-batches under."""
    from .critical_path import critical_path_indices

    base = critical_path_indices(inst, eps)
    sens = sensitivity_indices(inst, base, weight)
    return {"static": inst.budgets(np.full_like(base, inst.k0_index)), "slack-only": inst.budgets(base),
            "sensitivity": inst.budgets(sens)}
