"""Context parallelism (CP) in the cost model: per-rank work and the K/V exchange.

Under CP = c every micro-batch is split over c ranks (``megatron/training/data.py``,
``sparsebalance/attention/context_parallel.py``): each document is padded at its end
to a multiple of ``2 c`` tokens and cut into 2c equal chunks; CP rank r holds
chunks r and 2c-1-r (head/tail pairing). Every layer,
the ranks all-gather K and V of the whole micro-batch, and each computes the
attention of its own queries against whole documents (routing sees the whole
document); the backward returns dK/dV to their owners. The ranks of a CP group meet
in that collective every layer, so a layer takes as long as its slowest CP rank plus
the exchange. Per layer and micro-batch with documents ``L_i`` (padded ``P_i``)::

    layer_ms(CP) = pair_ms * sum_i max_r pairs_r(L_i)        attention of the slowest rank
                 + token_ms * sum_i P_i / c                  QKV/out projections, MLP, norms
                 + doc_ms * n                                per-document overheads (not split)
                 + exchange_ms_per_token * sum_i P_i          K/V all-gather (fwd) or dK/dV return (bwd)
                 + const_ms + link.latency_ms                per-micro-batch constant + collective

``pairs_r(L)`` is the exact kept-pair count of the queries rank r holds (block top-k
routing, :func:`rank_kept_pairs`). With a dense or a capped (top-k) document the kept
keys per query are non-decreasing and concave in the position, so the middle pair of
chunks is the most expensive and one rank is the slowest for every document: then
``sum_i max_r`` equals the slowest rank's total exactly; otherwise it is an upper
bound (per-document terms must stay additive for the packers).

Exchange bytes per token per layer: ``2 (K and V) x kv_heads x head_dim x dtype_bytes
x (c - 1) / c`` (each rank receives the other ranks' shares); the backward moves the
same gradient bytes, times the link's ``bwd_factor`` (1 for a reduce-scatter; 2 for
gloo, which has none and all-reduces the full buffer instead).

Stage extras (embedding; output layer + loss) are per-token work on the rank's
tokens: ``extras(tokens / c)`` (padding, at most ``2c - 1`` tokens per document, is
left out there so the packers' affine extras stay exact).

Link constants (:data:`LINKS`; override with :class:`Link`):

* ``nvlink`` — H100 SXM, NVLink 4 (450 GB/s per direction per GPU): NCCL all-gather
  / reduce-scatter reach about 360 GB/s bus bandwidth on large messages within a
  node (nccl-tests ``all_gather_perf`` on 8x H100, typical published figures); 0.02 ms
  per collective (NCCL's small-message latency within a node). Reduce-scatter in the
  backward: ``bwd_factor`` 1.
* ``gloo-cpu`` — gloo over loopback between 2 processes on the 2-core project machine
  (torch 2.13), measured with ``all_gather_into_tensor`` of 1-4 MB per rank: 0.3-1.1
  GB/s received per rank (noisy under load), 0.2 ms for a 4-byte collective. 1 GB/s
  and 0.2 ms are used. The backward all-reduces the full dK/dV buffer (ring: twice
  the reduce-scatter's bytes): ``bwd_factor`` 2.

Online recalibration still scales each (stage, phase) as a whole, so a wrong
absolute link speed is partly corrected; the split between compute and exchange is
what these constants decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sparsebalance.cp_split import padded_lengths


@dataclass(frozen=True)
class Link:
    """The interconnect of a CP group, as the K/V exchange sees it."""

    name: str
    """Label (reports)."""
    gb_per_s: float
    """Bandwidth of the collective, GB/s (1e9 bytes/s) received per rank."""
    latency_ms: float
    """Fixed cost of one collective, ms."""
    bwd_factor: float = 1.0
    """Backward exchange bytes / forward exchange bytes (1: reduce-scatter; 2: all-reduce)."""

    def __post_init__(self) -> None:
        if not self.gb_per_s > 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.gb_per_s}")
        if self.latency_ms < 0 or self.bwd_factor <= 0:
            raise ValueError(f"link latency must be >= 0 and bwd_factor > 0, got "
                             f"{self.latency_ms}, {self.bwd_factor}")

    @property
    def bytes_per_ms(self) -> float:
        """Bandwidth in bytes per millisecond."""
        return self.gb_per_s * 1e6


NVLINK = Link("nvlink", gb_per_s=360.0, latency_ms=0.02, bwd_factor=1.0)
"""H100 SXM NVLink 4 with NCCL (module docstring)."""
GLOO_CPU = Link("gloo-cpu", gb_per_s=1.0, latency_ms=0.2, bwd_factor=2.0)
"""gloo over loopback on the project's CPU machine (module docstring)."""
LINKS = {link.name: link for link in (NVLINK, GLOO_CPU)}
"""Links by name."""


