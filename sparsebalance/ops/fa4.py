"""The ``fa4`` backend: the routing plan run by FlashAttention-4's block-sparse kernels.

The selection is :func:`~sparsebalance.ops.plan.build_plan`'s, the one every backend
uses; this file turns it into the descriptors of the ``flash-attn-4`` package
(``flash_attn.cute.flash_attn_func`` with ``block_sparse_tensors`` for the forward and
``block_sparse_tensors_bwd`` for the backward) and runs them. No torch.compile: FA4
JIT-compiles its CuTeDSL kernels once per compile key (dtype, head dims, GQA ratio,
mask_mod, tiles), and nothing here puts a length or a budget into that key.

Layout. FA4's block-sparse backward takes no varlen, so the documents go through the
block-aligned buffer of the flex backend (:func:`~sparsebalance.ops.flex.flex_layout`):
the plan's global block ``b`` fills buffer rows ``[b * B, (b + 1) * B)``, every document
starts on a block boundary and its last block is zero padded. Unlike flex there is no
bucket padding: FA4's compile key does not hold the sequence length, so the buffer is
exactly the plan's blocks; when every document fills whole blocks it is the tokens
themselves (nothing copied). The buffer is one batch row, ``[1, NB * B, H, D]``, FA4's own
layout (no transposes).

Descriptors (``BlockSparseTensorsTorch``, int32, batch 1, one row per query head):

- forward, key direction: per query block ``m`` the *full* blocks are the kept key
  blocks before the diagonal (same document, ``B`` real tokens each: no mask inside)
  and the one *mask* block is the diagonal, masked by the causal ``mask_mod``
  (``q >= kv`` in buffer rows; a short block's padding keys sit after its real queries).
- backward, query direction: per key block ``n`` the query blocks that keep it; the
  diagonal is again the one mask block, the others are full. Built on the device by one
  sort of the kept (key block, query block) pairs, each placed at its rank in its key
  block's row (ascending): no host sync, no sort of an ``NB x NB`` table.

A block never holds two documents, so no document mask is needed. Padding rows are
zeros (finite scores), their outputs are dropped and their gradients are zero.

Compilations are counted by the keys in FA4's JIT caches (:func:`compile_count`), so a
GPU test fails if a second step with new lengths and budgets compiles anything.

On a machine without ``flash-attn-4`` (every CPU machine) :data:`HAS_FA4` is False:
``auto`` never picks fa4 and a forced ``fa4`` is refused in one line by the registry.
The descriptor builders are plain torch and run on the CPU (tests compare them with the
reference selection).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sparsebalance.ops.flex import FlexLayout, cached_layout
from sparsebalance.ops.plan import (
    MICROBATCHES_CACHED,
    RoutingPlan,
    TensorCache,
    TopK,
    build_plan,
    fused_route,
    run_fused,
)


def _has_fa4() -> bool:
    try:  # flash-attn 2 installs a ``flash_attn`` without ``cute``
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


HAS_FA4 = _has_fa4()
"""``flash-attn-4`` (``flash_attn.cute``) is installed (found, not imported: importing it
loads CuTeDSL, which the CPU never needs)."""
_imports: list = []


def fa4_importable() -> bool:
    """``flash_attn.cute`` is installed and imports (checked once per process): an
    install missing a piece (CuTeDSL's libraries) makes fa4 unavailable, not a crash."""
    if not _imports:
        ok = HAS_FA4
        if ok:
            try:
                import flash_attn.cute  # noqa: F401
            except Exception:  # any failure of a third-party import: fa4 is just absent
                ok = False
        _imports.append(ok)
    return _imports[0]

FA4_BLOCK = 128
"""The routing block FA4's Hopper kernels take: the sparse key block must equal the key
tile (128), and the query block must be a multiple of the query tile (64 or 128)."""


@dataclass
class FA4Descriptors:
    """The block-sparse tables of one call, int32 on the plan's device, batch dim 1."""

    fwd_full_cnt: torch.Tensor
    """``[1, H, NB]``: full key blocks of each query block (the kept blocks before the diagonal)."""
    fwd_full_idx: torch.Tensor
    """``[1, H, NB, max(W - 1, 1)]``: their ids, ascending, left-packed."""
    bwd_full_cnt: torch.Tensor
    """``[1, H, NB]``: query blocks keeping each key block as a full block."""
    bwd_full_idx: torch.Tensor
    """``[1, H, NB, NB]``: their ids, ascending, left-packed."""
    diag_cnt: torch.Tensor
    """``[1, H, NB]`` ones: the one mask block of each row (both directions)."""
    diag_idx: torch.Tensor
    """``[1, H, NB, 1]``: that block, the row's own id."""
    block_size: int

    def forward_tensors(self):
        """FA4's ``block_sparse_tensors`` (key direction)."""
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        B = self.block_size
        return BlockSparseTensorsTorch(self.diag_cnt, self.diag_idx, self.fwd_full_cnt,
                                       self.fwd_full_idx, block_size=(B, B))

    def backward_tensors(self):
        """FA4's ``block_sparse_tensors_bwd`` (query direction)."""
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        B = self.block_size
        return BlockSparseTensorsTorch(self.diag_cnt, self.diag_idx, self.bwd_full_cnt,
                                       self.bwd_full_idx, block_size=(B, B))


_constants = TensorCache(MICROBATCHES_CACHED)
"""kv_cnt tensor, heads -> (forward full counts, diagonal counts, diagonal ids): the tables
that depend on the counts only (top-k routing: one kv_cnt tensor serves every layer of a
micro-batch)."""


def _count_tables(kv_cnt: torch.Tensor, H: int, NB: int) -> tuple:
    def build():
        i32 = dict(dtype=torch.int32, device=kv_cnt.device)
        full_cnt = (kv_cnt.to(torch.int32).expand(H, NB) - 1).clamp(min=0).unsqueeze(0).contiguous()
        diag_idx = torch.arange(NB, **i32).view(1, 1, NB, 1).expand(1, H, NB, 1).contiguous()
        return full_cnt, torch.ones((1, H, NB), **i32), diag_idx

    return _constants.get(kv_cnt, H, build)


@torch.no_grad()
def fa4_descriptors(plan: RoutingPlan) -> FA4Descriptors:
    """The forward and backward block-sparse tables of ``plan`` (device ops, no host sync).

    ``plan.kv_cnt`` may be ``[NB]`` (one count for every head) or ``[H, NB]``. The tables
    that depend on the counts only are cached per micro-batch. Where the routing runs fused
    (:func:`~sparsebalance.ops.plan.fused_route`) and the plan knows its documents' ends,
    the query-direction lists are one Triton kernel
    (:func:`~sparsebalance.ops.route_kernels.bwd_descriptors`); otherwise torch ops.
    """
    bwd = None
    if plan.doc_end is not None and fused_route(plan.kv_idx.device):
        from sparsebalance.ops.route_kernels import bwd_descriptors

        bwd = run_fused(bwd_descriptors, plan.kv_idx, plan.doc_end)
    return _descriptors(plan, bwd)


@torch.no_grad()
def torch_descriptors(plan: RoutingPlan) -> FA4Descriptors:
    """:func:`fa4_descriptors` with the query-direction lists by torch ops (the tests' oracle)."""
    return _descriptors(plan, None)


def _descriptors(plan: RoutingPlan, bwd: Optional[tuple]) -> FA4Descriptors:
    """The forward tables of ``plan`` and ``bwd`` = (counts, lists), or the lists by torch ops."""
    H, NB, W = plan.kv_idx.shape
    full_cnt, diag_cnt, diag_idx = _count_tables(plan.kv_cnt, H, NB)
    if W > 1:  # entries past a row's count (its diagonal, the -1 padding) are never read
        full_idx = plan.kv_idx[:, :, :W - 1].clamp(min=0)
    else:
        full_idx = torch.zeros((H, NB, 1), dtype=torch.int32, device=plan.kv_idx.device)
    bwd_cnt, bwd_idx = bwd if bwd is not None else _query_lists(full_cnt[0], full_idx)
    return FA4Descriptors(
        fwd_full_cnt=full_cnt, fwd_full_idx=full_idx.unsqueeze(0), bwd_full_cnt=bwd_cnt.unsqueeze(0),
        bwd_full_idx=bwd_idx.unsqueeze(0), diag_cnt=diag_cnt, diag_idx=diag_idx, block_size=plan.block_size)


def _query_lists(full_cnt: torch.Tensor, full_idx: torch.Tensor) -> tuple:
    """Per key block the query blocks keeping it as a full block, from the key-direction
    lists ``full_cnt [H, NB]``, ``full_idx [H, NB, Wf]``: ``(cnt [H, NB], idx [H, NB, NB])``
    int32, ascending, zero past each count. The (key block n, query block m) pairs sorted by
    n then m (one sort of the kept entries, not of an NB x NB table), each placed at its
    rank within its key block's row."""
    (H, NB, Wf), dev = full_idx.shape, full_idx.device
    valid = torch.arange(Wf, device=dev).view(1, 1, Wf) < full_cnt.unsqueeze(-1)
    m = torch.arange(NB, device=dev).view(1, NB, 1)
    key = torch.where(valid, full_idx.long() * NB + m, NB * NB).view(H, -1)
    key = key.sort(dim=-1).values
    ok = key < NB * NB
    n_s = torch.where(ok, key // NB, NB)  # NB: the dump row of the padding entries
    counts = torch.zeros((H, NB + 1), dtype=torch.int64, device=dev).scatter_add_(1, n_s, ok.long())
    start = counts.cumsum(1) - counts
    pos = torch.arange(key.shape[1], device=dev).view(1, -1) - start.gather(1, n_s)
    idx = torch.zeros((H, (NB + 1) * NB), dtype=torch.int32, device=dev)
    idx.scatter_(1, torch.where(ok, n_s * NB + pos, NB * NB), torch.where(ok, key % NB, 0).to(torch.int32))
    return counts[:, :NB].to(torch.int32).contiguous(), idx[:, :NB * NB].view(H, NB, NB).contiguous()


_mask_mod: list = []


def causal_mask_mod() -> Callable:
    """The CuTeDSL ``mask_mod`` of the diagonal block: ``q >= kv`` in buffer rows. One
    function object per process, so its hash in FA4's compile key never changes."""
    if not _mask_mod:
        import cutlass.cute as cute

        @cute.jit
        def sb_causal(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
            return q_idx >= kv_idx

        _mask_mod.append(sb_causal)
    return _mask_mod[0]


def compile_count() -> int:
    """Kernels FA4 holds compiled in this process (keys of its JIT caches); 0 without FA4."""
    if not HAS_FA4:
        return 0
    from flash_attn.cute import interface as fi

    fns = ("_flash_attn_fwd", "_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert")
    caches = [getattr(getattr(fi, f, None), "compile_cache", None) for f in fns]
    return sum(len(getattr(c, "cache", {})) for c in caches if c is not None)


def fa4_prepare(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, topk: TopK,
                block_size: int, scale: float, plan: Optional[RoutingPlan] = None):
    """Routing and everything FA4 needs before its kernels: ``(plan, layout, descriptors)``.
    ``plan``: reuse a selection made before (the recompute of the same micro-batch)."""
    if plan is None:
        plan = build_plan(q, k, cu_seqlens, topk, block_size, scale)
    layout = cached_layout(cu_seqlens, block_size, q.device, reuse=False, bucket=False)
    return plan, layout, fa4_descriptors(plan)


def _is_identity(layout: FlexLayout) -> bool:
    """Every document fills whole blocks: buffer row ``t`` is token ``t``, no padding."""
    return layout.padded_tokens == layout.tokens


def _to_buffer(x: torch.Tensor, layout: FlexLayout) -> torch.Tensor:
    """``[T, h, D]`` -> ``[1, NB * B, h, D]``: tokens at their buffer rows, zeros elsewhere
    (differentiable: the gradient of ``x`` is the buffer's gradient at those rows); with no
    padding, ``x`` itself (a view, nothing copied)."""
    if _is_identity(layout):
        return x.unsqueeze(0)
    buf = x.new_zeros((layout.padded_tokens,) + tuple(x.shape[1:]))
    return buf.index_copy(0, layout.pos, x).unsqueeze(0)


def fa4_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: FlexLayout,
            desc: FA4Descriptors, scale: float) -> torch.Tensor:
    """``q [T, H, D]``, ``k, v [T, Hkv, D]`` (CUDA, bf16 or fp16) through the buffer and
    FA4's block-sparse kernels: ``out [T, H, D]``, differentiable in q, k, v."""
    from flash_attn.cute import flash_attn_func

    out, _ = flash_attn_func(
        _to_buffer(q, layout), _to_buffer(k, layout), _to_buffer(v, layout),
        softmax_scale=scale, causal=False, pack_gqa=False, mask_mod=causal_mask_mod(),
        block_sparse_tensors=desc.forward_tensors(),
        block_sparse_tensors_bwd=desc.backward_tensors())
    return out[0] if _is_identity(layout) else out[0].index_select(0, layout.pos)


def check_inputs(q: torch.Tensor, block_size: int) -> None:
    """Raise ValueError (one line) for what FA4's kernels cannot run."""
    if q.device.type != "cuda":
        raise ValueError("backend 'fa4' runs on CUDA tensors only (FlashAttention-4)")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"backend 'fa4' needs bfloat16 or float16 tensors, got {q.dtype}")
    if block_size != FA4_BLOCK:
        raise ValueError(f"backend 'fa4' needs --sb-block-size {FA4_BLOCK} (FA4's key tile), "
                         f"got {block_size}")
    if q.shape[2] % 8 or q.shape[2] > 256:
        raise ValueError(f"backend 'fa4' needs a head dim that is a multiple of 8 and <= 256, "
                         f"got {q.shape[2]}")


def fa4_sparse_attention(q, k, v, cu_seqlens, topk, block_size, scale):
    """Backend ``fa4`` (the registry's signature): ``(out [T, H, D], the plan's KeptPairs)``."""
    if q.shape[0] == 0:
        return q.clone(), 0
    check_inputs(q, block_size)
    plan, layout, desc = fa4_prepare(q, k, cu_seqlens, topk, block_size, scale)
    return fa4_run(q, k, v, layout, desc, scale), plan.kept
