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



@torch.library.custom_op("sparsebalance::triton_sparse_attn_bwd", mutates_args=())
def triton_sparse_attn_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse2: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor, kv_idx: torch.Tensor,
    kv_cnt: torch.Tensor, rev_ptr: torch.Tensor, rev_q: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``dq, dk, dv`` shaped like q, k, v."""
    T, H, D = q.shape
    NB, W = kv_idx.shape[1], kv_idx.shape[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if NB:
        delta = (dout.float() * out.float()).sum(-1).t().contiguous()  # [H, T]
        BLOCK, BLOCK_D = _tiles(block_size, D)
        rep = H // k.shape[1]
        common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), T, NB)
        tk._bwd_dq_kernel[(NB, H)](q, k, v, dout, dq, lse2, delta, qb_start, qb_len, kv_idx, kv_cnt,
                                   scale * _LOG2E, scale, *common, W, rep, D,
                                   BLOCK=BLOCK, BLOCK_D=BLOCK_D, F32=_f32(q))
        tk._bwd_dkdv_kernel[(NB, k.shape[1])](q, k, v, dout, dk, dv, lse2, delta, qb_start, qb_len,
                                              rev_ptr, rev_q, scale * _LOG2E, scale, *common,
                                              rev_q.shape[1], rep, D, BLOCK=BLOCK, BLOCK_D=BLOCK_D,
                                              F32=_f32(q))
    return dq, dk, dv


register_fakes(triton_sparse_attn_fwd, triton_sparse_attn_bwd)

triton_sparse_attention = make_attention_function(
    triton_sparse_attn_fwd, triton_sparse_attn_bwd, '_TritonSparseAttention')
triton_sparse_attention.__doc__ = 'Sparse attention of ``q [T, H, D]``, ``k, v [T, Hkv, D]`` along ``plan`` with Triton.'
