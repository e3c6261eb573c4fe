"""Context parallelism (CP) for packed documents: the token split and the K/V exchange.

Split (:mod:`sparsebalance.cp_split`, Megatron's THD layout): every document is padded
to a multiple of ``2 * cp`` tokens and cut into ``2 * cp`` equal chunks; CP rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` of every document. A routing block may
straddle two ranks' chunks: routing sums its queries over the CP group
(:func:`sparse_attention_local`), so it stays exact.
(Padding to whole routing blocks instead would put all of a document's padding in
rank 0's tail chunk and unbalance the ranks.) Padding tokens sit at the end of their
document: real tokens never attend to them and they attend to nothing (their output
is zero and they carry no loss).

Attention under CP (:func:`gather_kv`, then the module's local-query attention):
each rank all-gathers K and V over the CP group once per layer, reorders them into
the *compact* layout (the real tokens of every document, in order, as a CP=1 run
holds them) and computes its own queries' attention against whole documents. The
backward returns dK/dV to their owners (reduce-scatter with NCCL; gloo has none, so
there it is an all-reduce of which each rank keeps its own slice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sparsebalance.cp_split import local_token_index, padded_lengths


@dataclass
class CPLayout:
    """Where this CP rank's tokens sit in the whole micro-batch (host-computed, per
    micro-batch; every layer reuses it)."""

    cp: int
    """CP group size."""
    rank: int
    """This rank's index in the CP group."""
    t_local: int
    """Tokens (padding included) this rank holds: ``sum(padded) / cp``."""
    cu_real: torch.Tensor
    """int32 ``[n_docs + 1]``: document boundaries of the compact layout (real tokens only)."""
    local_rows: torch.Tensor
    """int64 ``[n]``: rows of the local tensor that hold real tokens."""
    local_pos: torch.Tensor
    """int64 ``[n]``: those tokens' indices in the compact layout."""
    gather_idx: torch.Tensor
    """int64 ``[sum(lengths)]``: for each compact position, its row in the CP all-gather
    (``[cp * t_local]``: rank-major, each rank's local order)."""
    local_docs: list
    """Per document with local real tokens: ``(doc, row0, row1)``, its slice of
    ``local_rows`` / ``local_pos``."""
    causal_pairs: int
    """Causal (query, key) pairs of this rank's real queries, per head."""

    def to(self, device: torch.device) -> "CPLayout":
        """The same layout with its index tensors on ``device``."""
        mv = lambda t: t.to(device)
        return CPLayout(self.cp, self.rank, self.t_local, self.cu_real, mv(self.local_rows),
                        mv(self.local_pos), mv(self.gather_idx), self.local_docs, self.causal_pairs)


def build_layout(lengths: Sequence[int], padded: Sequence[int], cp: int, rank: int) -> CPLayout:
    """:class:`CPLayout` of rank ``rank`` for documents of real ``lengths`` stored with
    ``padded`` lengths (each a multiple of ``2 * cp``, >= its real length)."""
    L = np.asarray(lengths, dtype=np.int64)
    P = np.asarray(padded, dtype=np.int64)
    if L.shape != P.shape or np.any(P < L):
        raise ValueError("padded lengths must be >= the real lengths, one per document")
    glob = local_token_index(P, cp, rank)  # padded-layout index of each local row
    pstart = np.cumsum(P) - P
    doc = np.searchsorted(np.cumsum(P), glob, side="right")
    pos = glob - pstart[doc]  # position inside the document
    real = pos < L[doc]
    rows = np.flatnonzero(real)
    rstart = np.cumsum(L) - L
    local_pos = rstart[doc[rows]] + pos[rows]
    # Owner of every compact position: chunk c of its document -> rank c or 2cp-1-c.
    cdoc = np.repeat(np.arange(len(L)), L)
    cpos = np.arange(int(L.sum())) - rstart[cdoc]
    S = P[cdoc] // (2 * cp)
    c = cpos // np.maximum(S, 1)
    head = c < cp
    owner = np.where(head, c, 2 * cp - 1 - c)
    lstart = (np.cumsum(P) - P) // cp  # first local row of each document (same on every rank)
    offset = cpos - c * S + np.where(head, 0, S)
    t_local = int(P.sum()) // cp
    gather_idx = owner * t_local + lstart[cdoc] + offset
    ldoc = doc[rows]
    bounds = np.flatnonzero(np.diff(ldoc)) + 1
    firsts = np.concatenate([[0], bounds]) if len(rows) else np.zeros(0, np.int64)
    lasts = np.concatenate([bounds, [len(rows)]]) if len(rows) else np.zeros(0, np.int64)
    local_docs = [(int(ldoc[a]), int(a), int(b)) for a, b in zip(firsts, lasts)]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return CPLayout(
        cp=int(cp), rank=int(rank), t_local=t_local,
        cu_real=torch.from_numpy(np.concatenate([[0], np.cumsum(L)]).astype(np.int32)),
        local_rows=t(rows), local_pos=t(local_pos), gather_idx=t(gather_idx),
        local_docs=local_docs, causal_pairs=int((pos[rows] + 1).sum()),
    )


def layout_from_cu(cu_real: torch.Tensor, cu_padded: torch.Tensor, cp: int, rank: int) -> CPLayout:
    """:func:`build_layout` from the real and padded ``cu_seqlens`` of a micro-batch."""
    r = cu_real.detach().to("cpu", torch.int64).numpy()
    p = cu_padded.detach().to("cpu", torch.int64).numpy()
    return build_layout(np.diff(r), np.diff(p), cp, rank)


_ALL_GATHER = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
_REDUCE_SCATTER = (getattr(torch.distributed, "reduce_scatter_single", None)
                   or torch.distributed.reduce_scatter_tensor)


