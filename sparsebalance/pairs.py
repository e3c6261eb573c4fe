"""Exact attention-pair counts of block top-k routing, from lengths alone.

With block-level routing (query blocks of ``block_size`` tokens counted from
the document start), query block ``i`` keeps its diagonal block (token-causal),
the sink block 0 (when ``i > 0``) and ``min(topk, i - 1)`` of the blocks
``1 .. i-1``. Every non-diagonal key block is a full block, so the number of
kept (query, key) pairs of a document depends only on its length, the block
size and the budget — not on the data. The predictor, the packers and the
planners all count attention with these functions; the kernels report the
same numbers (tests check that).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

ArrayLike = Union[Sequence[int], np.ndarray]


def _blocks_sum(m: np.ndarray, k: np.ndarray) -> np.ndarray:
    """sum_{i=1..m} (1 + min(k, i - 1)) for m >= 0, elementwise."""
    m = np.maximum(m, 0)
    small = m * (m - 1) // 2
    large = k * (k + 1) // 2 + k * (m - 1 - k)
    return m + np.where(m <= k + 1, small, large)


def kept_pairs(lengths: ArrayLike, topk: Optional[int], block_size: int) -> np.ndarray:
    """Kept (query, key) pairs per document, per head. ``topk=None`` means dense.

    Args:
        lengths: document lengths in tokens (>= 0).
        topk: key blocks chosen besides the sink and the diagonal; None = dense.
        block_size: routing block size in tokens.

    Returns:
        int64 array, one count per document.
    """
    L = np.asarray(lengths, dtype=np.int64)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if topk is not None and topk < 0:
        raise ValueError(f"topk must be >= 0, got {topk}")
    B = np.int64(block_size)
    n = (L + B - 1) // B  # blocks per document
    rem = L - (n - 1) * B  # size of the last block (1..B when L > 0)
    k = np.where(n > 0, n, 0) if topk is None else np.full_like(L, int(topk))
    diag = np.maximum(n - 1, 0) * (B * (B + 1) // 2) + rem * (rem + 1) // 2
    full_off = B * B * _blocks_sum(n - 2, k)
    last_off = np.where(n >= 2, rem * B * (1 + np.minimum(k, np.maximum(n - 2, 0))), 0)
    return np.where(L > 0, diag + full_off + last_off, 0)


def causal_pairs(lengths: ArrayLike) -> np.ndarray:
    """Causal (query, key) pairs per document, per head: L (L + 1) / 2."""
    L = np.asarray(lengths, dtype=np.int64)
    return L * (L + 1) // 2


def density(lengths: ArrayLike, topk: Optional[int], block_size: int) -> float:
    """Kept pairs / causal pairs over a set of documents (1.0 when dense)."""
    c = int(causal_pairs(lengths).sum())
    return float(kept_pairs(lengths, topk, block_size).sum()) / c if c else 1.0


def threshold_kept_pairs(lengths: ArrayLike, densities: ArrayLike, topk: Optional[int], block_size: int,
                         topk_min: int = 0) -> np.ndarray:
    """Kept pairs per document (per head) under threshold routing, from each document's
    density (kept / causal pairs, e.g. measured or predicted by
    ``sparsebalance.batching.sparsity_estimator``), within what the cap ``topk`` and the
    floor ``topk_min`` allow: ``clip(density x L (L + 1) / 2, kept_pairs(L, topk_min),
    kept_pairs(L, topk))``. The clip is per document, not per query block: a model, not
    a count (a document whose blocks straddle the cap keeps a little less).
    ``topk=None``: dense.

    Returns:
        float64 array, one count per document.
    """
    L = np.asarray(lengths, dtype=np.int64)
    if topk is None:
        return causal_pairs(L).astype(np.float64)
    d = np.broadcast_to(np.asarray(densities, dtype=np.float64), L.shape)
    lo = kept_pairs(L, min(int(topk_min), int(topk)), block_size).astype(np.float64)
    hi = kept_pairs(L, topk, block_size).astype(np.float64)
    return np.clip(d * causal_pairs(L), lo, hi)
