"""Arms of the real-model accuracy comparison (``benchmarks/real_accuracy.py``) and their pairing.

Pure pieces (numpy only): which top-k each layer of a micro-batch gets in an arm, how many
(query, key) pairs top-k routing keeps (a function of document lengths alone), the static
budgets that bracket an arm's total kept pairs, and the paired interval of a difference
over micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Arm:
    """One way to set the attention of every layer."""

    name: str
    """Report name (``dense``, ``static-k8``, ``threshold``, ``sparsebalance-pp4``...)."""
    topk: Optional[int] = None
    """Budget of every layer and micro-batch (threshold routing: the cap); None with no
    ``stage_budgets``: dense attention."""
    stage_budgets: Optional[np.ndarray] = None
    """DST's ``[micro-batch, stage]`` budgets (the driver's ``budget[0]``); overrides ``topk``."""
    threshold: Optional[float] = None
    """Threshold routing's TAU (None: top-k routing)."""
    topk_min: int = 0
    """Threshold routing's least count."""
    stage_taus: Optional[np.ndarray] = None
    """DST's ``[micro-batch, stage]`` TAUs under threshold routing (the driver's ``tau[0]``);
    overrides ``threshold``; ``topk`` stays the cap."""

    def budget(self, microbatch: int, layer: int, num_layers: int) -> Optional[int]:
        """Top-k of 1-based ``layer`` in ``microbatch`` (threshold routing: the cap; None: dense)."""
        if self.stage_budgets is None:
            return self.topk
        return int(self.stage_budgets[microbatch, stage_of(layer, num_layers, self.stage_budgets.shape[1])])

    def tau(self, microbatch: int, layer: int, num_layers: int) -> Optional[float]:
        """Threshold routing's TAU of 1-based ``layer`` in ``microbatch`` (None: top-k routing)."""
        if self.stage_taus is None:
            return self.threshold
        return float(self.stage_taus[microbatch, stage_of(layer, num_layers, self.stage_taus.shape[1])])

    def routing(self, microbatch: int, num_layers: int) -> tuple:
        """Per layer (budget, TAU, least count) in ``microbatch``: two arms with equal routings
        run the same forward."""
        out = []
        for layer in range(1, num_layers + 1):
            tau = self.tau(microbatch, layer, num_layers)
            out.append((self.budget(microbatch, layer, num_layers), tau, 0 if tau is None else self.topk_min))
        return tuple(out)


def stage_of(layer: int, num_layers: int, stages: int) -> int:
    """Pipeline stage of 1-based ``layer`` when ``num_layers`` are split over ``stages`` as
    evenly as they go (the first stages take the extra layer when the split is uneven)."""
    if not 1 <= layer <= num_layers:
        raise ValueError(f"layer {layer} is not in 1..{num_layers}")
    base, extra = divmod(num_layers, stages)
    bounds = np.cumsum([base + (s < extra) for s in range(stages)])
    return int(np.searchsorted(bounds, layer - 1, side="right"))


def topk_pairs(lengths: Sequence[int], topk: Optional[int], block_size: int) -> int:
    """(query, key) pairs block top-k routing keeps over documents of ``lengths``, one head
    (None: every causal pair)."""
    from sparsebalance.pairs import kept_pairs

    return int(np.asarray(kept_pairs(np.asarray(lengths, dtype=np.int64), topk, block_size)).sum())


def arm_pairs(arm: Arm, mb_lengths: Sequence[Sequence[int]], block_size: int, num_layers: int,
              heads: int) -> int:
    """Kept pairs of a top-k arm over micro-batches of document ``mb_lengths`` (all layers and heads)."""
    if arm.threshold is not None or arm.stage_taus is not None:
        raise ValueError("threshold routing's pairs depend on content: count them in the forward")
    return heads * sum(topk_pairs(lens, arm.budget(m, layer, num_layers), block_size)
                       for m, lens in enumerate(mb_lengths) for layer in range(1, num_layers + 1))


