"""The public entry point :func:`sparse_attention` and its input validation."""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Union

import torch

from sparsebalance.ops.autoselect import resolve_backend
from sparsebalance.ops.backends import kept_density, run_backend
from sparsebalance.ops.kept import KeptPairs
from sparsebalance.ops.plan import RoutingRule, collect_plans, host_cu, routing_rule

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _validate(q, k, v, cu_seqlens, topk, block_size, softmax_scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [T, heads, head_dim], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must have q's dtype {q.dtype}, got {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"k and v must be on q's device {q.device}, got {k.device}, {v.device}")
    T, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must be [T={T}, Hkv, D={D}], got {tuple(k.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"k heads ({k.shape[1]}) must divide q heads ({H})")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D int tensor [n_docs + 1]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    if cu_seqlens.device.type != "cpu" and cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on the CPU or on q's device, got {cu_seqlens.device}")
    cu = host_cu(cu_seqlens)  # one host copy per micro-batch, shared with the routing plan
    if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, "
                         f"got {cu.tolist() if cu.size <= 8 else cu}")
    n_docs = cu.size - 1
    if isinstance(topk, torch.Tensor):
        if topk.dtype.is_floating_point or topk.dtype == torch.bool or topk.dtype.is_complex:
            raise ValueError(f"topk tensor must be an integer tensor, got {topk.dtype}")
        if topk.numel() not in (1, n_docs):
            raise ValueError(f"topk tensor must hold 1 or n_docs={n_docs} values, got {topk.numel()}")
        if bool((topk < 0).any()):
            raise ValueError("topk must be >= 0")
    elif isinstance(topk, bool) or not isinstance(topk, int):
        raise ValueError(f"topk must be an int or an int tensor, got {type(topk).__name__}")
    elif topk < 0:
        raise ValueError(f"topk must be >= 0, got {topk}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float))
                                          and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    topk: Union[int, torch.Tensor],
    block_size: int = 64,
    softmax_scale: Optional[float] = None,
    backend: str = "auto",
    return_density: bool = False,
    threshold: Optional[float] = None,
    topk_min: int = 0,
    return_doc_kept: bool = False,
    per_head: bool = True,
    return_head_kept: bool = False,
    return_kept: bool = False,
):
    """Block top-k sparse causal attention over packed documents.

    Shapes: ``q [T, H, D]``; ``k, v [T, Hkv, D]`` with ``H % Hkv == 0`` (GQA: query
    head ``h`` uses kv head ``h // (H // Hkv)``); ``cu_seqlens`` int32 ``[n_docs + 1]``
    (0 = first entry <= ... <= last = T). float32 or bfloat16 (fp32 accumulation);
    float16 on the ``fa4`` and ``reference`` backends.

    Mask: per document, head and query block ``i`` (blocks of ``block_size`` tokens
    from the document start; the last may be partial), the gate is
    ``g[i, j] = mean(q in block i) . mean(k in block j) * scale`` for key blocks
    ``j < i``. The query block attends to its own block (token-causal), to block 0
    (sink) and to the ``topk`` blocks among ``1 .. i-1`` with the largest gate (ties:
    lower index), with exact softmax over those tokens. A document with at most
    ``topk + 2`` blocks is plain causal attention. Attention never crosses documents.
    Selection is not differentiated; the output is differentiable in q, k, v.

    Args:
        topk: key blocks chosen besides sink and diagonal; an int, or an int tensor
            with one budget per document.
        block_size: routing block size in tokens.
        softmax_scale: logit (and gate) scale, default ``1 / sqrt(D)``.
        backend: "auto" or a name of :data:`~sparsebalance.ops.backends.BACKENDS`
            ("reference", "cpu", "triton", "cuda", "flex", "fa4"); "auto" on CUDA is the fastest
            verified backend for this head dim, block size and dtype
            (:mod:`sparsebalance.ops.autoselect`).
        return_density: also return kept (query, key) pairs / causal pairs (float).
        threshold: threshold routing (:class:`~sparsebalance.ops.plan.RoutingRule`): per
            (query block, head) the smallest count of candidates holding this share of the
            head's gate softmax, within ``[topk_min, topk]``; None: top-k routing.
        topk_min: threshold routing's least count (ignored by top-k routing).
        per_head: threshold routing's count per (query block, head) (default); False: one
            count per query block, the largest over its heads, kept by every head.
        return_head_kept: also return each query head's kept pairs over documents (int64
            numpy ``[H]``; None for a backend that does not route by the shared plan).
        return_doc_kept: also return each document's kept pairs over heads (int64 numpy
            ``[n_docs]``; None for a backend that does not route by the shared plan).
        return_kept: also return all of the kept pairs as a
            :class:`~sparsebalance.ops.kept.KeptPairs` (per document and head when the
            backend routed by the shared plan), read from the device only when first used:
            threshold routing's counts stay there, so nothing here waits for the device.

    Returns:
        ``out [T, H, D]`` in q's dtype, followed by what was asked for, in this order:
        ``density``, ``doc_kept``, ``head_kept``, ``kept`` (``out`` alone when nothing was).

    Raises:
        ValueError: naming the bad argument.
    """
    _validate(q, k, v, cu_seqlens, topk, block_size, softmax_scale)
    rule = None if threshold is None else RoutingRule(threshold=float(threshold), topk_min=topk_min,
                                                      per_head=bool(per_head))
    name = resolve_backend(backend, q.device, q.shape[2], block_size, q.dtype)
    collect = return_doc_kept or return_head_kept
    with routing_rule(rule), (collect_plans() if collect else contextlib.nullcontext([])) as plans:
        out, kept = run_backend(name, q, k, v, cu_seqlens, topk, block_size, softmax_scale)
    plan = plans[0] if len(plans) == 1 else None
    extra = ([kept_density(kept, cu_seqlens, q.shape[1])] if return_density else []) \
        + ([None if plan is None else plan.doc_kept] if return_doc_kept else []) \
        + ([None if plan is None else plan.head_kept] if return_head_kept else []) \
        + ([kept if isinstance(kept, KeptPairs) else KeptPairs(total=int(kept))] if return_kept else [])
    return (out, *extra) if extra else out
