"""``h100-analytic``: a cluster cost model for planning at scales we cannot run here.

Derivation
----------
Source: ByteScale (SIGCOMM'25), per-layer forward time on H100 of one document of
length L (../shared/data/README.md), attention / MLP in ms::

    L     4K   8K   16K   32K   64K   128K
    attn  0.8  1.8  4.8   14.1  48.2  175.5
    MLP   0.9  1.8  3.6   7.5   15.1  28.2

1. Attention. A dense causal document has P(L) = L(L+1)/2 (query, key) pairs per
   head. ``attn = a*P + b_att*L + c_att`` fits the six points within 1.5% (relative
   least squares, :func:`reference_coefficients`): a = 1.83e-8 ms/pair,
   b_att = 1.33e-4 ms/token, c_att = 0.10 ms. Without the linear term the fit is
   off by 3.5% at 4K: the published "attention" includes a per-token part — QKV and
   output projections, RoPE — whose size (b_att / b_mlp = 0.60) matches the ratio of
   projection to MLP FLOPs of the reference layer (0.50) plus elementwise work.
2. MLP. ``mlp = b_mlp * L`` fits within 4% (b_mlp = 2.22e-4 ms/token); a constant
   term comes out negative, so there is none.
3. Scaling to another model. The published numbers do not state the layer shape;
   we assume a LLaMA-7B-shaped layer (h 4096, 32 heads x 128, MHA, SwiGLU FFN
   11008) — the shape of ByteScale's smallest model. Each coefficient is scaled by
   the FLOPs of the work it stands for (:class:`ModelShape`): a by heads*head_dim
   (pairs are per head), b_att by QKV+output-projection FLOPs, b_mlp by MLP FLOPs.
   c_att (launch/latency overhead) is not scaled. Small layers run matmuls at lower
   efficiency than 7B ones, so this is optimistic for narrow models.
   At TP=1 the reference MLP number would imply 1.26 PFLOP/s on one H100 (above its
   0.99 PFLOP/s dense BF16 peak), so the published times are most likely per-GPU
   times under tensor parallelism. Planners use ratios (attention vs linear,
   micro-batch vs micro-batch), which this does not change; the absolute scale on a
   real cluster is corrected by online recalibration.
4. Sparse budgets. The attention pair term counts *kept* pairs
   (``sparsebalance.pairs.kept_pairs``), i.e. we assume the block-sparse
   kernel runs at the dense kernel's time per pair (MoBA-style kernels built on
   FlashAttention's varlen path do, to first order).
5. Backward. Linear layers: 2x forward (input-gradient and weight-gradient GEMMs).
   Core attention: 2.5x forward (FlashAttention's backward runs 5 GEMMs of the
   forward's size against the forward's 2). Constant: 2x.
6. Extras (not in the published table, derived from FLOPs/bytes): output layer
   GEMM (2*h*V FLOPs/token) at the FLOP rate implied by the MLP fit; the loss
   (softmax cross-entropy over fp32 logits) and the embedding lookup are
   memory-bound: bytes moved / 2.7 TB/s (80% of H100 HBM3's 3.35 TB/s).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np

from sparsebalance.config import ModelShape
from sparsebalance.pairs import causal_pairs, kept_pairs
from sparsebalance.predictor.base import LatencyPredictor
from sparsebalance.predictor.recalibration import Recalibrator

# ByteScale, per-layer forward ms on H100 (see module docstring).
BYTESCALE_LENGTHS = np.array([4, 8, 16, 32, 64, 128], dtype=np.int64) * 1024
BYTESCALE_ATTN_MS = np.array([0.8, 1.8, 4.8, 14.1, 48.2, 175.5])
BYTESCALE_MLP_MS = np.array([0.9, 1.8, 3.6, 7.5, 15.1, 28.2])

REFERENCE_SHAPE = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32,
                             num_query_groups=32, ffn_hidden_size=11008, vocab_size=32000,
                             swiglu=True, block_size=256, topk=None)
"""Assumed shape of the layer the published timings were measured on (LLaMA-7B)."""

BWD_LINEAR = 2.0
"""Backward / forward time of GEMM-bound work (dgrad + wgrad)."""
BWD_ATTN = 2.5
"""Backward / forward time of core attention (5 GEMMs vs 2 in FlashAttention)."""
BWD_CONST = 2.0
"""Backward / forward per-micro-batch overhead (about twice the kernel launches)."""
HBM_BYTES_PER_MS = 2.7e9
"""Effective H100 HBM3 bandwidth, bytes per ms (80% of 3.35 TB/s)."""
LOSS_BYTES_PER_LOGIT = {"fwd": 8.0, "bwd": 12.0}
"""fp32 logit traffic of cross-entropy: fwd reads logits twice (max, exp-sum);
bwd reads logits + writes the gradient, plus a re-read for the softmax."""
EMBED_BYTES_PER_CHANNEL = {"fwd": 4.0, "bwd": 12.0}
"""Embedding: bf16 gather + write (fwd); fp32 scatter-add read-modify-write (bwd)."""


def _relative_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares minimising relative error sum((X c / y - 1)^2)."""
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    return coef


