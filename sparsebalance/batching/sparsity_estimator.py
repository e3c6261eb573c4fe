"""A document's attention density predicted before it is seen, from its source, its length
and its text's compression ratio.

Under threshold routing (``sparsebalance.ops.plan.RoutingRule``) the key blocks a
query block keeps follow the content, so two documents of equal length cost
differently. A packer has to guess a document's density (kept / causal (query, key)
pairs) before the step that runs it; :class:`SparsityEstimator` guesses it from what
was measured on earlier documents:

1. the mean density of earlier documents of the same source and length bucket;
2. else the mean of the same length bucket over every source;
3. else the mean of the same source over every length;
4. else the mean of everything seen, else ``prior``;

refined by two slopes of log density fitted within the finest cells and shared by all:
one on ``log2`` length (within a bucket, and to carry a coarser level to lengths it has
not seen) and one on the compression ratio (zlib compressed / raw bytes of the text,
when the document has one). :class:`LengthOnlyEstimator` is the same without sources
or ratios: what a length-only balancer can know.

Length buckets are ``floor(buckets_per_octave * log2(L))`` (``L`` in tokens). The
estimator is updated online with :meth:`SparsityEstimator.update` /
:meth:`~SparsityEstimator.update_many` (measured documents) or
:meth:`SparsityEstimator.update_microbatch` (a micro-batch measured as a whole, as the
attention records report it); its state is sums per cell (``state_dict``), and a
prediction costs one grouped lookup per distinct (source, bucket). In training it sits
behind SAB's cost model through :mod:`sparsebalance.batching.density_feedback`.

The cost it feeds is the attention-pair proxy :func:`attention_cost`: ``density x
L (L + 1) / 2`` summed over a micro-batch's documents (per head; kernel overheads
are not modelled); :func:`heldout_microbatch_mape` is the held-out error of that cost
per micro-batch. The module also holds the spread statistics the sparsity study
reports (:func:`cv`, :func:`cv_within_buckets`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Optional, Sequence

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


_SUMS = ("count", "total", "al", "ay", "all_", "aly",
         "bw", "bd", "bl", "bc", "by", "bll", "blc", "bcc", "bly", "bcy")
"""Sums of a cell, each weighted: ``count``, ``total`` (density) over every document; ``a*``:
log2 length ``l`` and log density ``y`` moments over every document; ``b*``: the same plus
the compression ratio ``c`` over the documents that came with one."""


@dataclass
class _Cell:
    """Weighted sums of one cell (``_SUMS``)."""

    count: float = 0.0
    total: float = 0.0
    al: float = 0.0
    ay: float = 0.0
    all_: float = 0.0
    aly: float = 0.0
    bw: float = 0.0
    bd: float = 0.0
    bl: float = 0.0
    bc: float = 0.0
    by: float = 0.0
    bll: float = 0.0
    blc: float = 0.0
    bcc: float = 0.0
    bly: float = 0.0
    bcy: float = 0.0

    def add(self, sums: Sequence[float]) -> None:
        for name, v in zip(_SUMS, sums):
            setattr(self, name, getattr(self, name) + float(v))

    @property
    def mean(self) -> float:
        return self.total / self.count

    def scatter_a(self) -> tuple:
        """Within-cell (S_ll, S_ly) over every document."""
        if self.count <= 0:
            return 0.0, 0.0
        return (self.all_ - self.al * self.al / self.count, self.aly - self.al * self.ay / self.count)

    def scatter_b(self) -> tuple:
        """Within-cell 2x2 scatter of (l, c) and its co-scatter with y, over the documents
        with a compression ratio."""
        w = self.bw
        if w <= 0:
            return np.zeros((2, 2)), np.zeros(2)
        sxx = np.array([[self.bll - self.bl * self.bl / w, self.blc - self.bl * self.bc / w],
                        [self.blc - self.bl * self.bc / w, self.bcc - self.bc * self.bc / w]])
        sxy = np.array([self.bly - self.bl * self.by / w, self.bcy - self.bc * self.by / w])
        return sxx, sxy


def _sums(density: np.ndarray, weight: np.ndarray, lengths: np.ndarray,
          compression: Optional[np.ndarray], floor: float = 1e-6) -> np.ndarray:
    """[n, len(_SUMS)] per-document contributions to the sums of :class:`_Cell` (``density``:
    the estimated quantity; its log is taken at ``floor`` or above)."""
    d, w = density.astype(np.float64), weight.astype(np.float64)
    lg = np.log2(np.maximum(lengths.astype(np.float64), 1.0))
    y = np.log(np.maximum(d, floor))
    out = np.zeros((d.size, len(_SUMS)))
    out[:, :6] = np.stack([w, w * d, w * lg, w * y, w * lg * lg, w * lg * y], axis=1)
    if compression is not None:
        c = compression.astype(np.float64)
        has = np.isfinite(c)
        c = np.where(has, c, 0.0)
        v = np.where(has, w, 0.0)
        out[:, 6:] = np.stack([v, v * d, v * lg, v * c, v * y, v * lg * lg, v * lg * c, v * c * c,
                               v * lg * y, v * c * y], axis=1)
    return out


@dataclass(frozen=True)
class SourceCodes:
    """Source tags of many documents as integer codes into ``names`` (-1: untagged): what a
    caller that predicts for the same documents again and again encodes once."""

    codes: np.ndarray
    names: np.ndarray

    @classmethod
    def encode(cls, sources: Sequence[Optional[str]]) -> "SourceCodes":
        src = np.asarray(list(sources), dtype=object)
        none = np.array([x is None for x in src], dtype=bool)
        names, codes = np.unique(np.where(none, "", src).astype(str), return_inverse=True)
        return cls(np.where(none, -1, codes.reshape(-1)).astype(np.int64), names)

    def __getitem__(self, idx) -> "SourceCodes":
        return SourceCodes(self.codes[idx], self.names)

    def __len__(self) -> int:
        return int(self.codes.size)


def _groups(sources, buckets: np.ndarray):
    """``((source, bucket), indices)`` for every distinct (source, bucket) of the documents
    (vectorised: one sort, no per-document Python work); ``sources`` names or
    :class:`SourceCodes`."""
    enc = sources if isinstance(sources, SourceCodes) else SourceCodes.encode(sources)
    if enc.codes.size != buckets.size:
        raise ValueError(f"{enc.codes.size} sources for {buckets.size} lengths")
    if enc.codes.size == 0:
        return
    names, codes = enc.names, enc.codes + 1
    span = int(buckets.max() - buckets.min()) + 1
    keys, inv = np.unique(codes * span + (buckets - buckets.min()), return_inverse=True)
    order = np.argsort(inv.reshape(-1), kind="stable")
    bounds = np.searchsorted(inv.reshape(-1)[order], np.arange(keys.size + 1))
    for g, key in enumerate(keys.tolist()):
        code, b = divmod(key, span)
        yield ((None if code == 0 else str(names[code - 1])), int(b + buckets.min())), order[bounds[g]:bounds[g + 1]]


@dataclass
class SparsityEstimator:
    """Density of a document from its (source, length) and, optionally, its text's compression
    ratio, learnt online from measured documents.

    A cell's mean density is refined by two slopes shared by every cell, fitted on the
    deviations from each finest cell's own means (a pooled within-cell regression of log
    density): one on ``log2(length)`` (a bucket spans a factor of two in length; the same
    slope moves a coarser level's mean to lengths it has not seen) and one on the
    compression ratio ``c`` (zlib compressed / raw bytes of the document's text, about
    (0, 1]: low for repetitive text)::

        density = cell mean x exp(b_l (log2 L - cell mean) + b_c (c - cell mean))

    Slopes refine a cell's mean, never replace it; with fewer than ``min_slope_docs``
    documents in the finest cells (or no spread within them) a slope is 0. Documents
    without a ratio use the length slope alone (fitted over every document).
    """

    buckets_per_octave: int = 1
    """Length buckets per factor of two in length."""
    prior: float = 1.0
    """Density predicted before anything is measured (1.0: dense, the safe guess)."""
    min_count: int = 1
    """Measured documents a (source, bucket) or bucket cell needs before it is used."""
    use_compression: bool = True
    """Refine a cell's mean by the document's compression ratio when one is given."""
    min_slope_docs: int = 8
    """Documents with a compression ratio the pooled slope needs before it is used."""
    uses_source: ClassVar[bool] = True
    floor: ClassVar[float] = 1e-6
    """Smallest value predicted (and where the log of the slopes is taken)."""
    ceiling: ClassVar[float] = 1.0
    """Largest value predicted (a density is at most 1)."""
    _cells: dict = field(default_factory=dict, repr=False)
    _slope_cache: Optional[tuple] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.buckets_per_octave, bool) or int(self.buckets_per_octave) < 1:
            raise ValueError(f"buckets_per_octave must be >= 1, got {self.buckets_per_octave!r}")
        if not 0.0 < float(self.prior) <= self.ceiling:
            raise ValueError(f"prior must be in (0, {self.ceiling:g}], got {self.prior!r}")
        if int(self.min_count) < 1:
            raise ValueError(f"min_count must be >= 1, got {self.min_count!r}")
        if int(self.min_slope_docs) < 2:
            raise ValueError(f"min_slope_docs must be >= 2, got {self.min_slope_docs!r}")

    def _keys(self, source: Optional[str], bucket: int) -> list:
        source = source if self.uses_source else None
        if not self.uses_source:
            return [("b", None, bucket), ("all", None, None)]
        return [("sb", source, bucket), ("b", None, bucket), ("s", source, None), ("all", None, None)]

    # -- updates ---------------------------------------------------------------------------
    def update(self, source: Optional[str], length: int, density: float, weight: float = 1.0,
               compression: Optional[float] = None) -> None:
        """Fold in one measured document (``density`` = kept / causal pairs, in [0, 1];
        ``compression``: its compression ratio, None if unknown)."""
        self.update_many([source], [length], [density], [weight],
                         None if compression is None else [compression])

    def update_many(self, sources: Sequence[Optional[str]], lengths: Sequence[int],
                    densities: Sequence[float], weights: Optional[Sequence[float]] = None,
                    compressions: Optional[Sequence[float]] = None) -> None:
        """Fold in many measured documents at once (one sum per cell touched; NaN in
        ``compressions`` = unknown ratio)."""
        d = self._measured(np.asarray(densities, dtype=np.float64).reshape(-1))
        w = np.ones_like(d) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        c = None
        if compressions is not None and self.use_compression:
            c = np.asarray([np.nan if x is None else x for x in compressions], dtype=np.float64)
        contrib = _sums(d, w, np.asarray(lengths).reshape(-1), c, self.floor)
        for (s, b), idx in _groups(sources, self._buckets(lengths)):
            add = contrib[idx].sum(axis=0)
            for key in self._keys(s, b):
                self._cells.setdefault(key, _Cell()).add(add)
        self._slope_cache = None

    def update_microbatch(self, sources: Sequence[Optional[str]], lengths: Sequence[int], kept: float,
                          causal: float, compressions: Optional[Sequence[float]] = None) -> None:
        """Fold in a micro-batch measured as a whole, e.g. from the attention records
        (``sparsebalance.attention.packed.AttentionRecord``: ``kept_pairs`` and ``causal_pairs`` summed
        over its documents and heads, and over layers when several records are added up).

        Each document is taken at its current prediction scaled so that the micro-batch's
        predicted kept pairs equal the measured ones (clipped to 1), weighted by its share of
        the causal pairs; a micro-batch of one document is an exact :meth:`update`.
        """
        if causal <= 0 or not 0.0 <= kept <= causal * (1 + 1e-9):
            raise ValueError(f"need 0 <= kept <= causal and causal > 0, got {kept!r} and {causal!r}")
        pairs = np.array([causal_pairs(L) for L in lengths], dtype=np.float64)
        total = float(pairs.sum())
        if total == 0:
            return
        pred = self.predict_many(sources, lengths, compressions)
        predicted = float((pred * pairs).sum()) / total
        scale = (kept / causal) / predicted if predicted > 0 else 0.0
        self.update_many(sources, lengths, np.minimum(1.0, pred * scale), pairs / total, compressions)

    def _measured(self, d: np.ndarray) -> np.ndarray:
        """Measured values as folded in: densities must lie in [0, 1] (ValueError)."""
        if d.size and (d.min() < 0.0 or d.max() > 1.0 + 1e-9):
            raise ValueError(f"density must be in [0, 1], got {d.min() if d.min() < 0 else d.max()!r}")
        return np.minimum(d, 1.0)

    # -- predictions -------------------------------------------------------------------------
    def _buckets(self, lengths) -> np.ndarray:
        L = np.maximum(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0)
        return np.floor(self.buckets_per_octave * np.log2(L) + 1e-9).astype(np.int64)

    def slopes(self) -> dict:
        """The pooled within-cell slopes of log density: ``{"length": b (per doubling, over
        every document), "with_ratio": (b_l, b_c) or None (documents with a compression
        ratio)}``; 0 / None until ``min_slope_docs`` documents were measured."""
        if self._slope_cache is None:
            fine = "sb" if self.uses_source else "b"
            cells = [c for k, c in self._cells.items() if k[0] == fine]
            n = sum(c.count for c in cells)
            sll = sum(c.scatter_a()[0] for c in cells)
            sly = sum(c.scatter_a()[1] for c in cells)
            b_l = sly / sll if n >= self.min_slope_docs and sll > 1e-9 * n else 0.0
            both = None
            nb = sum(c.bw for c in cells)
            if self.use_compression and nb >= self.min_slope_docs:
                sxx = sum((c.scatter_b()[0] for c in cells), np.zeros((2, 2)))
                sxy = sum((c.scatter_b()[1] for c in cells), np.zeros(2))
                if sxx[1, 1] > 1e-12 * nb:
                    # ridge of 1e-9 of the trace: a cell set with no length spread still solves
                    beta = np.linalg.solve(sxx + 1e-9 * np.trace(sxx) * np.eye(2), sxy)
                    both = (float(beta[0]), float(beta[1]))
            self._slope_cache = {"length": float(b_l), "with_ratio": both}
        return self._slope_cache

    def slope(self) -> float:
        """The compression ratio's slope of log density (0 while there is none)."""
        both = self.slopes()["with_ratio"]
        return 0.0 if both is None else both[1]

    def _cell(self, source: Optional[str], bucket: int) -> Optional[_Cell]:
        for key in self._keys(source, bucket):
            cell = self._cells.get(key)
            if cell is not None and cell.count >= self.min_count:
                return cell
        return None

    def predict(self, source: Optional[str], length: int, compression: Optional[float] = None) -> float:
        """Predicted density of a document not yet seen: the first populated level of
        (source, bucket), bucket, source, everything, refined by its compression ratio."""
        return float(self.predict_many([source], [length], None if compression is None else [compression])[0])

    def predict_many(self, sources: Sequence[Optional[str]], lengths: Sequence[int],
                     compressions: Optional[Sequence[float]] = None) -> np.ndarray:
        """[n] predicted densities (one cell lookup per distinct (source, bucket)); NaN or
        None in ``compressions`` = unknown ratio."""
        b = self._buckets(lengths)
        lg = np.log2(np.maximum(np.asarray(lengths, dtype=np.float64).reshape(-1), 1.0))
        out = np.full(b.size, float(self.prior))
        slopes = self.slopes()
        both = slopes["with_ratio"] if compressions is not None else None
        c = None
        if both is not None:
            c = np.asarray([np.nan if x is None else x for x in compressions], dtype=np.float64)
        for (s, bucket), idx in _groups(sources, b):
            cell = self._cell(s, bucket)
            if cell is None:
                continue
            # length slope alone (documents without a ratio, or a cell that has none)
            a_adj = slopes["length"] * (lg[idx] - cell.al / cell.count)
            pred = cell.mean * np.exp(a_adj)
            if c is not None and cell.bw > 0:
                ci = c[idx]
                b_adj = both[0] * (lg[idx] - cell.bl / cell.bw) + both[1] * (ci - cell.bc / cell.bw)
                pred = np.where(np.isfinite(ci), cell.bd / cell.bw * np.exp(np.where(np.isfinite(ci), b_adj, 0.0)),
                                pred)
            out[idx] = pred
        return np.clip(out, self.floor, self.ceiling)

    def predict_cost(self, sources: Sequence[Optional[str]], lengths: Sequence[int],
                     compressions: Optional[Sequence[float]] = None) -> float:
        """Predicted :func:`attention_cost` of a micro-batch holding these documents."""
        return attention_cost(self.predict_many(sources, lengths, compressions), lengths)

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain-Python state (settings and every cell's sums): loading it into an estimator
        of the same settings predicts exactly as this one."""
        return {"version": 1, "kind": type(self).__name__,
                "settings": {"buckets_per_octave": int(self.buckets_per_octave), "prior": float(self.prior),
                             "min_count": int(self.min_count), "use_compression": bool(self.use_compression),
                             "min_slope_docs": int(self.min_slope_docs)},
                "cells": [[k[0], k[1], k[2], [getattr(c, n) for n in _SUMS]]
                          for k, c in sorted(self._cells.items(), key=lambda kv: repr(kv[0]))]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ValueError if it was saved with other settings or is
        malformed."""
        mine = self.state_dict()
        try:
            if state["kind"] != mine["kind"] or state["settings"] != mine["settings"]:
                raise ValueError(f"saved as {state['kind']} {state['settings']}, this estimator is "
                                 f"{mine['kind']} {mine['settings']}")
            cells = {}
            for kind, source, bucket, sums in state["cells"]:
                if len(sums) != len(_SUMS):
                    raise ValueError(f"a cell has {len(sums)} sums, expected {len(_SUMS)}")
                cells[(kind, source, None if bucket is None else int(bucket))] = _Cell(*map(float, sums))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed SparsityEstimator state ({e!r})") from None
        self._cells, self._slope_cache = cells, None


class LengthOnlyEstimator(SparsityEstimator):
    """The same estimator blind to sources and text (a length-only balancer's view)."""

    uses_source: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.use_compression = False
        super().__post_init__()


@dataclass
class SensitivityEstimator(SparsityEstimator):
    """A document's sparsity sensitivity: the loss (nats per token) it gives up under a
    reference sparse budget against dense attention, estimated like density.

    The same ladder (source + length bucket, bucket, source, everything, ``prior``) and the
    same pooled slopes on length and compression ratio, on log sensitivity (the spread
    between sources is multiplicative: about 40x on SmolLM2-135M at block top-8). Measured
    deltas below ``floor`` (a dense-vs-sparse difference at the noise level, or negative)
    count as ``floor``. What feeds it: a sensitivity study's documents
    (``benchmarks/harness/sparsity_real.py``'s ``loss_delta``, via :meth:`update_many`) and, online,
    :meth:`update_probe` with a micro-batch's measured dense-minus-sparse loss.
    """

    prior: float = 0.05
    """Sensitivity predicted before anything is measured (nats per token; any positive
    value: equal predictions give equal weights, which leave DST's plan as it is)."""
    floor: ClassVar[float] = 1e-4
    ceiling: ClassVar[float] = float("inf")

    def _measured(self, d: np.ndarray) -> np.ndarray:
        if d.size and not np.all(np.isfinite(d)):
            raise ValueError("loss deltas must be finite")
        return np.maximum(d, self.floor)

    def update_microbatch(self, *args, **kwargs) -> None:
        raise TypeError("a sensitivity is measured as a loss delta: use update_probe")

    def update_probe(self, sources: Sequence[Optional[str]], lengths: Sequence[int], loss_delta: float,
                     compressions: Optional[Sequence[float]] = None) -> None:
        """Fold in one micro-batch's measured loss delta (sparse minus dense, nats per token,
        over all its tokens): each document is taken at its current prediction scaled so
        that their token-weighted mean equals the measurement, weighted by its token share
        (a micro-batch of one document is an exact :meth:`update`)."""
        n = np.asarray(lengths, dtype=np.float64).reshape(-1)
        if n.size == 0 or n.sum() <= 0:
            return
        pred = self.predict_many(sources, lengths, compressions)
        scale = max(float(loss_delta), self.floor) / float((pred * n).sum() / n.sum())
        self.update_many(sources, lengths, pred * scale, n / n.sum(), compressions)


def pack_in_order(lengths: Sequence[int], tokens: int) -> list:
    """Consecutive document indices grouped into micro-batches of at most ``tokens`` tokens
    (a longer document gets one alone)."""
    groups, cur, used = [], [], 0
    for i, L in enumerate(lengths):
        if cur and used + L > tokens:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += int(L)
    if cur:
        groups.append(cur)
    return groups


def heldout_microbatch_mape(documents: Sequence[dict], tokens: int, estimators: dict,
                            fit_fraction: float = 0.5) -> dict:
    """Per-micro-batch attention-cost MAPE of estimators fitted on the earlier documents.

    Args:
        documents: in order, dicts with ``source``, ``length``, ``density`` and optionally
            ``compression_ratio`` (the sparsity study's ``documents``).
        tokens: micro-batch capacity; the held-out documents are packed in order.
        estimators: name -> fresh estimator (fitted here on the first ``fit_fraction``).

    Returns:
        ``{"fit_documents", "heldout_documents", "heldout_microbatches", name: MAPE, ...}``.
    """
    n = len(documents)
    half = int(n * fit_fraction)
    if half < 1 or half >= n:
        raise ValueError(f"need documents on both sides of the split, got {n} documents")
    src = [d["source"] for d in documents]
    L = [int(d["length"]) for d in documents]
    dens = [float(d["density"]) for d in documents]
    comp = [d.get("compression_ratio") for d in documents]
    has_comp = any(c is not None for c in comp)
    for est in estimators.values():
        est.update_many(src[:half], L[:half], dens[:half], None, comp[:half] if has_comp else None)
    held = list(range(half, n))
    groups = [[held[i] for i in g] for g in pack_in_order([L[i] for i in held], tokens)]
    actual = [attention_cost([dens[i] for i in g], [L[i] for i in g]) for g in groups]
    out = {"fit_documents": half, "heldout_documents": len(held), "heldout_microbatches": len(groups)}
    for name, est in estimators.items():
        pred = [est.predict_cost([src[i] for i in g], [L[i] for i in g],
                                 [comp[i] for i in g] if has_comp else None) for g in groups]
        out[name] = mape(pred, actual)
    return out
