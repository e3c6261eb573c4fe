"""Lightweight attention-density estimation for the packers.

What it is for, honestly: with the project's block-level top-k routing (and with
MoBA's per-token routing, which keeps the same number of blocks per query) the kept
(query, key) pairs of a document follow exactly from its length, the block size and
the budget (``sparsebalance.pairs.kept_pairs``); the predictor already
counts them, so for those kernels this estimator learns a ratio of 1.0 and adds
nothing but a check. It matters for routings whose kept count depends on the data
(threshold / top-p block selection, per-head budgets, early-exit kernels), where the
packer must *estimate* each document's cost before the step runs.

Model: the achieved kept pairs of a document = ``ratio * kept_pairs(L, topk, B)``.
``ratio`` is a running (exponential) average per (length bucket, topk) of the
ratios the attention modules report (``sparsebalance.attention.packed.AttentionRecord``),
refined per document once that document has been seen (e.g. in the previous epoch).
Lookups are vectorised (one ``log2`` and two array gathers per window), well under
a millisecond for thousands of documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sparsebalance.pairs import kept_pairs


@dataclass
class DensityEstimatorConfig:
    """Knobs of :class:`DensityEstimator`."""

    block_size: int = 256
    """Routing block size (tokens) the model counts pairs with."""
    buckets_per_octave: int = 2
    """Length buckets per factor of two in length."""
    alpha: float = 0.1
    """Weight of a new observation in a bucket's running average."""
    doc_alpha: float = 0.5
    """Weight of a new observation in a document's running ratio."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.buckets_per_octave < 1:
            raise ValueError(f"buckets_per_octave must be >= 1, got {self.buckets_per_octave}")
        for name in ("alpha", "doc_alpha"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


_NBUCKETS = 64


@dataclass
class _Table:
    bucket: np.ndarray = field(default_factory=lambda: np.ones(_NBUCKETS * 2))
    seen: np.ndarray = field(default_factory=lambda: np.zeros(_NBUCKETS * 2, dtype=bool))
    doc: np.ndarray = field(default_factory=lambda: np.zeros(0))
    doc_seen: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


class DensityEstimator:
    """Per-length-bucket running density ratios, refined per document."""

    def __init__(self, config: Optional[DensityEstimatorConfig] = None, **kw):
        self.config = config or DensityEstimatorConfig(**kw)
        self._tables: dict = {}
        self._err: list = []

    def _table(self, topk) -> _Table:
        return self._tables.setdefault(topk, _Table())

    def _bucket(self, L: np.ndarray) -> np.ndarray:
        b = np.floor(np.log2(np.maximum(L, 1)) * self.config.buckets_per_octave).astype(np.int64)
        return np.clip(b, 0, _NBUCKETS * 2 - 1)

    def ratio(self, lengths, topk, doc_ids=None) -> np.ndarray:
        """[n] estimated achieved / modelled kept pairs (1.0 where nothing is known)."""
        L = np.asarray(lengths, dtype=np.int64)
        t = self._tables.get(topk)
        if t is None:
            return np.ones(L.size)
        r = t.bucket[self._bucket(L)]
        if doc_ids is not None and t.doc.size:
            d = np.asarray(doc_ids, dtype=np.int64)
            ok = (d >= 0) & (d < t.doc.size)
            known = np.zeros(L.size, dtype=bool)
            known[ok] = t.doc_seen[d[ok]]
            r = np.where(known, t.doc[np.where(ok, d, 0)], r)
        return r

    def kept(self, lengths, topk, doc_ids=None) -> np.ndarray:
        """[n] estimated kept (query, key) pairs per head."""
        L = np.asarray(lengths, dtype=np.int64)
        return self.ratio(L, topk, doc_ids) * kept_pairs(L, topk, self.config.block_size)

    def observe(self, lengths, topk, achieved_kept, doc_ids=None) -> None:
        """Feed back achieved kept pairs.

        Args:
            lengths: [n] document lengths of one attention call.
            topk: budget used (None = dense).
            achieved_kept: [n] per-document kept pairs, or a scalar total for the call
                (then every document of the call is credited with the call's ratio).
            doc_ids: [n] document ids (enables the per-document refinement).
        """
        L = np.asarray(lengths, dtype=np.int64).reshape(-1)
        model = kept_pairs(L, topk, self.config.block_size).astype(np.float64)
        est = self.kept(L, topk, doc_ids)
        ach = np.asarray(achieved_kept, dtype=np.float64)
        if ach.ndim == 0:
            tot = float(model.sum())
            self._err.append(abs(float(est.sum()) - float(ach)) / max(float(ach), 1.0))
            r_obs = np.full(L.size, float(ach) / tot if tot > 0 else 1.0)
            per_doc = L.size == 1
        else:
            self._err.extend((np.abs(est - ach) / np.maximum(ach, 1.0)).tolist())
            r_obs = np.where(model > 0, ach / np.maximum(model, 1.0), 1.0)
            per_doc = True
        t = self._table(topk)
        b = self._bucket(L)
        for bi, ri, w in zip(b.tolist(), r_obs.tolist(), (model / max(model.max(), 1.0)).tolist()):
            a = self.config.alpha * w
            if not t.seen[bi]:
                t.bucket[bi], t.seen[bi] = ri, True
            else:
                t.bucket[bi] += a * (ri - t.bucket[bi])
        if per_doc and doc_ids is not None:
            d = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
            if d.max() >= t.doc.size:
                n = max(int(d.max()) + 1, 2 * t.doc.size)
                t.doc = np.concatenate([t.doc, np.ones(n - t.doc.size)])
                t.doc_seen = np.concatenate([t.doc_seen, np.zeros(n - t.doc_seen.size, bool)])
            a = self.config.doc_alpha
            t.doc[d] = np.where(t.doc_seen[d], t.doc[d] + a * (r_obs - t.doc[d]), r_obs)
            t.doc_seen[d] = True

    def observe_record(self, record, doc_ids=None) -> None:
        """Feed back a ``sparsebalance.attention.packed.AttentionRecord`` (kept pairs summed over
        heads; divided by the head count implied by the causal pairs)."""
        L = np.asarray(record.doc_lengths, dtype=np.int64)
        causal = int((L * (L + 1) // 2).sum())
        heads = record.causal_pairs / causal if causal else 1.0
        self.observe(L, record.topk, record.kept_pairs / max(heads, 1e-12), doc_ids)

    def report(self) -> dict:
        """Prequential error: |estimate - achieved| / achieved before each update."""
        e = np.asarray(self._err)
        if e.size == 0:
            return {"observations": 0}
        return {"observations": int(e.size), "mean_abs_rel_err": float(e.mean()),
                "p90_abs_rel_err": float(np.quantile(e, 0.9)), "max_abs_rel_err": float(e.max())}