class _GatherKV(torch.autograd.Function):
    """All-gather ``x [t_local, ...]`` over ``group``, then take rows ``idx`` of the
    ``[cp * t_local, ...]`` result; backward sends each row's gradient to its owner."""

    @staticmethod
    def forward(ctx, x, idx, group):
        cp = torch.distributed.get_world_size(group)
        full = x.new_empty((cp * x.shape[0],) + tuple(x.shape[1:]))
        # all_gather_single is torch >= 2.13's name for all_gather_into_tensor
        _ALL_GATHER(full, x.contiguous(), group=group)
        ctx.save_for_backward(idx)
        ctx.group, ctx.cp, ctx.rows = group, cp, x.shape[0]
        return full.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        n = ctx.rows
        full = grad.new_zeros((ctx.cp * n,) + tuple(grad.shape[1:]))
        full.index_add_(0, idx, grad)
        if torch.distributed.get_backend(ctx.group) == "nccl":
            out = grad.new_empty((n,) + tuple(grad.shape[1:]))
            _REDUCE_SCATTER(out, full, group=ctx.group)
        else:  # gloo has no reduce-scatter: sum everywhere, keep our slice
            torch.distributed.all_reduce(full, group=ctx.group)
            rank = torch.distributed.get_rank(ctx.group)
            out = full[rank * n:(rank + 1) * n].clone()
        return out, None, None


def gather_kv(k: torch.Tensor, v: torch.Tensor, layout: CPLayout, group):
    """Whole-document ``k, v`` in the compact layout from every CP rank's local rows.

    Args:
        k, v: ``[t_local, Hkv, D]`` local keys/values.
        layout: this micro-batch's :class:`CPLayout` (index tensors on k's device).
        group: the CP process group.
    Returns:
        ``(k_full, v_full)``, each ``[sum(lengths), Hkv, D]``; one all-gather for both.
    """
    D = k.shape[-1]
    kv = _GatherKV.apply(torch.cat([k, v], -1), layout.gather_idx, group)
    return kv[..., :D], kv[..., D:]


def depend_on_gathered(out: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor) -> torch.Tensor:
    """``out`` unchanged, but reached in backward from ``k_full`` and ``v_full``.

    The backward of :func:`gather_kv` is a collective: every rank of the CP group must
    enter it. A rank whose queries in a micro-batch are all padding (e.g. a 1-token
    document: CP rank 1 holds only its padding) attends to no key, so without this
    its autograd never reaches the gather's backward while its peers wait there for it
    (a deadlock). The empty slices add nothing and cost nothing.
    """
    return out + (k_full[:0].sum() + v_full[:0].sum()).to(out.dtype)


def local_causal_work(lengths: Sequence[int], cp: int) -> np.ndarray:
    """Per CP rank: sum over its real query tokens of the keys they attend to (causal,
    dense), and its real token count. Returns int64 ``[cp, 2]`` (work, tokens)."""
    P = padded_lengths(lengths, cp)
    out = np.zeros((cp, 2), dtype=np.int64)
    for r in range(cp):
        lay = build_layout(lengths, P, cp, r)
        out[r] = (lay.causal_pairs, len(lay.local_rows))
    return out


def sparse_attention_local(q_local, query, k_full, v_full, layout: CPLayout, group, *, topk,
                           block_size: int, scale: float, backend: str = "auto",
                           return_head_kept: bool = False):
    """Block top-k attention of this rank's queries against whole documents.

    Routing equals the CP=1 routing of the same query blocks: the gates take each
    block's query mean over ALL its tokens (the block sums are all-reduced over the CP
    group, since a block may straddle two ranks' chunks) and the key means of the
    gathered keys. The kernel runs the shared plan restricted to the blocks holding
    this rank's queries (:func:`sparsebalance.ops.plan.restrict_plan`).

    Args:
        q_local: ``[n, H, D]`` this rank's real queries (``query[layout.local_rows]``).
        query: ``[t_local, H, D]`` all local rows (the reference backend gathers them
            to route; detached).
        k_full, v_full: ``[sum(lengths), Hkv, D]`` from :func:`gather_kv`.
        topk: int budget.
    Returns:
        ``(out [n, H, D], kept_pairs)`` with kept pairs of this rank's queries (all heads),
        and with ``return_head_kept`` their kept pairs per head (int64 numpy ``[H]``).
    """
    from sparsebalance.ops.backends import plan_kernel, rule_backend
    from sparsebalance.ops.plan import build_plan, restrict_plan
    from sparsebalance.ops.reference import reference_sparse_attention

    name = rule_backend(backend, q_local.device)
    H, D = q_local.shape[1], q_local.shape[2]
    T = k_full.shape[0]
    q_full = q_local.new_zeros((T, H, D)).index_copy(0, layout.local_pos, q_local)
    reduce = lambda sums: torch.distributed.all_reduce(sums, group=group)
    plan = build_plan(q_full.detach(), k_full.detach(), layout.cu_real, topk, block_size, scale,
                      reduce_q_sums=reduce)
    plan = restrict_plan(plan, layout.local_pos, layout.causal_pairs * H)
    if name == "reference":
        with torch.no_grad():
            route_q = _GatherKV.apply(query.detach(), layout.gather_idx, group)
        out = reference_sparse_attention(q_full, k_full, v_full, layout.cu_real.to(q_full.device),
                                         topk, block_size, scale, route_q=route_q)
    else:
        out = plan_kernel(name)(q_full, k_full, v_full, plan, scale)
    out = out.index_select(0, layout.local_pos)
    return (out, plan.kept_pairs, plan.head_kept) if return_head_kept else (out, plan.kept_pairs)
