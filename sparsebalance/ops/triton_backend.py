"""The ``triton`` backend: launchers, custom ops and autograd for triton_kernels.py.

Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set
before triton was first imported (how the tests run it).
"""

from __future__ import annotations

import torch
import triton

from sparsebalance.ops import triton_kernels as tk
from sparsebalance.ops.autograd_factory import make_attention_function, register_fakes

_LOG2E = 1.4426950408889634
_RED_WARPS = 8
"""Warps of _reduce_kernel: its two fp32 [BLOCK, BLOCK_D] sums spill with 4 (sm_90, bf16,
block 128, D 128: 568 bytes of spill stores at 255 registers), not with 8 (255 registers)."""
DKDV_CHUNK = 0
"""Visits per dk/dv work item (0: twice the mean per segment); tests set it small."""


def _tiles(block_size: int, head_dim: int) -> tuple[int, int]:
    # tl.dot needs every tile dimension >= 16 and a power of two.
    return max(16, triton.next_power_of_2(block_size)), max(16, triton.next_power_of_2(head_dim))


def _f32(q: torch.Tensor) -> bool:
    """fp32 products: fp32 inputs, or CPU tensors (interpreter: its bf16 tl.dot is broken)."""
    return q.dtype == torch.float32 or q.device.type == "cpu"


