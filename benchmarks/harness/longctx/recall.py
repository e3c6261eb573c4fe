"""Attention recall of block top-k routing.

For one query, recall is the fraction of its dense causal softmax probability
(over the keys of its own document) that falls on the keys the sparse attention
keeps. The kept keys come from :func:`sparsebalance.ops.build_plan`, the routing
every kernel backend consumes, so recall describes exactly what training attends
to (sink and diagonal always kept, top-k other blocks by the block-mean gate,
one budget per document).

Memory stays bounded for long documents: probabilities are formed one query
block at a time, ``[H, B, prefix]`` fp32 at most, never a ``T x T`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from sparsebalance.ops.plan import TopK, build_plan, default_scale, per_doc_topk


@dataclass
class Recall:
    """Recall per head over a set of queries, poolable across micro-batches."""

    mass: torch.Tensor
    """float64 ``[H]``: per head, the sum over queries of the kept probability mass."""
    queries: int
    """Queries summed into ``mass`` (the pooling weight)."""
    kept_pairs: int = 0
    """(query, key) pairs the routing keeps, summed over heads."""
    causal_pairs: int = 0
    """Causal (query, key) pairs, summed over heads (kept / causal = density)."""

    @property
    def per_head(self) -> torch.Tensor:
        """float64 ``[H]`` mean recall per head (1.0 with no queries)."""
        if self.queries == 0:
            return torch.ones_like(self.mass)
        return self.mass / self.queries

    def __add__(self, other: "Recall") -> "Recall":
        return Recall(self.mass + other.mass, self.queries + other.queries,
                      self.kept_pairs + other.kept_pairs, self.causal_pairs + other.causal_pairs)


def pool(parts: Iterable[Recall]) -> Recall:
    """Query-weighted sum of several :class:`Recall` (e.g. over micro-batches)."""
    parts = list(parts)
    if not parts:
        raise ValueError("pool: nothing to pool")
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def dense_recall(num_heads: int, doc_lengths: torch.Tensor) -> Recall:
    """Recall of dense attention over documents of ``doc_lengths``: 1.0 by definition."""
    causal = int((doc_lengths * (doc_lengths + 1) // 2).sum()) * num_heads
    queries = int(doc_lengths.sum())
    return Recall(torch.full((num_heads,), float(queries), dtype=torch.float64), queries, causal, causal)


@torch.no_grad()
def block_topk_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    topk: Optional[TopK],
    block_size: int,
    softmax_scale: Optional[float] = None,
) -> Recall:
    """Kept dense-softmax mass of block top-k routing, per head.

    Args:
        q: ``[T, H, D]`` queries (after RoPE, as the attention sees them).
        k: ``[T, Hkv, D]`` keys, ``H % Hkv == 0`` (GQA).
        cu_seqlens: int ``[n_docs + 1]`` document boundaries; attention stays inside one.
        topk: key blocks kept besides sink and diagonal: int, int tensor ``[n_docs]``,
            or None for dense (recall 1.0).
        block_size: routing block size B in tokens.
        softmax_scale: logit scale; default ``1 / sqrt(D)``.

    Returns:
        :class:`Recall` over the T queries.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, H, D = q.shape
    hkv = k.shape[1]
    if hkv < 1 or H % hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({hkv})")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu.tolist()}")
    lens = cu[1:] - cu[:-1]
    if topk is None:
        return dense_recall(H, lens)
    if isinstance(topk, torch.Tensor):
        if topk.numel() not in (1, cu.numel() - 1) or bool((topk < 0).any()):
            raise ValueError(f"topk tensor must hold one value >= 0 per document ({cu.numel() - 1})")
    elif int(topk) < 0:
        raise ValueError(f"topk must be >= 0, got {topk}")
    if bool((per_doc_topk(topk, lens.numel()) + 2 >= (lens + block_size - 1) // block_size).all()):
        return dense_recall(H, lens)  # every causal key block is kept: exactly 1, not 1 - rounding
    scale = default_scale(D, softmax_scale)
    plan = build_plan(q, k, cu_seqlens, topk, block_size, scale)
    kv_idx, kv_cnt = plan.kv_idx.cpu().long(), plan.kv_cnt.cpu().long()
    rep = H // hkv
    B = block_size
    mass = torch.zeros(H, dtype=torch.float64)
    blk = 0  # global id of the current query block (plan order = document order)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        first = blk
        for qs in range(s, e, B):
            qe = min(qs + B, e)
            i = blk - first  # block index inside the document
            kf = k[s:qe].float().repeat_interleave(rep, dim=1)  # [P, H, D], P = prefix keys
            logits = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), kf) * scale  # [H, bl, P]
            # causal inside the diagonal block: query qs + a sees keys up to qs + a
            a = torch.arange(qe - qs).view(-1, 1)
            c = torch.arange(qe - s).view(1, -1)
            logits.masked_fill_(c > a + (qs - s), float("-inf"))
            p = torch.softmax(logits, dim=-1)
            # head h keeps the first kv_cnt[h, blk] entries of its row; the rest go to a dump column
            row = kv_idx[:, blk]  # [H, W]
            valid = torch.arange(row.shape[1]).view(1, -1) < kv_cnt[:, blk].view(-1, 1)
            keep_blk = torch.zeros((H, i + 2), dtype=torch.bool)
            keep_blk = keep_blk.scatter_(1, torch.where(valid, row - first, i + 1), True)[:, :i + 1]
            keep_tok = keep_blk.repeat_interleave(B, dim=1)[:, : qe - s]  # [H, P]
            mass += (p * keep_tok.unsqueeze(1)).sum((1, 2)).double()
            blk += 1
    return Recall(mass, T, plan.kept_pairs, plan.causal_pairs)
