"""Plain-PyTorch block top-k sparse attention with explicit masks: the oracle.

It routes on its own (per document, a dense ``[H, Lq_blocks, L_blocks]`` gate,
no shared tables with the kernels) so the tests check the shared routing plan
too. It also supports per-token routing (``query_block_size=1``, MoBA style):
query groups of ``query_block_size`` tokens gate against key blocks of
``block_size`` tokens; a query always keeps its own key block (causal) and the
sink, plus the top-``topk`` key blocks strictly before its own block. Under threshold
routing (:func:`~sparsebalance.ops.plan.routing_rule`) ``topk`` is the cap and the count
per (query group, head) follows :class:`~sparsebalance.ops.plan.RoutingRule` (one count
per query group for all heads when the rule's ``per_head`` is False).
"""

from __future__ import annotations

from typing import Optional

import torch

from sparsebalance.ops.plan import TopK, current_rule, per_doc_topk


def _doc_mask(qd: torch.Tensor, kd: torch.Tensor, topk: int, B: int, Bq: int, scale: float) -> torch.Tensor:
    """Boolean keep mask ``[H, L, L]`` of one document (q ``[L, H, D]``, k ``[L, H, D]``)."""
    L, H, _ = qd.shape
    dev = qd.device
    nk = (L + B - 1) // B
    nq = (L + Bq - 1) // Bq
    kblk = torch.arange(L, device=dev) // B  # key block of each token
    qgrp = torch.arange(L, device=dev) // Bq  # query group of each token
    # Key block of the *last* token of each query group: that block is the
    # group's diagonal (for Bq == B it is the group's own block).
    g_last = torch.clamp((torch.arange(nq, device=dev) + 1) * Bq - 1, max=L - 1)
    g_blk = g_last // B
    qf, kf = qd.float(), kd.float()
    qm = torch.zeros((nq, H, qd.shape[2]), device=dev).index_add_(0, qgrp, qf)
    qm /= torch.bincount(qgrp, minlength=nq).view(-1, 1, 1)
    km = torch.zeros((nk, H, qd.shape[2]), device=dev).index_add_(0, kblk, kf)
    km /= torch.bincount(kblk, minlength=nk).view(-1, 1, 1)
    gate = torch.einsum("ihd,jhd->hij", qm, km) * scale  # [H, nq, nk]
    j = torch.arange(nk, device=dev).view(1, -1)
    cand = (j >= 1) & (j < g_blk.view(-1, 1))  # [nq, nk]
    keep_blk = (j == 0) | (j == g_blk.view(-1, 1))
    keep_blk = keep_blk.unsqueeze(0).expand(H, nq, nk).clone()
    rule = current_rule()
    if topk > 0 and rule.threshold is not None:
        # threshold routing, written out per query group: each head's softmax over the
        # candidates' gates, the smallest count holding TAU of it (per head, or the largest
        # over the heads for every head when the rule is per block), clamped
        g = gate.masked_fill(~cand, float("-inf"))
        ncand = cand.sum(-1)  # [nq]
        p = torch.softmax(g, dim=-1).nan_to_num(0.0)
        mass = p.sort(dim=-1, descending=True).values.cumsum(-1)
        count = (mass < rule.threshold).sum(-1) + 1  # [H, nq]
        if not rule.per_head:
            count = count.amax(0, keepdim=True).expand(H, nq)
        hi = torch.clamp(ncand, max=topk)
        count = torch.minimum(torch.maximum(count, torch.clamp(hi, max=rule.topk_min)), hi)
        order = torch.sort(g, dim=-1, descending=True, stable=True).indices  # [H, nq, nk]
        ranked = torch.arange(nk, device=dev).view(1, 1, -1) < count.unsqueeze(-1)  # [H, nq, nk]
        keep_blk |= torch.zeros_like(keep_blk).scatter_(-1, order, ranked) & cand
    elif topk > 0:
        g = gate.masked_fill(~cand, float("-inf"))
        order = torch.sort(g, dim=-1, descending=True, stable=True).indices[..., :topk]
        chosen = torch.zeros_like(keep_blk).scatter_(-1, order, True) & cand
        keep_blk |= chosen
    # expand to tokens: query token t uses its group's row; key token s its block column.
    tok = keep_blk[:, qgrp][:, :, kblk]  # [H, L, L]
    causal = torch.ones((L, L), dtype=torch.bool, device=dev).tril()
    return tok & causal


def reference_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    topk: TopK,
    block_size: int,
    softmax_scale: float,
    *,
    query_block_size: Optional[int] = None,
    return_kept_pairs: bool = False,
    route_q: Optional[torch.Tensor] = None,
):
    """Sparse attention by explicit masking (inputs assumed validated).

    Args:
        q: ``[T, H, D]``; k, v: ``[T, Hkv, D]``.
        cu_seqlens: int ``[n_docs + 1]``.
        topk: int or per-document int tensor ``[n_docs]``.
        block_size: key block size B (tokens).
        softmax_scale: logit scale (also used by the gate).
        query_block_size: tokens per query routing group; default ``block_size``;
            1 is per-token (MoBA) routing.
        return_kept_pairs: also return the number of kept (query, key) pairs.
        route_q: queries the gates are computed from (default ``q``); context
            parallelism passes the whole micro-batch's queries while ``q`` holds only
            this rank's rows (zeros elsewhere).

    Returns:
        ``[T, H, D]`` in q's dtype (computed in q's dtype, softmax in fp32 only when
        q is fp32), and the kept pair count when asked.
    """
    H = q.shape[1]
    rep = H // k.shape[1]
    Bq = block_size if query_block_size is None else int(query_block_size)
    bounds = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    kd = per_doc_topk(topk, len(bounds) - 1)
    outs, kept = [], 0
    for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e <= s:
            continue
        qd = q[s:e]
        kx = k[s:e].repeat_interleave(rep, dim=1)
        vx = v[s:e].repeat_interleave(rep, dim=1)
        rq = qd if route_q is None else route_q[s:e]
        mask = _doc_mask(rq.detach(), kx.detach(), int(kd[d]), block_size, Bq, softmax_scale)
        kept += int(mask.sum())
        logits = torch.einsum("qhd,khd->hqk", qd, kx) * softmax_scale
        logits = logits.masked_fill(~mask, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p.to(vx.dtype), vx))
    out = torch.cat(outs, 0) if outs else q.clone()  # T == 0: keep the autograd graph
    return (out, kept) if return_kept_pairs else out
