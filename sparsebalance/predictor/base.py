"""The predictor interface shared by the packers (SAB), the planners (DST) and the
pipeline simulator.

All times are milliseconds. ``lengths`` are the document lengths (tokens) of ONE
packed micro-batch; ``topk`` is its attention budget (key blocks besides the sink
and the diagonal block; None = dense); ``phase`` is "fwd" or "bwd".

Decomposition of one transformer layer's time for a micro-batch with documents
``L_1..L_n``::

    layer_ms = sum_i layer_doc_ms(L_i) + layer_const_ms
    layer_doc_ms(L) = a * kept_pairs(L, topk, block) + b * L + d

so the packers can add documents to a bin with one vectorised call. A stage adds
its extras (embedding on the first stage; output layer + loss on the last)::

    stage_ms = correction[stage, phase] * (layers_of(stage) * layer_ms + extras_ms)

where ``correction`` is the online recalibration factor (1.0 until measurements
are fed back with :meth:`LatencyPredictor.observe`).
"""

from __future__ import annotations

import abc
from typing import Optional

import numpy as np

from sparsebalance.predictor.config import ModelShape
from sparsebalance.predictor.recalibration import Recalibrator

PHASES = ("fwd", "bwd")


def check_phase(phase: str) -> str:
    """Return ``phase`` or raise ValueError naming the argument."""
    if phase not in PHASES:
        raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
    return phase


def as_lengths(lengths) -> np.ndarray:
    """Document lengths as a 1-D int64 array; raises ValueError on negatives."""
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if L.size and L.min() < 0:
        raise ValueError("lengths must be >= 0")
    return L


class LatencyPredictor(abc.ABC):
    """Time of one micro-batch per (stage, phase), with online recalibration.

    Subclasses implement :meth:`_layer_doc_ms`, :meth:`layer_const_ms` and
    :meth:`_extras_ms`; everything else is composed here.
    """

    def __init__(self, shape: ModelShape, recalibrator: Optional[Recalibrator] = None):
        self.shape = shape
        self.recalibrator = recalibrator or Recalibrator()

    # -- attributes the packers/planners read -------------------------------------
    @property
    def num_layers(self) -> int:
        """Transformer layers of the whole model."""
        return self.shape.num_layers

    @property
    def block_size(self) -> int:
        """Routing block size (tokens)."""
        return self.shape.block_size

    @property
    def topk(self) -> Optional[int]:
        """Default budget of the model config (None = dense)."""
        return self.shape.topk

    # -- model ---------------------------------------------------------------------
    @abc.abstractmethod
    def _layer_doc_ms(self, lengths: np.ndarray, topk: Optional[int], phase: str) -> np.ndarray:
        """Per-document part of one layer's time (validated int64 lengths)."""

    @abc.abstractmethod
    def layer_const_ms(self, phase: str) -> float:
        """Per-micro-batch constant of one transformer layer (ms)."""

    @abc.abstractmethod
    def _pair_ms(self, topk: Optional[int], phase: str) -> float:
        """Slope of one layer's time in kept pairs under ``topk``."""

    def pair_ms(self, topk: Optional[int], phase: str) -> float:
        """ms of one layer per kept (query, key) pair (per head) under budget ``topk``:
        the slope of :meth:`layer_doc_ms` in ``kept_pairs``. It depends on ``topk`` only
        through the kernel: a None budget may run a dense kernel with another rate."""
        if topk is not None and topk < 0:
            raise ValueError(f"topk must be >= 0 or None, got {topk}")
        return float(self._pair_ms(topk, check_phase(phase)))

    @abc.abstractmethod
    def _extras_ms(self, tokens: int, stage: int, pp: int, phase: str) -> float:
        """Embedding (stage 0) plus output layer and loss (stage pp-1), ms."""

    def layer_doc_ms(self, lengths, topk: Optional[int], phase: str) -> np.ndarray:
        """Per-document additive time of one layer.

        Args:
            lengths: [n] document lengths in tokens.
            topk: budget (None = dense).
            phase: "fwd" or "bwd".

        Returns:
            [n] float64 array, ms; 0 for zero-length documents.
        """
        L = as_lengths(lengths)
        return np.where(L > 0, self._layer_doc_ms(L, topk, check_phase(phase)), 0.0)

    def layer_ms(self, lengths, topk: Optional[int], phase: str) -> float:
        """One transformer layer for a micro-batch: sum(layer_doc_ms) + layer_const_ms."""
        return float(self.layer_doc_ms(lengths, topk, phase).sum()) + self.layer_const_ms(phase)

    def extras_ms(self, lengths, stage: int, pp: int, phase: str) -> float:
        """Per-stage extras of a micro-batch (ms): embedding on stage 0, output layer and
        loss on stage pp-1, nothing in between."""
        self.shape.layers_of(stage, pp)  # validates stage/pp
        return self._extras_ms(int(as_lengths(lengths).sum()), stage, pp, check_phase(phase))

    def stage_ms(self, lengths, topk: Optional[int], stage: int, pp: int, phase: str,
                 calibrated: bool = True) -> float:
        """Time of a micro-batch on one pipeline stage (ms).

        ``layers_of(stage) * layer_ms + extras_ms``, times the recalibration factor of
        (stage, phase) unless ``calibrated=False``.
        """
        raw = (self.shape.layers_of(stage, pp) * self.layer_ms(lengths, topk, phase)
               + self.extras_ms(lengths, stage, pp, phase))
        return raw * self.recalibrator.factor(stage, phase) if calibrated else raw

    # -- online recalibration --------------------------------------------------------
    def correction(self, stage: int, phase: str) -> float:
        """Current recalibration factor of (stage, phase) (1.0 = trust the model)."""
        return self.recalibrator.factor(stage, check_phase(phase))

    def observe(self, stage: int, phase: str, predicted_ms: float, measured_ms: float) -> float:
        """Feed back one measured stage time; returns the new factor.

        ``predicted_ms`` must be the *uncalibrated* prediction of what was measured,
        i.e. ``stage_ms(..., calibrated=False)`` (see :meth:`observe_microbatch`, which
        computes it for you). Using the uncalibrated value makes repeated feedback of
        micro-batches planned with an older factor converge instead of overshooting.
        """
        return self.recalibrator.observe(stage, check_phase(phase), predicted_ms, measured_ms)

    def observe_microbatch(self, lengths, topk: Optional[int], stage: int, pp: int,
                           phase: str, measured_ms: float) -> float:
        """Feed back the measured time of one micro-batch on one stage; returns the factor."""
        model = self.stage_ms(lengths, topk, stage, pp, phase, calibrated=False)
        return self.observe(stage, phase, model, measured_ms)