@lru_cache(maxsize=1)
def reference_coefficients() -> dict[str, float]:
    """Forward coefficients of the reference layer fitted to the ByteScale table.

    Returns:
        dict with a (ms per kept pair per head), b_att, b_mlp (ms per token), c_att (ms).
    """
    L = BYTESCALE_LENGTHS.astype(np.float64)
    P = causal_pairs(BYTESCALE_LENGTHS).astype(np.float64)
    a, b_att, c_att = _relative_lstsq(np.c_[P, L, np.ones_like(L)], BYTESCALE_ATTN_MS)
    (b_mlp,) = _relative_lstsq(L[:, None], BYTESCALE_MLP_MS)
    coef = {"a": float(a), "b_att": float(b_att), "c_att": float(c_att), "b_mlp": float(b_mlp)}
    if min(coef.values()) <= 0:  # would mean the published table changed shape
        raise RuntimeError(f"non-positive reference coefficient: {coef}")
    return coef


class AnalyticPredictor(LatencyPredictor):
    """H100 cost model scaled from published per-layer timings (module docstring)."""

    name = "h100-analytic"

    def __init__(self, shape: Optional[ModelShape] = None,
                 recalibrator: Optional[Recalibrator] = None):
        super().__init__(shape or ModelShape(), recalibrator)
        ref, s, r = reference_coefficients(), self.shape, REFERENCE_SHAPE
        self.fwd_pair_ms = ref["a"] * s.attn_pair_flops / r.attn_pair_flops
        """Forward ms per kept (query, key) pair (per head, all heads of the layer)."""
        self.fwd_token_ms = (ref["b_att"] * s.attn_linear_flops / r.attn_linear_flops
                             + ref["b_mlp"] * s.mlp_flops / r.mlp_flops)
        """Forward ms per token of the layer's linear work."""
        self.fwd_const_ms = ref["c_att"]
        """Forward per-micro-batch overhead of one layer, ms."""
        self.ms_per_flop = ref["b_mlp"] / r.mlp_flops
        """GEMM time per FLOP implied by the MLP fit (for the output layer)."""

    def _layer_doc_ms(self, lengths: np.ndarray, topk: Optional[int], phase: str) -> np.ndarray:
        pairs = kept_pairs(lengths, topk, self.shape.block_size).astype(np.float64)
        if phase == "fwd":
            return self.fwd_pair_ms * pairs + self.fwd_token_ms * lengths
        return BWD_ATTN * self.fwd_pair_ms * pairs + BWD_LINEAR * self.fwd_token_ms * lengths

    def _layer_const_ms(self, phase: str) -> float:
        return self.fwd_const_ms * (1.0 if phase == "fwd" else BWD_CONST)

    def _linear_ms(self, topk: Optional[int], phase: str) -> tuple:
        return self.fwd_token_ms * (1.0 if phase == "fwd" else BWD_LINEAR), 0.0

    def _pair_ms(self, topk: Optional[int], phase: str) -> float:
        return self.fwd_pair_ms * (1.0 if phase == "fwd" else BWD_ATTN)

    def _extras_ms(self, tokens: float, stage: int, pp: int, phase: str) -> float:
        s = self.shape
        ms = 0.0
        if stage == 0:
            ms += tokens * s.hidden_size * EMBED_BYTES_PER_CHANNEL[phase] / HBM_BYTES_PER_MS
        if stage == pp - 1:
            gemm = tokens * 2.0 * s.hidden_size * s.vocab_size * self.ms_per_flop
            loss = tokens * s.vocab_size * LOSS_BYTES_PER_LOGIT[phase] / HBM_BYTES_PER_MS
            ms += gemm * (1.0 if phase == "fwd" else BWD_LINEAR) + loss
        return ms
