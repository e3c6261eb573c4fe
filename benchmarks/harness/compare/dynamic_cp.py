"""Megatron-core's dynamic (hybrid) context parallelism, costed by the CP-aware model.

Megatron-core's ``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/
hybrid_cp_schedule.py``) gives every sub-sample its own CP size instead of one CP size
for the whole run: the number of GPUs a document needs is its length over the
per-rank token limit, rounded up to a power of two (``gpus_needed``); its workload is
estimated as ``L^2 / cp`` (``get_total_workload``); documents are placed on GPU groups
of their size so the estimated work of the GPUs is balanced, and GPUs left empty get
work by raising some document's CP size. Short documents then run on one GPU with no
K/V exchange, and only long ones pay for context parallelism.

What we model, per replica whose static layout is CP = ``c`` (``c`` GPUs per pipeline
stage, per-rank limit ``seq_length / c`` tokens, ``M`` micro-batches per step):

* each document's CP size ``k = min(c, next_pow2(ceil(L / (seq_length / c))))``;
* placement (``place``): documents by decreasing estimate ``L^2 / k`` go to the
  aligned group of ``k`` GPUs (GPUs ``g k .. g k + k - 1``) of a micro-batch whose
  most-loaded GPU is least loaded and that has room (every GPU holds at most
  ``seq_length / c`` tokens; with no room, the next power of two is tried):
  longest-processing-time greedy on Megatron's estimate.
  ``dynamic-cp`` (Megatron's scheduler owns the grouping) may move a document to any
  micro-batch of its replica. ``sparsebalance+dcp`` uses its predictor (Megatron's
  scheduler has only the estimate): per step it takes the faster at ``k0`` of (a) SAB's
  micro-batches with the CP scheduler placing documents inside each, keeping the
  static layout for a micro-batch where that is faster, and (b) the scheduler's
  regrouping of SAB's replica; DST then plans on the chosen step
  (``cluster_sim.simulate_cell``);
* cost: the document's layer time at CP ``k`` from the CP-aware predictor
  (``sparsebalance/predictor/context_parallel.py``: slowest rank's attention, its token
  share, the K/V exchange) is charged to each of its ``k`` GPUs; a micro-batch's
  layer time is its most loaded GPU's plus the per-layer constant (with the
  collective's latency when any document uses CP > 1); stage extras (embedding,
  output layer) are charged on the most loaded GPU's token share.

Left out: Megatron's scheduler pools all DP x CP GPUs (documents may move between
replicas) and has no pipeline parallelism; here the pool is one replica's CP group
and its micro-batches, so the 1F1B pipeline model still applies.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sparsebalance.pairs import kept_pairs
from sparsebalance.tuning.from_predictor import build_instance, kept_at
from sparsebalance.tuning.instance import Instance


def cp_sizes(lengths: np.ndarray, seq_length: int, cp: int) -> np.ndarray:
    """CP size of every document: ``min(cp, next power of two of L / (seq_length / cp))``.

    Args:
        lengths: [n] document lengths, tokens.
        seq_length: micro-batch capacity, tokens (the static layout's ``cp`` ranks hold
            ``seq_length / cp`` each).
        cp: the replica's CP group size (a power of two).
    """
    if cp < 1 or cp & (cp - 1):
        raise ValueError(f"dynamic CP needs a power-of-two CP size, got {cp}")
    need = np.ceil(np.asarray(lengths, dtype=np.float64) * cp / float(seq_length))
    k = 2 ** np.ceil(np.log2(np.maximum(need, 1.0)))
    return np.minimum(k.astype(np.int64), cp)


class _NoRoom(Exception):
    """No aligned GPU group has room for a document, even at the full CP size."""


def _greedy(L: np.ndarray, home: np.ndarray, M: int, seq_length: int, cp: int,
            keep_microbatches: bool) -> List[List[Tuple[int, int, int]]]:
    """LPT on Megatron's estimate with the per-rank token limit; a document with no
    room at its CP size tries the next power of two (Megatron raises CP sizes too)."""
    k = cp_sizes(L, seq_length, cp)
    est = L.astype(np.float64) ** 2 / k
    load, tok = np.zeros((M, cp)), np.zeros((M, cp))
    room = seq_length / cp
    out: List[List[Tuple[int, int, int]]] = [[] for _ in range(M)]
    for i in np.argsort(-est, kind="stable").tolist():
        rows = np.array([home[i]]) if keep_microbatches else np.arange(M)
        ki = int(k[i])
        while True:
            share = L[i] / ki
            g_load = load[rows].reshape(rows.size, cp // ki, ki).max(axis=2)
            g_tok = tok[rows].reshape(rows.size, cp // ki, ki).max(axis=2)
            fits = g_tok + share <= room + 1e-9
            if fits.any():
                break
            if ki == cp:
                raise _NoRoom
            ki *= 2
        r, g = np.unravel_index(int(np.argmin(np.where(fits, g_load, np.inf))), fits.shape)
        m = int(rows[r])
        load[m, g * ki:(g + 1) * ki] += L[i] ** 2 / ki
        tok[m, g * ki:(g + 1) * ki] += share
        out[m].append((int(L[i]), ki, int(g * ki), i))
    return out


def place(lengths: Sequence[np.ndarray], seq_length: int, cp: int,
          keep_microbatches: bool) -> List[List[Tuple[int, int, int]]]:
    """Place one replica's documents on its micro-batches and CP GPUs (module docstring).

    Every GPU holds at most ``seq_length / cp`` tokens. Where the greedy finds no room
    (fragmentation), a regrouping falls back to keeping the micro-batches, and a
    micro-batch to the static layout (every document over all ``cp`` GPUs, which always
    fits a micro-batch of at most ``seq_length`` tokens).

    Args:
        lengths: M arrays, the document lengths of each micro-batch (tokens).
        seq_length: micro-batch capacity, tokens.
        cp: GPUs of the replica's CP group (a power of two).
        keep_microbatches: documents stay in their micro-batch (else any micro-batch).

    Returns:
        Per micro-batch a list of ``(length, k, first_gpu, index)``: the document (``index``
        into the replica's documents in micro-batch order) runs on GPUs
        ``first_gpu .. first_gpu + k - 1`` with CP size ``k``.
    """
    M = len(lengths)
    arrays = [np.asarray(x, dtype=np.int64) for x in lengths]
    if not keep_microbatches:
        try:
            out = _greedy(np.concatenate(arrays), np.repeat(np.arange(M), [a.size for a in arrays]),
                          M, seq_length, cp, False)
            if all(out):
                return out
        except _NoRoom:
            pass
    out, first = [], 0
    for a in arrays:
        try:
            out.append([(n, k, g, first + i) for n, k, g, i in
                        _greedy(a, np.zeros(a.size, dtype=np.int64), 1, seq_length, cp, True)[0]])
        except _NoRoom:
            out.append([(int(x), cp, 0, first + i) for i, x in enumerate(a.tolist())])
        first += a.size
    return out


def _recost(predictors: Dict[int, object], placed: List[List[Tuple[int, int, int, int]]],
            inst: Instance, cp: int, dens: Optional[np.ndarray] = None,
            topk_min: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Forward and backward ms ``[level, dp, M, stages]`` of the placed micro-batches
    (``placed`` flat over (replica, micro-batch), in the instance's order; ``dens``: threshold
    routing's density of each placed document in that order)."""
    base = predictors[1]
    n_mb = len(placed)
    L = np.array([d[0] for mb in placed for d in mb], dtype=np.int64)
    k = np.array([d[1] for mb in placed for d in mb], dtype=np.int64)
    first = np.array([d[2] for mb in placed for d in mb], dtype=np.int64)
    mb_of = np.repeat(np.arange(n_mb), [len(mb) for mb in placed])
    # Each (document, GPU) membership: the document's cost lands on all its GPUs.
    doc_idx = np.repeat(np.arange(L.size), k)
    gpu = first[doc_idx] + (np.arange(doc_idx.size) - np.repeat(np.cumsum(k) - k, k))
    slot = mb_of[doc_idx] * cp + gpu
    tok = np.zeros(n_mb * cp)
    np.add.at(tok, slot, L[doc_idx] / k[doc_idx])
    top_tokens = tok.reshape(n_mb, cp).max(axis=1)
    kmax = np.zeros(n_mb, dtype=np.int64)
    np.maximum.at(kmax, mb_of, k)
    S = inst.stages
    layers = np.array([base.shape.layers_of(j, S) for j in range(S)], dtype=float)
    tables = []
    for phase in ("fwd", "bwd"):
        extras = np.zeros((n_mb, S))
        for j in {0, S - 1}:
            extras[:, j] = [base.extras_ms([max(int(round(t)), 1)], j, S, phase) for t in top_tokens]
        corr = np.array([base.correction(j, phase) for j in range(S)])
        const = np.array([predictors[int(c)].layer_const_ms(phase) for c in kmax])
        tab = np.empty((inst.levels.size, inst.dp, inst.microbatches, S))
        for li, topk in enumerate(inst.levels.tolist()):
            cost = np.empty(L.size)
            for c in np.unique(k).tolist():
                sel = k == c
                cost[sel] = predictors[c].layer_doc_ms(L[sel], topk, phase)
                if dens is not None:  # threshold routing: the kept pairs move the attention time
                    cost[sel] += predictors[c].pair_ms(topk, phase) * (
                        kept_at(base, L[sel], topk, dens[sel], topk_min)
                        - kept_pairs(L[sel], topk, base.block_size))
            load = np.zeros(n_mb * cp)
            np.add.at(load, slot, cost[doc_idx])
            per_layer = load.reshape(n_mb, cp).max(axis=1) + const
            tab[li] = ((per_layer[:, None] * layers + extras) * corr).reshape(
                inst.dp, inst.microbatches, S)
        if dens is not None:  # the swapped pair terms leave rounding noise across levels
            tab = np.maximum.accumulate(tab, axis=0)
        tables.append(tab)
    return tables[0], tables[1]


def dynamic_cp_instance(predictors: Dict[int, object], nested: Sequence[Sequence[Sequence[int]]],
                        seq_length: int, cp: int, *, pp: int, k0: int,
                        keep_microbatches: bool, static: Instance = None, densities=None,
                        topk_min: int = 0) -> Instance:
    """Planning instance of one packed step under dynamic CP.

    Args:
        predictors: CP size -> predictor built with that ``context_parallel_size``
            (every power of two up to ``cp``; the same model and link otherwise).
        nested: document lengths ``[dp][microbatch][doc]`` of the packed step.
        seq_length: micro-batch capacity, tokens.
        cp: the replica's CP group size.
        pp, k0: as for ``build_instance`` (its default budget levels).
        keep_microbatches: ``sparsebalance+dcp`` (keep the packer's micro-batches, and
            per micro-batch the faster of static and dynamic layout at ``k0`` by the
            predictor: ``static`` is then the step's instance under static CP = ``cp``)
            or ``dynamic-cp`` (Megatron's scheduler regroups the replica's documents).
        densities, topk_min: threshold routing's per-document densities (nested like
            ``nested``) and floor, as for ``build_instance``; placement ignores them
            (Megatron's estimate is ``L^2 / k``).

    Returns:
        An ``Instance`` over the regrouped micro-batches: retained attention from their
        documents, forward and backward op times under per-document CP sizes.
    """
    placed = [mb for rank in nested for mb in place([np.asarray(m) for m in rank], seq_length, cp,
                                                     keep_microbatches)]
    D, M = len(nested), len(nested[0])
    regrouped = [[[d[0] for d in placed[r * M + m]] for m in range(M)] for r in range(D)]
    dens = redens = None
    if densities is not None:
        per_rank = [np.concatenate([np.asarray(m, dtype=np.float64) for m in rank]) for rank in densities]
        redens = [[[per_rank[r][d[3]] for d in placed[r * M + m]] for m in range(M)] for r in range(D)]
        dens = np.array([x for rank in redens for mb in rank for x in mb])
    inst = build_instance(predictors[1], regrouped, pp=pp, k0=k0, densities=redens, topk_min=topk_min)
    fwd, bwd = _recost(predictors, placed, inst, cp, dens, topk_min)
    if keep_microbatches:
        if static is None:
            raise ValueError("keep_microbatches needs the static-CP instance")
        ki = int(np.flatnonzero(inst.levels == k0)[0])
        keep_static = (static.fwd[ki] + static.bwd[ki]).sum(axis=2) <= (fwd[ki] + bwd[ki]).sum(axis=2)
        fwd = np.where(keep_static[None, :, :, None], static.fwd, fwd)
        bwd = np.where(keep_static[None, :, :, None], static.bwd, bwd)
    return replace(inst, fwd=fwd, bwd=bwd)