@torch.library.custom_op("sparsebalance::triton_sparse_attn_fwd", mutates_args=())
def triton_sparse_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor,
    kv_idx: torch.Tensor, kv_cnt: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [T, H, D]`` and ``lse2 [H, T]`` (fp32, base 2)."""
    T, H, D = q.shape
    NB, W = kv_idx.shape[1], kv_idx.shape[2]
    out = torch.empty_like(q)
    lse2 = torch.empty((H, T), dtype=torch.float32, device=q.device)
    if NB:
        BLOCK, BLOCK_D = _tiles(block_size, D)
        tk._fwd_kernel[(NB, H)](q, k, v, out, lse2, qb_start, qb_len, kv_idx, kv_cnt, scale * _LOG2E,
                                q.stride(0), q.stride(1), k.stride(0), k.stride(1), T, NB, W,
                                H // k.shape[1], D, BLOCK=BLOCK, BLOCK_D=BLOCK_D, F32=_f32(q))
    return out, lse2



@torch.no_grad()
def dkdv_work(kv_idx: torch.Tensor, n_kv_heads: int, chunk: int = 0) -> dict:
    """The dk/dv pass's work items, from the plan's ``kv_idx [H, NB, W]`` (device ops only).

    A segment is (kv head, key block); its visits are the (query head, query block)
    pairs that keep that key block, packed as ``h * NB + b`` and sorted. A segment with
    more than ``chunk`` visits (default: twice the mean over non-empty segments, at
    least 16) is cut into items of ``chunk`` visits whose partial sums are reduced in
    slot order. Returns int32 tensors: ``visits``; per item ``seg``, ``lo``, ``hi``,
    ``slot`` (-1: the segment's only item); per split segment ``red_seg``,
    ``red_first``, ``red_n``; and ``n_slots`` (int).
    """
    H, NB, W = kv_idx.shape
    dev = kv_idx.device
    rep = H // n_kv_heads
    kv = kv_idx.long()
    valid = kv >= 0
    h = torch.arange(H, device=dev).view(H, 1, 1).expand(H, NB, W)
    b = torch.arange(NB, device=dev).view(1, NB, 1).expand(H, NB, W)
    seg = ((h // rep) * NB + kv)[valid]
    visit = (h * NB + b)[valid]
    n_seg = n_kv_heads * NB
    order = torch.argsort(seg * (H * NB) + visit)  # by segment, then head, then query block
    visits = visit[order].to(torch.int32)
    counts = torch.bincount(seg, minlength=n_seg)
    ptr = torch.cumsum(counts, 0) - counts  # first visit of each segment
    if chunk <= 0:
        nonempty = (counts > 0).sum().clamp(min=1)
        chunk = max(16, 2 * int(-(-int(visits.numel()) // int(nonempty))))
    n_items = (counts + chunk - 1) // chunk
    item_seg = torch.repeat_interleave(torch.arange(n_seg, device=dev), n_items)
    first_item = torch.cumsum(n_items, 0) - n_items
    c = torch.arange(item_seg.numel(), device=dev) - first_item[item_seg]
    lo = ptr[item_seg] + c * chunk
    hi = torch.minimum(lo + chunk, ptr[item_seg] + counts[item_seg])
    split = n_items > 1
    n_split_items = torch.where(split, n_items, 0)
    first_slot = torch.cumsum(n_split_items, 0) - n_split_items
    slot = torch.where(split[item_seg], first_slot[item_seg] + c, -1)
    red_seg = torch.nonzero(split).flatten()
    i32 = lambda t: t.to(torch.int32).contiguous()
    return {"visits": visits, "seg": i32(item_seg), "lo": i32(lo), "hi": i32(hi), "slot": i32(slot),
            "red_seg": i32(red_seg), "red_first": i32(first_slot[red_seg]),
            "red_n": i32(n_items[red_seg]), "n_slots": int(n_split_items.sum())}


@torch.library.custom_op("sparsebalance::triton_sparse_attn_bwd", mutates_args=())
def triton_sparse_attn_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse2: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor, kv_idx: torch.Tensor,
    kv_cnt: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``dq, dk, dv`` shaped like q, k, v."""
    T, H, D = q.shape
    NB, W = kv_idx.shape[1], kv_idx.shape[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if NB:
        delta = (dout.float() * out.float()).sum(-1).t().contiguous()  # [H, T]
        BLOCK, BLOCK_D = _tiles(block_size, D)
        hkv = k.shape[1]
        rep = H // hkv
        strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
        tk._bwd_dq_kernel[(NB, H)](q, k, v, dout, dq, lse2, delta, qb_start, qb_len, kv_idx, kv_cnt,
                                   scale * _LOG2E, scale, *strides, T, NB, W, rep, D,
                                   BLOCK=BLOCK, BLOCK_D=BLOCK_D, F32=_f32(q))
        wk = dkdv_work(kv_idx, hkv, DKDV_CHUNK)
        n_items = wk["seg"].numel()
        ws = [torch.empty((max(wk["n_slots"], 1), BLOCK, BLOCK_D), dtype=torch.float32,
                          device=q.device) for _ in range(2)]
        if n_items:
            tk._bwd_dkdv_kernel[(n_items,)](q, k, v, dout, dk, dv, *ws, lse2, delta, qb_start, qb_len,
                                            wk["seg"], wk["lo"], wk["hi"], wk["slot"], wk["visits"],
                                            scale * _LOG2E, scale, *strides, T, NB, rep, D,
                                            BLOCK=BLOCK, BLOCK_D=BLOCK_D, F32=_f32(q))
        if wk["red_seg"].numel():
            tk._reduce_kernel[(wk["red_seg"].numel(),)](dk, dv, *ws, qb_start, qb_len, wk["red_seg"],
                                                        wk["red_first"], wk["red_n"], scale,
                                                        k.stride(0), k.stride(1), NB, D,
                                                        BLOCK=BLOCK, BLOCK_D=BLOCK_D, num_warps=_RED_WARPS)
    return dq, dk, dv


register_fakes(triton_sparse_attn_fwd, triton_sparse_attn_bwd)

triton_sparse_attention = make_attention_function(
    triton_sparse_attn_fwd, triton_sparse_attn_bwd, '_TritonSparseAttention', reverse=False)
triton_sparse_attention.__doc__ = ('Sparse attention of ``q [T, H, D]``, ``k, v [T, Hkv, D]`` along ``plan`` '
                                   'with Triton.')
