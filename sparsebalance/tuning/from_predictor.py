"""Build a planning instance from packed micro-batches and a latency predictor.

For every (replica, micro-batch, virtual stage) and every allowed budget: forward
and backward time from ``LatencyPredictor`` (``layers_of(stage) * layer_ms +
extras_ms``, times the predictor's online correction for that stage and phase,
i.e. exactly ``stage_ms``), and retained attention = layers of the stage x kept
(query, key) pairs of block top-k routing (``sparsebalance.pairs``).
For the interleaved schedule the model is split into ``pp * vpp`` chunks and
stage ``j = v * pp + rank`` is chunk ``j``. Under threshold routing (content-dependent
kept pairs) ``densities`` gives each document's density and the cap is the budget: its
kept pairs are ``sparsebalance.pairs.threshold_kept_pairs`` and its attention time moves by
the predictor's ``pair_ms`` per pair away from the top-k count. Under context parallelism
(``predictor.set_context_parallel``) the op times are those of the slowest rank of
a CP group, K/V exchange included; retained attention stays the whole model's.

TAU levels (:func:`build_tau_instance`): under threshold routing DST's lever is TAU, not the
cap. Each level is a TAU with its own per-document densities (SAB's estimator's prediction
moved to that TAU, :meth:`sparsebalance.batching.density_feedback.ThresholdDensity.densities`);
the cap (the run's top-k) is the same at every level and stays a guard.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from ..pairs import kept_pairs, threshold_kept_pairs
from .instance import Instance


def _step_docs(lengths: Sequence[Sequence[Sequence[int]]]):
    """(D, M, per-micro-batch length arrays, all lengths flat, segment starts) of a step."""
    D = len(lengths)
    if D == 0 or len({len(r) for r in lengths}) != 1 or len(lengths[0]) == 0:
        raise ValueError("lengths must be a non-empty [dp][microbatch] nesting of equal sizes")
    M = len(lengths[0])
    docs = [np.asarray(lengths[d][m], dtype=np.int64) for d in range(D) for m in range(M)]
    if any(x.ndim != 1 or len(x) == 0 for x in docs):
        raise ValueError("every micro-batch needs a non-empty list of document lengths")
    starts = np.cumsum([0] + [len(x) for x in docs[:-1]])
    return D, M, docs, np.concatenate(docs), starts


def _flat_densities(densities, flat: np.ndarray) -> Optional[np.ndarray]:
    if densities is None:
        return None
    d = np.concatenate([np.asarray(m, dtype=np.float64).reshape(-1) for r in densities for m in r])
    if d.shape != flat.shape:
        raise ValueError(f"densities has {d.size} documents, lengths {flat.size}")
    return d


def kept_at(predictor, flat: np.ndarray, k: Optional[int], dens: Optional[np.ndarray],
            topk_min: int = 0) -> np.ndarray:
    """[n] kept pairs per head of documents ``flat`` at budget ``k``: top-k's count, or under
    threshold routing (``dens`` given) the density's within the cap."""
    if dens is None or k is None:
        return kept_pairs(flat, k, predictor.block_size).astype(float)
    return threshold_kept_pairs(flat, dens, k, predictor.block_size, topk_min)


