"""Block top-k routing plan shared by every kernel backend.

The plan is computed once per call in plain PyTorch (fp32 gate, stable sort)
and handed to the cpu / triton / cuda kernels as small int32 tables, so all
backends select exactly the same key blocks.

Blocks are numbered globally over the packed batch: document ``d`` of length
``L`` contributes ``ceil(L / B)`` consecutive blocks (the last may be partial).
Because a key block of a document is also one of its query blocks, key blocks
are referenced by the same global block id.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

TopK = Union[int, torch.Tensor]


@dataclass
class RoutingPlan:
    """Which key blocks every (head, query block) attends to."""

    block_size: int
    """Routing block size B in tokens."""
    qb_start: torch.Tensor
    """int32 ``[NB]``: first token (global index) of each block."""
    qb_len: torch.Tensor
    """int32 ``[NB]``: tokens in each block (1..B)."""
    kv_idx: torch.Tensor
    """int32 ``[H, NB, W]``: kept key block ids, ascending; the diagonal block is the
    last valid entry (at ``kv_cnt - 1``); -1 pads the row."""
    kv_cnt: torch.Tensor
    """int32 ``[NB]``: kept key blocks per query block (same for every head)."""
    kept_pairs: int
    """Kept (query, key) pairs summed over heads and documents."""
    causal_pairs: int
    """Causal (query, key) pairs summed over heads and documents."""

    @property
    def density(self) -> float:
        """Kept pairs / causal pairs (1.0 for an empty batch)."""
        return self.kept_pairs / self.causal_pairs if self.causal_pairs else 1.0

    def to(self, device: torch.device) -> "RoutingPlan":
        """The same plan with its tables on ``device``."""
        mv = lambda t: t.to(device, non_blocking=True)
        return RoutingPlan(self.block_size, mv(self.qb_start), mv(self.qb_len), mv(self.kv_idx),
                           mv(self.kv_cnt), self.kept_pairs, self.causal_pairs)


def _per_doc_topk(topk: TopK, n_docs: int) -> torch.Tensor:
    """topk as an int64 CPU tensor of one value per document."""
    if isinstance(topk, torch.Tensor):
        t = topk.detach().to("cpu", torch.int64).reshape(-1)
        if t.numel() == 1:
            t = t.expand(n_docs)
        return t.clone()
    return torch.full((n_docs,), int(topk), dtype=torch.int64)


def doc_block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 mean over each block of one document ``x [L, heads, D]`` -> ``[ceil(L/B), heads, D]``."""
    L = x.shape[0]
    nfull = L // block_size
    x = x.float()
    parts = [x[: nfull * block_size].view(nfull, block_size, *x.shape[1:]).mean(1)]
    if L > nfull * block_size:
        parts.append(x[nfull * block_size:].mean(0, keepdim=True))
    return torch.cat(parts, 0)


def select_topk(g: torch.Tensor, k: int) -> torch.Tensor:
    """Column ids of the ``k`` largest entries per row of ``g``, ascending (ties: lower index).

    ``g [..., n]`` has ``-inf`` where a column is not a candidate; every row must have
    at least ``k`` candidates. Returns int64 ``[..., k]``.
    """
    if k == 0:
        return torch.zeros(g.shape[:-1] + (0,), dtype=torch.int64, device=g.device)
    vals, idx = torch.topk(g, k, dim=-1, sorted=False)
    t = vals.amin(-1, keepdim=True)
    eq = g == t
    if bool((eq.sum(-1) == 1).all()):  # no tie at the threshold: topk's set is exact
        return idx.sort(-1).values
    # Ties at the k-th value: keep everything above it, fill from the left with ties.
    gt = g > t
    need = k - gt.sum(-1, keepdim=True)
    chosen = gt | (eq & (eq.cumsum(-1) <= need))
    n = g.shape[-1]
    cols = torch.arange(n, device=g.device).expand_as(chosen)
    return torch.where(chosen, cols, n).sort(-1).values[..., :k]


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    # The plan is a few dozen small ops; waking torch's intra-op pool for each costs
    # more than the work (16K tokens, 2 busy cores: ~25 ms on 1 thread, ~250 ms on 2).
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@torch.no_grad()
def build_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor,
    topk: TopK,
    block_size: int,
    softmax_scale: float,
) -> RoutingPlan:
    """Route every query block of every head (inputs assumed validated).

    Args:
        q: ``[T, H, D]``; k: ``[T, Hkv, D]``.
        cu_seqlens: int ``[n_docs + 1]`` document boundaries.
        topk: int, or int tensor ``[n_docs]`` (one budget per document).
        block_size: B, tokens per block.
        softmax_scale: scale of the gate (same as the attention's).

    Returns:
        The :class:`RoutingPlan`, tables on ``q.device``.
    """
    with _one_intra_op_thread():
        return _build_plan(q, k, cu_seqlens, topk, block_size, softmax_scale)


