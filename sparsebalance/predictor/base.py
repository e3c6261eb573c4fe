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

Context parallelism (:meth:`LatencyPredictor.set_context_parallel`): all of the
above become the times of the slowest rank of a CP group, K/V exchange included
(:mod:`sparsebalance.predictor.context_parallel`); the subclasses' per-document
model ``pair_ms * kept_pairs + token_ms * L + doc_ms`` (:meth:`_linear_ms`) is what
gets split. At CP size 1 nothing changes.

Sequence parallelism (:meth:`LatencyPredictor.set_sequence_parallel`): a micro-batch is
stored with up to a few padding tokens after its last document, so that each rank's
tokens split evenly over the TP ranks (:func:`sparsebalance.cp_split.sequence_parallel_pad`).
They cost linear time only: ``token_ms`` per layer (:meth:`LatencyPredictor.layer_pad_ms`,
in :meth:`~LatencyPredictor.layer_ms`; under CP per rank, plus their K/V exchange) and
their share of the extras (:meth:`~LatencyPredictor.extras_ms`); they attend to nothing.
The per-document terms (:meth:`~LatencyPredictor.layer_doc_ms`) leave them out: the
packers' additive item costs do not see this rounding (fewer than TP tokens per micro-batch
without CP); the planners' op tables and the stage times do.
"""

from __future__ import annotations

import abc
from typing import Optional

import numpy as np

from sparsebalance.config import ModelShape
from sparsebalance.cp_split import sequence_parallel_pad
from sparsebalance.predictor.context_parallel import ContextParallel, rank_kept_pairs
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

    Subclasses implement :meth:`_layer_doc_ms`, :meth:`_pair_ms`, :meth:`_linear_ms`,
    :meth:`_layer_const_ms` and :meth:`_extras_ms`; everything else (CP included) is
    composed here.
    """

    def __init__(self, shape: ModelShape, recalibrator: Optional[Recalibrator] = None):
        self.shape = shape
        self.recalibrator = recalibrator or Recalibrator()
        self.context_parallel = ContextParallel()
        self.sequence_parallel = 1
        """TP ranks a micro-batch's tokens are split over (1: no sequence parallelism)."""

    default_link = "nvlink"
    """Name of the CP link (``context_parallel.LINKS``) this cost model's hardware has."""
    kv_dtype_bytes = 2
    """Bytes per K/V element of the modelled runs (2: bf16), for the CP exchange."""

    def _routed_topk(self, topk: Optional[int]) -> Optional[int]:
        """The budget the modelled attention really routes with (a dense-only model
        ignores budgets)."""
        return topk

    def set_context_parallel(self, cp: ContextParallel) -> "LatencyPredictor":
        """Predict per-rank times under context parallelism ``cp`` (module docstring);
        returns ``self``."""
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"expected a ContextParallel, got {type(cp).__name__}")
        self.context_parallel = cp
        return self

    def set_sequence_parallel(self, size: int) -> "LatencyPredictor":
        """Price sequence parallelism's padding for ``size`` TP ranks (1: none; module
        docstring); returns ``self``."""
        if int(size) < 1:
            raise ValueError(f"sequence parallel size must be >= 1, got {size}")
        self.sequence_parallel = int(size)
        return self

    def pad_tokens(self, lengths) -> int:
        """Padding tokens a micro-batch of documents ``lengths`` is stored with after them
        for sequence parallelism (CP's per-document padding not included); 0 without it."""
        if self.sequence_parallel == 1:
            return 0
        cp = self.context_parallel
        return sequence_parallel_pad(int(cp.padded(as_lengths(lengths)).sum()), cp.size, self.sequence_parallel)

    def layer_pad_ms(self, lengths, topk: Optional[int], phase: str) -> float:
        """One layer's time on the micro-batch's :meth:`pad_tokens` (ms): ``token_ms`` each
        (per rank under CP, plus their K/V exchange); no attention."""
        pad = self.pad_tokens(lengths)
        if not pad:
            return 0.0
        token_ms, _ = self._linear_ms(topk, check_phase(phase))
        cp = self.context_parallel
        if cp.size == 1:
            return float(token_ms * pad)
        return float((token_ms / cp.size + self._exchange_ms_per_token(phase)) * pad)

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
    def _layer_const_ms(self, phase: str) -> float:
        """Per-micro-batch constant of one transformer layer (ms), without CP."""

    @abc.abstractmethod
    def _linear_ms(self, topk: Optional[int], phase: str) -> tuple:
        """``(token_ms, doc_ms)``: the rest of :meth:`_layer_doc_ms` besides the pairs,
        ``_layer_doc_ms(L) == _pair_ms * kept_pairs(L) + token_ms * L + doc_ms``."""

    def layer_const_ms(self, phase: str) -> float:
        """Per-micro-batch constant of one transformer layer (ms); under CP plus the
        latency of the layer's K/V collective."""
        cp = self.context_parallel
        latency = cp.link.latency_ms if cp.size > 1 else 0.0
        return float(self._layer_const_ms(check_phase(phase))) + latency

    @abc.abstractmethod
    def _pair_ms(self, topk: Optional[int], phase: str) -> float:
        """Slope of one layer's time in kept pairs under ``topk``."""

    def pair_ms(self, topk: Optional[int], phase: str) -> float:
        """ms of one layer per kept (query, key) pair (per head) under budget ``topk``:
        the slope of :meth:`layer_doc_ms` in ``kept_pairs``. It depends on ``topk`` only
        through the kernel: a None budget may run a dense kernel with another rate."""
        if topk is not None and topk < 0:
            raise ValueError(f"topk must be >= 0 or None, got {topk}")
        # Under CP each rank computes about 1/size of every document's pairs.
        return float(self._pair_ms(topk, check_phase(phase))) / self.context_parallel.size

    @abc.abstractmethod
    def _extras_ms(self, tokens: float, stage: int, pp: int, phase: str) -> float:
        """Embedding (stage 0) plus output layer and loss (stage pp-1), ms, for
        ``tokens`` tokens (a fraction under CP)."""

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
        check_phase(phase)
        ms = self._layer_doc_ms(L, topk, phase) if self.context_parallel.size == 1 \
            else self._cp_layer_doc_ms(L, topk, phase)
        return np.where(L > 0, ms, 0.0)

    def _cp_layer_doc_ms(self, L: np.ndarray, topk: Optional[int], phase: str) -> np.ndarray:
        """Per-document layer time of the slowest CP rank plus the exchange (see
        ``context_parallel``'s docstring)."""
        cp, s = self.context_parallel, self.shape
        pairs = rank_kept_pairs(L, self._routed_topk(topk), s.block_size, cp.size).max(axis=1)
        padded = cp.padded(L).astype(np.float64)
        token_ms, doc_ms = self._linear_ms(topk, phase)
        return (self._pair_ms(topk, phase) * pairs.astype(np.float64) + token_ms * padded / cp.size
                + doc_ms + self._exchange_ms_per_token(phase) * padded)

    def _exchange_ms_per_token(self, phase: str) -> float:
        """CP's K/V exchange (forward) or dK/dV return (backward) per stored token, ms."""
        cp, s = self.context_parallel, self.shape
        return (cp.exchange_bytes_per_token(s.num_query_groups, s.head_dim) / cp.link.bytes_per_ms
                * (1.0 if phase == "fwd" else cp.link.bwd_factor))

    def layer_ms(self, lengths, topk: Optional[int], phase: str) -> float:
        """One transformer layer for a micro-batch: sum(layer_doc_ms) + layer_pad_ms +
        layer_const_ms."""
        return (float(self.layer_doc_ms(lengths, topk, phase).sum()) + self.layer_pad_ms(lengths, topk, phase)
                + self.layer_const_ms(phase))

    def extras_ms(self, lengths, stage: int, pp: int, phase: str) -> float:
        """Per-stage extras of a micro-batch (ms): embedding on stage 0, output layer and
        loss on stage pp-1, nothing in between; sequence parallelism's padding included."""
        if pp < 1 or not 0 <= stage < pp:  # any split of the layers: extras depend on the ends only
            raise ValueError(f"need pp >= 1 and stage in [0, pp), got stage {stage} of {pp}")
        # Under CP a rank embeds / scores its 1/size of the tokens (CP's padding left out).
        tokens = int(as_lengths(lengths).sum()) + self.pad_tokens(lengths)
        cp = self.context_parallel.size
        return self._extras_ms(tokens if cp == 1 else tokens / cp, stage, pp, check_phase(phase))

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

    def state_dict(self) -> dict:
        """The online recalibration state (the model itself is rebuilt from its
        profile / name): :meth:`Recalibrator.state_dict`."""
        return {"recalibrator": self.recalibrator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (ValueError if malformed)."""
        if not isinstance(state, dict) or "recalibrator" not in state:
            raise ValueError("predictor state has no 'recalibrator' entry")
        self.recalibrator.load_state_dict(state["recalibrator"])

    def observe_microbatch(self, lengths, topk: Optional[int], stage: int, pp: int,
                           phase: str, measured_ms: float) -> float:
        """Feed back the measured time of one micro-batch on one stage; returns the factor."""
        model = self.stage_ms(lengths, topk, stage, pp, phase, calibrated=False)
        return self.observe(stage, phase, model, measured_ms)