def op_ms_tables(predictor, lengths: Sequence[Sequence[Sequence[int]]], levels: Sequence[Optional[int]],
                 stages: int, densities=None, topk_min: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Calibrated forward and backward ms ``[L, dp, M, stages]`` of every op at each budget.

    ``levels[l]`` is a top-k (None: dense attention); all documents of the step go
    through one ``layer_doc_ms`` call per (phase, level). ``densities`` (nested like
    ``lengths``): threshold routing's per-document densities (module docstring).
    """
    flat = _step_docs(lengths)[3]
    dens = _flat_densities(densities, flat)
    return _tables(predictor, lengths, [(k, dens) for k in levels], stages, topk_min)


def _tables(predictor, lengths, levels: Sequence[Tuple[Optional[int], Optional[np.ndarray]]], stages: int,
            topk_min: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`op_ms_tables` for levels given as (top-k or cap, flat densities or None) pairs."""
    D, M, docs, flat, starts = _step_docs(lengths)
    threshold = any(d is not None for _, d in levels)
    layers = np.array([predictor.shape.layers_of(j, stages) for j in range(stages)], dtype=float)
    sp = predictor.sequence_parallel > 1  # padding costs nothing without it
    out = []
    for phase in ("fwd", "bwd"):
        # Extras live on the first and last (virtual) stage only (predictor interface).
        extras = np.zeros((D * M, stages))
        for j in {0, stages - 1}:
            extras[:, j] = [predictor.extras_ms(x, j, stages, phase) for x in docs]
        corr = np.array([predictor.correction(j, phase) for j in range(stages)])
        const = predictor.layer_const_ms(phase)
        tab = np.empty((len(levels), D, M, stages))
        for li, (k, dens) in enumerate(levels):
            pad = (np.array([predictor.layer_pad_ms(x, k, phase) for x in docs])  # sequence parallelism's
                   if sp else 0.0)
            doc = predictor.layer_doc_ms(flat, k, phase)
            if dens is not None and k is not None:
                doc = doc + predictor.pair_ms(k, phase) * (
                    kept_at(predictor, flat, k, dens, topk_min) - kept_pairs(flat, k, predictor.block_size))
            per_layer = np.add.reduceat(doc, starts) + pad + const
            tab[li] = ((per_layer[:, None] * layers + extras) * corr).reshape(D, M, stages)
        if threshold:  # the swapped pair terms leave rounding noise across levels
            tab = np.maximum.accumulate(tab, axis=0)
        out.append(tab)
    return out[0], out[1]


def build_instance(predictor, lengths: Sequence[Sequence[Sequence[int]]], *, pp: int, k0: int,
                   levels: Optional[Sequence[int]] = None, kmin: Optional[int] = None,
                   kmax: Optional[int] = None, schedule: str = "1f1b", vpp: int = 1,
                   p2p_ms: float = 0.0, group: Optional[int] = None,
                   weight: Optional[np.ndarray] = None, densities=None,
                   topk_min: int = 0) -> Instance:
    """Instance for document ``lengths[dp][microbatch]`` (token counts of one micro-batch).

    ``levels`` default: every integer in ``[kmin, kmax]`` (defaults ``k0 // 2``, ``2 * k0``).
    ``densities`` (nested like ``lengths``) and ``topk_min``: threshold routing (module
    docstring); the budget levels are then caps. ``weight``: [dp, microbatch] sensitivity
    weights (:attr:`Instance.weight`; None: none).
    """
    D, M, docs, flat, starts = _step_docs(lengths)
    dens = _flat_densities(densities, flat)
    S = pp * vpp
    kmin = k0 // 2 if kmin is None else int(kmin)
    kmax = 2 * k0 if kmax is None else int(kmax)
    lv = sorted(set(range(kmin, kmax + 1) if levels is None else (int(x) for x in levels))
                | {int(k0)})
    layers = np.array([predictor.shape.layers_of(j, S) for j in range(S)], dtype=float)
    fwd, bwd = op_ms_tables(predictor, lengths, lv, S, densities, topk_min)
    attn = np.empty((len(lv), D, M, S))
    for li, k in enumerate(lv):
        pairs = np.add.reduceat(kept_at(predictor, flat, k, dens, topk_min), starts)
        attn[li] = (pairs[:, None] * layers).reshape(D, M, S)
    return Instance(schedule=schedule, pp=pp, vpp=vpp, dp=D, microbatches=M, k0=int(k0),
                    kmin=kmin, kmax=kmax, levels=np.array(lv, dtype=np.int64), p2p_ms=p2p_ms,
                    group=group, fwd=fwd, bwd=bwd, attn=attn, weight=weight)


def build_tau_instance(predictor, lengths: Sequence[Sequence[Sequence[int]]], *, pp: int, cap: int,
                       tau0: float, densities: Mapping[float, object], schedule: str = "1f1b", vpp: int = 1,
                       p2p_ms: float = 0.0, group: Optional[int] = None, weight: Optional[np.ndarray] = None,
                       topk_min: int = 0) -> Instance:
    """Instance whose budget levels are threshold routing's TAUs (module docstring).

    Args:
        densities: TAU level -> per-document densities at that TAU (nested like ``lengths``);
            its keys are the levels and must include ``tau0`` (the static plan's TAU).
        cap: the top-k cap of every level (the run's ``--sb-topk``); ``topk_min`` its floor.

    A level's kept pairs are :func:`sparsebalance.pairs.threshold_kept_pairs` of its densities
    within the cap; a TAU whose densities are not above a lower TAU's (all clipped at the cap,
    say) costs and keeps what the lower one does, so the tables stay non-decreasing.
    """
    D, M, docs, flat, starts = _step_docs(lengths)
    taus = sorted(float(t) for t in densities)
    if float(tau0) not in taus:
        raise ValueError(f"the TAU levels {taus} must include the run's TAU {tau0}")
    dens = {t: _flat_densities(densities[t], flat) for t in densities}
    lv = [(int(cap), dens[t]) for t in sorted(dens, key=float)]
    S = pp * vpp
    layers = np.array([predictor.shape.layers_of(j, S) for j in range(S)], dtype=float)
    fwd, bwd = _tables(predictor, lengths, lv, S, topk_min)
    attn = np.empty((len(lv), D, M, S))
    for li, (k, d) in enumerate(lv):
        pairs = np.add.reduceat(kept_at(predictor, flat, k, d, topk_min), starts)
        attn[li] = (pairs[:, None] * layers).reshape(D, M, S)
    attn = np.maximum.accumulate(attn, axis=0)  # densities not monotone in TAU: held at the lower level's
    return Instance(schedule=schedule, pp=pp, vpp=vpp, dp=D, microbatches=M, k0=float(tau0), kmin=taus[0],
                    kmax=taus[-1], levels=np.array(taus, dtype=np.float64), p2p_ms=p2p_ms, group=group,
                    fwd=fwd, bwd=bwd, attn=attn, weight=weight, unit="tau")
