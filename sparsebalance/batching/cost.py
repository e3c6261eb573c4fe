"""Predicted costs for the packers, built on the shared LatencyPredictor.

Two views of the same model:

* the hot path (packing): per-item whole-model cost ``doc_ms`` (fwd + bwd over all
  layers, from one vectorised ``layer_doc_ms`` call per phase) plus a per-micro-batch
  constant, and per-stage forward/backward times from a per-stage affine model in
  (sum of item costs, tokens) that the predictor's own ``stage_ms`` defines exactly
  (checked in the tests);
* the report: the predictor's ``stage_ms`` per (micro-batch, stage, phase), and the
  per-rank step time from the pipeline model.

Densities: with block-level top-k routing the kept pairs of a document follow from
its length (``sparsebalance.pairs``), which is what the predictor counts.
A density estimator (any object with ``ratio(lengths, topk, doc_ids)``) scales the
attention part of each document's cost by a predicted (achieved / modelled) ratio, for
routings whose kept count is data-dependent: under threshold routing the driver passes
:class:`sparsebalance.batching.density_feedback.ThresholdDensity` (the tests'
``tests/batching/density_estimator.py`` is another); block top-k routing needs none.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from sparsebalance.pairs import kept_pairs
from sparsebalance.pipeline import step_ms

_PHASES = ("fwd", "bwd")


def _layers_of(predictor, stage: int, pp: int) -> int:
    shape = getattr(predictor, "shape", None)
    if shape is not None and hasattr(shape, "layers_of"):
        return int(shape.layers_of(stage, pp))
    if predictor.num_layers % pp:
        raise ValueError(f"num_layers ({predictor.num_layers}) is not divisible by pp ({pp})")
    return predictor.num_layers // pp


class CostModel:
    """Item and micro-batch costs at one budget, for one pipeline depth.

    Args:
        predictor: a LatencyPredictor (times in ms).
        topk: attention budget the plan is for (None = dense).
        pp: pipeline stages.
        density: optional density estimator, ``ratio(lengths, topk, doc_ids)`` (scales
            attention cost per item; see the module docstring).
    """

    def __init__(self, predictor, *, topk: Optional[int], pp: int = 1, density=None):
        if pp < 1:
            raise ValueError(f"pp must be >= 1, got {pp}")
        self.predictor = predictor
        self.topk = topk
        self.pp = int(pp)
        self.density = density
        self.layers = np.array([_layers_of(predictor, s, pp) for s in range(pp)], dtype=np.float64)
        nl = float(self.layers.sum())
        self.const = {ph: predictor.layer_const_ms(ph) for ph in _PHASES}
        # Extras are affine in the micro-batch's tokens (embedding, output layer, loss):
        # probe two token counts per (stage, phase) once.
        t0, t1 = 1024, 2048
        self.extra_a = np.zeros((2, pp))
        self.extra_b = np.zeros((2, pp))
        self.corr = np.ones((2, pp))
        for p, ph in enumerate(_PHASES):
            for s in range(pp):
                e0 = predictor.extras_ms(np.array([t0]), s, pp, ph)
                e1 = predictor.extras_ms(np.array([t1]), s, pp, ph)
                self.extra_b[p, s] = (e1 - e0) / (t1 - t0)
                self.extra_a[p, s] = e0 - self.extra_b[p, s] * t0
                self.corr[p, s] = predictor.correction(s, ph)
        # Whole-model weights: sum over stages of corrected layers (+ extras).
        self._w = (self.corr * self.layers[None, :]).sum(axis=1)  # [2]
        self.mb_const_ms = float(sum(self._w[p] * self.const[ph] for p, ph in enumerate(_PHASES))
                                 + (self.corr * self.extra_a).sum())
        self.token_ms = float((self.corr * self.extra_b).sum())
        self._nl = nl

    # -- per item ---------------------------------------------------------------------
    def layer_item_ms(self, lengths: np.ndarray, doc_ids: Optional[np.ndarray] = None,
                      topk="default") -> np.ndarray:
        """[2, n] one layer's per-item time (ms), rows fwd and bwd."""
        k = self.topk if topk == "default" else topk
        L = np.asarray(lengths, dtype=np.int64)
        out = np.stack([self.predictor.layer_doc_ms(L, k, ph) for ph in _PHASES])
        if self.density is not None and L.size:
            ratio = self.density.ratio(L, k, doc_ids)
            if np.any(ratio != 1.0):
                out = out + self._attn_ms_per_pair(k)[:, None] * (
                    (ratio - 1.0) * kept_pairs(L, k, self.predictor.block_size))[None, :]
        return out

    def doc_ms(self, lengths: np.ndarray, doc_ids: Optional[np.ndarray] = None,
               topk="default") -> np.ndarray:
        """[n] whole-model fwd+bwd cost of each item (ms), excluding the per-micro-batch
        constant and the per-token extras."""
        li = self.layer_item_ms(lengths, doc_ids, topk)
        return self._w[0] * li[0] + self._w[1] * li[1]

    def stage_item_ms(self, lengths: np.ndarray, doc_ids: Optional[np.ndarray] = None,
                      layer_item: Optional[np.ndarray] = None) -> np.ndarray:
        """[pp, n] fwd+bwd time each item adds to each stage, per-token extras included
        (ms); the per-micro-batch constants are left out. ``layer_item`` reuses a
        :meth:`layer_item_ms` result of the same items."""
        li = self.layer_item_ms(lengths, doc_ids) if layer_item is None else layer_item
        L = np.asarray(lengths, dtype=np.float64)
        out = np.zeros((self.pp, L.size))
        for p in range(2):
            out += self.corr[p][:, None] * (self.layers[:, None] * li[p][None, :]
                                            + self.extra_b[p][:, None] * L[None, :])
        return out

    def stage_const_ms(self) -> np.ndarray:
        """[2, pp] per-micro-batch constant of each (phase, stage) (ms)."""
        c = np.array([[self.const[ph]] for ph in _PHASES])
        return self.corr * (self.layers[None, :] * c + self.extra_a)

    def mb_ms(self, item_cost_sum, tokens) -> np.ndarray:
        """Whole-model fwd+bwd time of micro-batches from summed item costs and tokens."""
        item_cost_sum = np.asarray(item_cost_sum, dtype=np.float64)
        return np.where(np.asarray(tokens) > 0,
                        item_cost_sum + self.mb_const_ms + self.token_ms * np.asarray(tokens),
                        0.0)

    def _attn_ms_per_pair(self, k) -> np.ndarray:
        """[2] ms per kept pair per layer at budget ``k`` (the predictor's own slope)."""
        return np.array([self.predictor.pair_ms(k, ph) for ph in _PHASES])

    # -- per micro-batch, per stage ---------------------------------------------------------
    def stage_times(self, layer_sum: np.ndarray, tokens: np.ndarray) -> tuple:
        """Per-stage fwd/bwd times from per-micro-batch one-layer item sums.

        Args:
            layer_sum: [..., 2] summed ``layer_item_ms`` of the items of each micro-batch.
            tokens: [...] tokens of each micro-batch.

        Returns:
            (fwd, bwd), each [..., pp] in ms; empty micro-batches cost 0.
        """
        layer_sum = np.asarray(layer_sum, dtype=np.float64)
        tok = np.asarray(tokens, dtype=np.float64)[..., None]
        out = []
        for p, ph in enumerate(_PHASES):
            layer = layer_sum[..., p:p + 1] + self.const[ph]
            t = self.corr[p] * (self.layers * layer + self.extra_a[p] + self.extra_b[p] * tok)
            out.append(np.where(tok > 0, t, 0.0))
        return out[0], out[1]

    def packing_times(self, bins: list, dp: int, M: int) -> dict:
        """Predicted times of a packed step with the predictor's ``stage_ms``.

        Returns a dict of ``microbatch_ms`` [dp, M], ``rank_ms`` [dp],
        ``stage_fwd_ms`` / ``stage_bwd_ms`` [dp, M, pp].
        """
        K = dp * M
        seg = [(j, d, n) for j, b in enumerate(bins) for (d, _, n) in b]
        arr = np.array(seg, dtype=np.int64).reshape(len(seg), 3)
        li = self.layer_item_ms(arr[:, 2], arr[:, 1])  # [2, n]
        layer = np.stack([np.bincount(arr[:, 0], weights=li[p], minlength=K) for p in range(2)],
                         axis=1)
        tok = np.bincount(arr[:, 0], weights=arr[:, 2], minlength=K)
        fwd, bwd = self.stage_times(layer, tok)
        fwd = fwd.reshape(dp, M, self.pp)
        bwd = bwd.reshape(dp, M, self.pp)
        return {
            "microbatch_ms": (fwd + bwd).sum(axis=2),
            "rank_ms": step_ms(fwd, bwd),
            "stage_fwd_ms": fwd,
            "stage_bwd_ms": bwd,
        }