def _build_plan(q, k, cu_seqlens, topk, block_size, softmax_scale) -> RoutingPlan:
    dev = q.device
    H = q.shape[1]
    hkv = k.shape[1]
    B = int(block_size)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    n_docs = lens.numel()
    kd = _per_doc_topk(topk, n_docs)
    nb = (lens + B - 1) // B  # blocks per document
    NB = int(nb.sum())
    doc_of = torch.repeat_interleave(torch.arange(n_docs), nb)
    first_block = torch.cumsum(nb, 0) - nb  # global id of each document's block 0
    i_in_doc = torch.arange(NB) - first_block[doc_of]
    qb_start = starts[doc_of] + i_in_doc * B
    qb_len = torch.minimum(lens[doc_of] - i_in_doc * B, torch.tensor(B))
    # kept blocks per query block: diagonal, sink (if i > 0) and min(topk, i - 1).
    kv_cnt = 1 + (i_in_doc > 0).long() + torch.minimum(kd[doc_of], (i_in_doc - 1).clamp(min=0))
    W = int(kv_cnt.max()) if NB else 1
    # Default rows (all of blocks 0..i kept) are exact wherever i <= topk + 1.
    e = torch.arange(W)
    dense = first_block[doc_of].view(-1, 1) + e.view(1, -1)
    kv_idx = torch.where(e.view(1, -1) <= i_in_doc.view(-1, 1), dense, torch.tensor(-1))
    kv_idx = kv_idx.unsqueeze(0).expand(H, NB, W).clone()

    sel_docs = torch.nonzero(nb > kd + 2).flatten().tolist()
    rep = H // hkv
    for d in sel_docs:
        f, n, kk = int(first_block[d]), int(nb[d]), int(kd[d])
        s0, L = int(starts[d]), int(lens[d])
        r0 = kk + 2  # first query block with a real choice
        qm = doc_block_means(q[s0:s0 + L], B)[r0:]  # [n - r0, H, D]
        km = doc_block_means(k[s0:s0 + (n - 1) * B], B).repeat_interleave(rep, dim=1)
        g = torch.einsum("ihd,jhd->hij", qm * softmax_scale, km)  # [H, n - r0, n - 1]
        i = torch.arange(r0, n, device=dev).view(-1, 1)
        j = torch.arange(n - 1, device=dev).view(1, -1)
        cand = (j >= 1) & (j < i)
        chosen = select_topk(g.masked_fill_(~cand, float("-inf")), kk)  # [H, n - r0, kk]
        ids = torch.cat([torch.zeros_like(i).expand(H, n - r0, 1), chosen,
                         i.expand(H, n - r0, 1)], -1)  # sink, chosen ascending, diagonal
        kv_idx[:, f + r0:f + n, : kk + 2] = (ids + f).to("cpu")
        kv_idx[:, f + r0:f + n, kk + 2:] = -1
    bl = qb_len
    full = (kv_cnt - 1) * B * bl + bl * (bl + 1) // 2
    return RoutingPlan(
        block_size=B,
        qb_start=qb_start.to(torch.int32).to(dev),
        qb_len=qb_len.to(torch.int32).to(dev),
        kv_idx=kv_idx.to(torch.int32).to(dev),
        kv_cnt=kv_cnt.to(torch.int32).to(dev),
        kept_pairs=int(full.sum()) * H,
        causal_pairs=int((lens * (lens + 1) // 2).sum()) * H,
    )


@torch.no_grad()
def reverse_index(plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (head, key block), the query blocks that keep it (CSR form).

    Used by the GPU backward kernels that own one key block each (no atomics).

    Returns:
        ``rev_ptr`` int32 ``[H, NB + 1]`` (offsets into ``rev_q`` for each head's row,
        relative to that head's segment) and ``rev_q`` int32 ``[H, NNZ]`` query block
        ids sorted by key block then query block; NNZ is the same for every head.
    """
    H, NB, W = plan.kv_idx.shape
    kv = plan.kv_idx.long()
    valid = kv >= 0
    qb = torch.arange(NB, device=kv.device).view(1, NB, 1).expand(H, NB, W)
    nnz = int(valid[0].sum())
    keys = torch.where(valid, kv * NB + qb, torch.full_like(kv, NB * NB + NB))
    keys = torch.sort(keys.reshape(H, -1), dim=-1).values[:, :nnz]
    rev_q = (keys % NB).to(torch.int32)
    kb = keys // NB
    counts = torch.zeros((H, NB), dtype=torch.int64, device=kv.device)
    counts.scatter_add_(1, kb, torch.ones_like(kb))
    rev_ptr = torch.zeros((H, NB + 1), dtype=torch.int64, device=kv.device)
    rev_ptr[:, 1:] = torch.cumsum(counts, 1)
    return rev_ptr.to(torch.int32), rev_q.contiguous()


def default_scale(head_dim: int, softmax_scale: Optional[float]) -> float:
    """``softmax_scale`` or ``1 / sqrt(head_dim)``."""
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
