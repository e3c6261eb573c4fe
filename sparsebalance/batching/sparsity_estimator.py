"""A document's attention density predicted before it is seen, from its source and length.

Under threshold routing (``sparsebalance.ops.plan.RoutingRule``) the key blocks a
query block keeps follow the content, so two documents of equal length cost
differently. A packer has to guess a document's density (kept / causal (query, key)
pairs) before the step that runs it; :class:`SparsityEstimator` guesses it from what
was measured on earlier documents:

1. the mean density of earlier documents of the same source and length bucket;
2. else the mean of the same length bucket over every source;
3. else the mean of the same source over every length;
4. else the mean of everything seen, else ``prior``.

Length buckets are ``floor(buckets_per_octave * log2(L))`` (``L`` in tokens). The
estimator is updated online with :meth:`SparsityEstimator.update` (one measured
document) or :meth:`SparsityEstimator.update_microbatch` (a micro-batch measured as a
whole, as the attention records report it) and costs a dictionary lookup per document.

The cost it feeds is the attention-pair proxy :func:`attention_cost`: ``density x
L (L + 1) / 2`` summed over a micro-batch's documents (per head; kernel overheads
are not modelled). The module also holds the spread statistics the sparsity study
reports (:func:`cv`, :func:`cv_within_buckets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np


def length_bucket(length: int, buckets_per_octave: int = 1) -> int:
    """``floor(buckets_per_octave * log2(length))`` (lengths below 1 count as 1)."""
    return int(math.floor(buckets_per_octave * math.log2(max(int(length), 1)) + 1e-9))


def causal_pairs(length: int) -> int:
    """Causal (query, key) pairs of one head over a document of ``length`` tokens."""
    L = int(length)
    return L * (L + 1) // 2


def attention_cost(densities: Iterable[float], lengths: Iterable[int]) -> float:
    """Attention-pair cost proxy of a micro-batch: ``sum density x L (L + 1) / 2``."""
    return float(sum(float(d) * causal_pairs(L) for d, L in zip(densities, lengths)))


def cv(values: Sequence[float]) -> Optional[float]:
    """Coefficient of variation (population std / mean); None for fewer than 2 values or mean 0."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2 or x.mean() == 0:
        return None
    return float(x.std() / x.mean())


