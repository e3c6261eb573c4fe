"""The fitted cost model: profiled on this machine, per phase.

One transformer layer, for a micro-batch with documents ``L_1..L_n`` at budget k::

    t(phase) = a_k * sum_i kept_pairs(L_i, k, B) + b * sum_i L_i + d_k * n + c

``kept_pairs`` is the exact per-head count of the routing rules
(``sparsebalance.pairs``), never an estimate. ``a_k, d_k`` are
``a_sparse, d_sparse`` for an integer budget and ``a_dense, d_dense`` for
``k = None``: a None budget runs the dense kernel (SDPA, one call per document),
whose time per pair and per document differ from the block-sparse kernel's (one
call per micro-batch). Separate per-document terms cut the worst in-sample error
of a 4096-token CPU profile from 53% to 18% (many tiny dense documents).
A profile of a dense model (no ``--sparse-attention``) has only ``a_dense``, and
every budget is answered as dense, because that model ignores budgets.
All coefficients are >= 0, from a relative-error NNLS fit
(:mod:`sparsebalance.predictor.fitting`) of the samples ``tools/profile_latency.py``
measured; a per-document term (per-segment kernel and RoPE overhead) is kept only
where the fit finds it non-zero. The stage extras are
``e * tokens + e0`` for the embedding (stage 0) and ``o * tokens + o0`` for the
output layer + loss (last stage).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import numpy as np

from sparsebalance.config import ModelShape
from sparsebalance.pairs import kept_pairs
from sparsebalance.predictor.base import PHASES, LatencyPredictor
from sparsebalance.predictor.fitting import relative_nnls
from sparsebalance.predictor.recalibration import Recalibrator

LAYER_FEATURES = ("pairs", "dense_pairs", "tokens", "docs", "dense_docs", "const")
"""Columns of the per-layer design matrix (see :func:`layer_features`)."""
EXTRA_FEATURES = ("tokens", "const")
"""Columns of the embedding / output-layer design matrix."""
EXTRA_KINDS = ("embedding", "output")
"""Stage extras: embedding on the first stage, output layer + loss on the last."""


def layer_features(lengths, topk: Optional[int], block_size: int) -> np.ndarray:
    """[6] features of one micro-batch (:data:`LAYER_FEATURES`): kept pairs per head
    and documents under an integer budget (else 0), causal pairs per head and
    documents when dense (else 0), tokens, 1."""
    L = np.asarray(lengths, dtype=np.int64)
    L = L[L > 0]
    pairs, n, dense = float(kept_pairs(L, topk, block_size).sum()), float(L.size), topk is None
    return np.array([0.0 if dense else pairs, pairs if dense else 0.0, float(L.sum()),
                     0.0 if dense else n, n if dense else 0.0, 1.0])


def fit_coefficients(samples: Iterable[dict], block_size: int) -> dict[str, Any]:
    """Fit per-phase coefficients from profile samples.

    Args:
        samples: dicts with ``kind`` ("layer" | "embedding" | "output"), ``phase``,
            ``lengths`` (document lengths), ``topk`` (None = dense) and ``ms``.
        block_size: routing block size the samples were measured with.

    Returns:
        ``{"layer": {phase: {feature: coef}}, "embedding": {...}, "output": {...}}``;
        a kind without samples is absent.
    """
    rows: dict[tuple, list] = {}
    for s in samples:
        kind, phase = s["kind"], s["phase"]
        if phase not in PHASES:
            raise ValueError(f"sample phase must be 'fwd' or 'bwd', got {phase!r}")
        if kind == "layer":
            x = layer_features(s["lengths"], s["topk"], block_size)
        elif kind in EXTRA_KINDS:
            x = np.array([float(np.sum(s["lengths"])), 1.0])
        else:
            raise ValueError(f"sample kind must be 'layer', 'embedding' or 'output', got {kind!r}")
        rows.setdefault((kind, phase), []).append((x, float(s["ms"])))
    out: dict[str, Any] = {}
    for (kind, phase), r in sorted(rows.items()):
        X = np.stack([x for x, _ in r])
        y = np.array([t for _, t in r])
        names = LAYER_FEATURES if kind == "layer" else EXTRA_FEATURES
        coef = relative_nnls(X, y)
        out.setdefault(kind, {})[phase] = dict(zip(names, map(float, coef)))
    return out


class FittedPredictor(LatencyPredictor):
    """Predictor backed by coefficients fitted to a profile of this machine."""

    name = "fitted"

    def __init__(self, shape: ModelShape, coefficients: dict[str, Any],
                 recalibrator: Optional[Recalibrator] = None, dense_only: bool = False):
        """``dense_only``: the profiled model has no sparse attention; every budget is
        answered as dense."""
        super().__init__(shape, recalibrator)
        self.dense_only = dense_only
        layer = coefficients.get("layer", {})
        missing = [p for p in PHASES if p not in layer]
        if missing:
            raise ValueError(f"coefficients: no layer model for phase(s) {missing}")
        self.coefficients = coefficients
        self._layer = {p: np.array([layer[p][f] for f in LAYER_FEATURES]) for p in PHASES}
        self._extra = {
            (k, p): np.array([coefficients[k][p][f] for f in EXTRA_FEATURES])
            if k in coefficients and p in coefficients[k] else np.zeros(2)
            for k in EXTRA_KINDS for p in PHASES}

    def _layer_doc_ms(self, lengths: np.ndarray, topk: Optional[int], phase: str) -> np.ndarray:
        _, _, b, d_sparse, d_dense, _ = self._layer[phase]
        if self.dense_only:
            topk = None
        pairs = kept_pairs(lengths, topk, self.shape.block_size).astype(np.float64)
        return (self._pair_ms(topk, phase) * pairs + b * lengths
                + (d_dense if topk is None else d_sparse))

    def _routed_topk(self, topk: Optional[int]) -> Optional[int]:
        return None if self.dense_only else topk

    def _layer_const_ms(self, phase: str) -> float:
        return float(self._layer[phase][5])

    def _linear_ms(self, topk: Optional[int], phase: str) -> tuple:
        _, _, b, d_sparse, d_dense, _ = self._layer[phase]
        return float(b), float(d_dense if topk is None or self.dense_only else d_sparse)

    def _pair_ms(self, topk: Optional[int], phase: str) -> float:
        a_sparse, a_dense = self._layer[phase][:2]
        return a_dense if topk is None or self.dense_only else a_sparse

    def _extras_ms(self, tokens: float, stage: int, pp: int, phase: str) -> float:
        ms = 0.0
        for kind, on in (("embedding", stage == 0), ("output", stage == pp - 1)):
            if on and tokens > 0:
                e, e0 = self._extra[(kind, phase)]
                ms += e * tokens + e0
        return float(ms)