def bracket(target: int, pairs_of) -> tuple:
    """(k_lo, k_hi, w): integer budgets with ``pairs_of(k_lo) <= target <= pairs_of(k_hi)``
    (``k_hi = k_lo + 1``, pairs non-decreasing in k) and ``w`` the linear weight of ``k_hi``
    at ``target``; w = 0 when ``pairs_of(k_lo) == target``."""
    lo = 0
    if pairs_of(lo) > target:
        return lo, lo, 0.0
    hi = 1
    while pairs_of(hi) < target:
        lo, hi = hi, 2 * hi
        if hi > 1 << 20:
            raise ValueError(f"no budget keeps {target} pairs")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pairs_of(mid) <= target:
            lo = mid
        else:
            hi = mid
    p_lo, p_hi = pairs_of(lo), pairs_of(hi)
    if p_lo == target or p_hi == p_lo:
        return lo, lo, 0.0
    return lo, hi, (target - p_lo) / (p_hi - p_lo)


BOOTSTRAP_RESAMPLES = 4000


def paired_interval(diff: Sequence[float], weight: Sequence[float], seed: int = 0,
                    resamples: int = BOOTSTRAP_RESAMPLES) -> dict:
    """Weighted mean of per-micro-batch differences ``diff`` (weights: scored tokens) with a
    paired bootstrap over micro-batches: ``{"mean", "interval": [2.5%, 50%, 97.5%], "t_ci95",
    "n"}`` (``t_ci95``: Student-t on the unweighted differences, for reference)."""
    from benchmarks.harness.compare.heldout import t_quantile

    d, w = np.asarray(diff, dtype=float), np.asarray(weight, dtype=float)
    n = d.size
    mean = float((d * w).sum() / w.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(n, size=(resamples, n))
    boot = (d[idx] * w[idx]).sum(1) / w[idx].sum(1)
    lo, med, hi = np.percentile(boot, [2.5, 50, 97.5])
    t_ci = None
    if n >= 2:
        half = t_quantile(0.975, n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
        t_ci = [float(d.mean() - half), float(d.mean() + half)]
    return {"mean": mean, "interval": [float(lo), float(med), float(hi)], "t_ci95": t_ci, "n": int(n)}


def wilson_interval(correct: int, n: int, z: float = 1.959964) -> list:
    """[low, high] Wilson score interval (95% by default) of a proportion ``correct / n``."""
    if n < 1:
        raise ValueError("a proportion of no trials")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def paired_gap(a: Sequence[bool], b: Sequence[bool], seed: int = 0, resamples: int = BOOTSTRAP_RESAMPLES) -> dict:
    """Accuracy of ``a`` minus accuracy of ``b`` on the same prompts: ``{"gap", "interval": [2.5%, 50%,
    97.5%] of a paired bootstrap over prompts, "a_only", "b_only"}`` (prompts only one arm got right)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.size == 0:
        raise ValueError("paired_gap needs two equal, non-empty lists")
    d = x - y
    idx = np.random.default_rng(seed).integers(d.size, size=(resamples, d.size))
    lo, med, hi = np.percentile(d[idx].mean(1), [2.5, 50, 97.5])
    return {"gap": float(d.mean()), "interval": [float(lo), float(med), float(hi)],
            "a_only": int((d > 0).sum()), "b_only": int((d < 0).sum()), "n": int(d.size)}


def equal_time_entry(loss: Sequence[float], static_loss: Sequence[float], tokens: Sequence[float], pairs: float,
                     static_pairs: float, seed: int = 0) -> dict:
    """One ``equal_step_time`` cell: ``loss_minus_static`` ([2.5%, 50%, 97.5%] of the paired
    bootstrap over micro-batches of the token-weighted loss difference, nats) and
    ``pairs_over_static`` (kept pairs, measured in the forwards), with the mean, t-interval and
    per-micro-batch differences."""
    d = np.asarray(loss, dtype=float) - np.asarray(static_loss, dtype=float)
    iv = paired_interval(d, tokens, seed=seed)
    return {"loss_minus_static": iv["interval"], "pairs_over_static": float(pairs / static_pairs),
            "mean": iv["mean"], "t_ci95": iv["t_ci95"], "n": iv["n"], "per_microbatch": d.tolist()}
