"""Summaries of packed steps: imbalance, predicted time per token and its lower bound."""

from __future__ import annotations

import numpy as np

from sparsebalance.batching.packing import StepPacking
from sparsebalance.pipeline import step_ms


def _ratio(x: np.ndarray) -> float:
    m = float(np.mean(x))
    return float(np.max(x)) / m if m > 0 else 1.0


def summarize(packings: list, carried_docs: int, seq_length: int) -> dict:
    """Summary of a run of packings that carry predicted times.

    ``capacity_use`` = real tokens / (steps x dp x M x ``seq_length``) (fraction);
    ``empty_microbatches`` = micro-batches without a token, per step (mean);
    ``imbalance_rank`` / ``imbalance_microbatch`` are max/mean per step, averaged over
    steps; ``predicted_ms_per_ktok`` = total predicted step time / real tokens x 1000;
    ``lower_bound_ms_per_ktok`` replaces, in every step, each micro-batch's per-stage
    times by the step's mean micro-batch (every rank then equal), i.e. the floor for
    any packer of the same documents into the same number of steps.
    """
    if not packings or packings[0].rank_ms is None:
        raise ValueError("packings must be non-empty and carry predicted times")
    tokens = sum(p.tokens for p in packings)
    planned_ms = np.array([p.step_ms for p in packings])
    lb = []
    for p in packings:
        dp, M, pp = p.stage_fwd_ms.shape
        f = np.broadcast_to(p.stage_fwd_ms.reshape(dp * M, pp).mean(axis=0), (1, M, pp))
        b = np.broadcast_to(p.stage_bwd_ms.reshape(dp * M, pp).mean(axis=0), (1, M, pp))
        lb.append(float(step_ms(f, b)[0]))
    per_ktok = float(planned_ms.sum()) / tokens * 1e3 if tokens else 0.0
    return {
        "imbalance_rank": float(np.mean([_ratio(p.rank_ms) for p in packings])),
        "imbalance_microbatch": float(np.mean([_ratio(p.microbatch_ms.ravel()) for p in packings])),
        "predicted_step_ms": float(planned_ms.mean()),
        "tokens": int(tokens),
        "capacity_use": tokens / sum(p.stage_fwd_ms.shape[0] * p.stage_fwd_ms.shape[1] * seq_length
                                     for p in packings),
        "empty_microbatches": float(np.mean([sum(not mb for r in p.ranks for mb in r)
                                             for p in packings])),
        "predicted_ms_per_ktok": per_ktok,
        "lower_bound_ms_per_ktok": float(np.sum(lb)) / tokens * 1e3 if tokens else 0.0,
        "carried_docs": int(carried_docs),
        "pack_ms": float(np.mean([p.pack_ms for p in packings])),
    }


def packing_json(p: StepPacking) -> dict:
    """One step as JSON: segments per rank and micro-batch, predicted times."""
    out = {"ranks": [[[list(map(int, s)) for s in mb] for mb in r] for r in p.ranks]}
    if p.rank_ms is not None:
        out["predicted_ms"] = {"microbatch": np.round(p.microbatch_ms, 4).tolist(),
                               "rank": np.round(p.rank_ms, 4).tolist()}
    return out


def headroom_share(ms: float, lower_bound: float, baseline_ms: float) -> float:
    """Share of the gap between the baseline and this strategy's lower bound that the
    strategy closes: (baseline - ms) / (baseline - lower_bound)."""
    gap = baseline_ms - lower_bound
    return (baseline_ms - ms) / gap if gap > 0 else 0.0