@dataclass(frozen=True)
class ContextParallel:
    """How a micro-batch is split over CP ranks and what its exchange costs."""

    size: int = 1
    """CP ranks per micro-batch (1: no context parallelism)."""
    link: Link = field(default=NVLINK)
    """Interconnect of the CP group."""
    dtype_bytes: int = 2
    """Bytes per K/V element exchanged (2: bf16; 4: fp32 on CPU)."""

    def __post_init__(self) -> None:
        if int(self.size) < 1:
            raise ValueError(f"context parallel size must be >= 1, got {self.size}")
        if int(self.dtype_bytes) < 1:
            raise ValueError("dtype_bytes must be >= 1")

    def padded(self, lengths: np.ndarray) -> np.ndarray:
        """Document lengths as the training split stores them under CP."""
        if self.size == 1:
            return np.asarray(lengths, dtype=np.int64)
        return padded_lengths(lengths, self.size)

    def exchange_bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Bytes each rank receives per (padded) token per layer in the forward."""
        return 2.0 * kv_heads * head_dim * self.dtype_bytes * (self.size - 1) / self.size


def _prefix_kept(x: np.ndarray, K: Optional[int], B: int) -> np.ndarray:
    """Kept (query, key) pairs of the queries at positions ``< x`` of a document
    (block top-k routing of ``sparsebalance.pairs``: a query in block q
    keeps its own block up to itself plus ``min(q, K)`` earlier full blocks, K = top-k
    + 1 counting the sink; K None = dense)."""
    x = np.asarray(x, dtype=np.int64)
    f, r = x // B, x % B
    diag = f * (B * (B + 1) // 2) + r * (r + 1) // 2
    if K is None:
        earlier_blocks = B * f * (f - 1) // 2 + r * f  # sum over positions of their block index
    else:
        m = np.minimum(f, K)
        earlier_blocks = B * (m * (m - 1) // 2 + K * (f - m)) + r * np.minimum(f, K)
    return diag + B * earlier_blocks


def rank_kept_pairs(lengths, topk: Optional[int], block_size: int, cp: int) -> np.ndarray:
    """Kept (query, key) pairs per head of the queries each CP rank holds.

    Args:
        lengths: [n] real document lengths, tokens.
        topk: routing budget (key blocks besides sink and diagonal); None = dense.
        block_size: routing block, tokens.
        cp: CP size; rank r holds chunks r and 2cp-1-r of each padded document.

    Returns:
        int64 [n, cp]; rows sum to ``routing.kept_pairs(lengths, topk, block_size)``.
    """
    L = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if block_size < 1 or cp < 1:
        raise ValueError(f"block_size and cp must be >= 1, got {block_size}, {cp}")
    if topk is not None and topk < 0:
        raise ValueError(f"topk must be >= 0 or None, got {topk}")
    K = None if topk is None else int(topk) + 1
    if cp == 1:
        return _prefix_kept(L, K, block_size)[:, None]
    P = ContextParallel(cp).padded(L)
    Lc, S = L[:, None], (P // (2 * cp))[:, None]  # chunk size per document
    out = np.zeros((L.size, cp), dtype=np.int64)
    for j in (np.arange(cp)[None, :], 2 * cp - 1 - np.arange(cp)[None, :]):  # head, tail chunk
        a, b = np.minimum(j * S, Lc), np.minimum((j + 1) * S, Lc)
        out += _prefix_kept(b, K, block_size) - _prefix_kept(a, K, block_size)
    return out