def mape(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Mean absolute percentage error of ``predicted`` against ``actual`` (> 0), as a fraction."""
    p, a = np.asarray(predicted, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    if p.shape != a.shape or a.size == 0 or (a <= 0).any():
        raise ValueError("mape needs equally many predictions and positive actual values")
    return float(np.mean(np.abs(p - a) / a))


def cv_within_buckets(lengths: Sequence[int], values: Sequence[float], buckets_per_octave: int = 1,
                      min_docs: int = 2) -> dict:
    """Spread of ``values`` among documents of about equal length.

    Documents are grouped by :func:`length_bucket`; each group of at least ``min_docs``
    gets its CV. Returns ``{"cv": document-weighted mean of the groups' CVs (None when no
    group qualifies), "docs": documents in qualifying groups, "buckets": {lo_tokens: {"docs",
    "mean", "cv"}}}`` where ``lo_tokens`` is the bucket's lower edge in tokens.
    """
    groups: dict = {}
    for L, v in zip(lengths, values):
        groups.setdefault(length_bucket(L, buckets_per_octave), []).append(float(v))
    buckets, num, den = {}, 0.0, 0
    for b in sorted(groups):
        vals = groups[b]
        c = cv(vals) if len(vals) >= min_docs else None
        lo = int(math.ceil(2.0 ** (b / buckets_per_octave)))
        buckets[lo] = {"docs": len(vals), "mean": float(np.mean(vals)), "cv": c}
        if c is not None:
            num += c * len(vals)
            den += len(vals)
    return {"cv": num / den if den else None, "docs": den, "buckets": buckets}


@dataclass
class _Mean:
    total: float = 0.0
    count: float = 0.0

    def add(self, value: float, weight: float) -> None:
        self.total += value * weight
        self.count += weight

    @property
    def mean(self) -> float:
        return self.total / self.count


@dataclass
class SparsityEstimator:
    """Density of a document from its (source, length), learnt from measured documents."""

    buckets_per_octave: int = 1
    """Length buckets per factor of two in length."""
    prior: float = 1.0
    """Density predicted before anything is measured (1.0: dense, the safe guess)."""
    min_count: int = 1
    """Measured documents a (source, bucket) or bucket cell needs before it is used."""
    _cells: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.buckets_per_octave, bool) or int(self.buckets_per_octave) < 1:
            raise ValueError(f"buckets_per_octave must be >= 1, got {self.buckets_per_octave!r}")
        if not 0.0 < float(self.prior) <= 1.0:
            raise ValueError(f"prior must be in (0, 1], got {self.prior!r}")
        if int(self.min_count) < 1:
            raise ValueError(f"min_count must be >= 1, got {self.min_count!r}")

    def _keys(self, source: Optional[str], length: int) -> list:
        b = length_bucket(length, self.buckets_per_octave)
        return [("sb", source, b), ("b", None, b), ("s", source, None), ("all", None, None)]

    def update(self, source: Optional[str], length: int, density: float, weight: float = 1.0) -> None:
        """Fold in one measured document (``density`` = kept / causal pairs, in [0, 1])."""
        if not 0.0 <= float(density) <= 1.0 + 1e-9:
            raise ValueError(f"density must be in [0, 1], got {density!r}")
        for key in self._keys(source, length):
            self._cells.setdefault(key, _Mean()).add(float(density), float(weight))

    def update_microbatch(self, sources: Sequence[Optional[str]], lengths: Sequence[int], kept: float,
                          causal: float) -> None:
        """Fold in a micro-batch measured as a whole, e.g. from the attention records
        (``sparsebalance.attention.packed.AttentionRecord``: ``kept_pairs`` and ``causal_pairs`` summed
        over its documents and heads, and over layers when several records are added up).

        Each document is taken at its current prediction scaled so that the micro-batch's
        predicted kept pairs equal the measured ones (clipped to 1), weighted by its share of
        the causal pairs; a micro-batch of one document is an exact :meth:`update`.
        """
        if causal <= 0 or not 0.0 <= kept <= causal * (1 + 1e-9):
            raise ValueError(f"need 0 <= kept <= causal and causal > 0, got {kept!r} and {causal!r}")
        pairs = [causal_pairs(L) for L in lengths]
        total = float(sum(pairs))
        if total == 0:
            return
        pred = [self.predict(s, L) for s, L in zip(sources, lengths)]
        predicted = sum(p * c for p, c in zip(pred, pairs)) / total
        scale = (kept / causal) / predicted if predicted > 0 else 0.0
        for s, L, p, c in zip(sources, lengths, pred, pairs):
            self.update(s, L, min(1.0, p * scale), weight=c / total)

    def predict(self, source: Optional[str], length: int) -> float:
        """Predicted density of a document not yet seen (the first populated level above)."""
        for key in self._keys(source, length):
            cell = self._cells.get(key)
            if cell is not None and cell.count >= self.min_count:
                return cell.mean
        return float(self.prior)

    def predict_cost(self, sources: Sequence[Optional[str]], lengths: Sequence[int]) -> float:
        """Predicted :func:`attention_cost` of a micro-batch holding these documents."""
        return attention_cost((self.predict(s, L) for s, L in zip(sources, lengths)), lengths)


class LengthOnlyEstimator(SparsityEstimator):
    """The same estimator blind to sources (a length-only balancer's view)."""

    def update(self, source, length, density, weight=1.0) -> None:
        super().update(None, length, density, weight)

    def predict(self, source, length) -> float:
        return super().predict(None, length)
