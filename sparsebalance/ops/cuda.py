"""The ``cuda`` backend: sparsebalance._C_cuda (csrc/cuda) behind custom ops and autograd.

Only usable where the CUDA extension was built (setup.py builds it when torch
has CUDA and nvcc exists).
"""

from __future__ import annotations

import torch

from sparsebalance.ops import _ext
from sparsebalance.ops.plan import RoutingPlan, reverse_index


def _stream(t: torch.Tensor) -> int:
    # The extension (csrc/cuda) includes no c10/cuda headers, so it takes the raw stream handle.
    return torch.cuda.current_stream(t.device).cuda_stream


@torch.library.custom_op("sparsebalance::cuda_sparse_attn_fwd", mutates_args=())
def cuda_sparse_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor,
    kv_idx: torch.Tensor, kv_cnt: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [T, H, D]`` and ``lse2 [H, T]`` (fp32, base 2)."""
    with torch.cuda.device(q.device):
        out, lse2 = _ext.cuda_ext.sparse_attention_fwd(q, k, v, qb_start, qb_len, kv_idx, kv_cnt,
                                                       block_size, scale, _stream(q))
    return out, lse2


@cuda_sparse_attn_fwd.register_fake
def _(q, k, v, qb_start, qb_len, kv_idx, kv_cnt, block_size, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("sparsebalance::cuda_sparse_attn_bwd", mutates_args=())
def cuda_sparse_attn_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse2: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor, kv_idx: torch.Tensor,
    kv_cnt: torch.Tensor, rev_ptr: torch.Tensor, rev_q: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``dq, dk, dv`` shaped like q, k, v."""
    with torch.cuda.device(q.device):
        dq, dk, dv = _ext.cuda_ext.sparse_attention_bwd(dout, q, k, v, out, lse2, qb_start, qb_len,
                                                        kv_idx, kv_cnt, rev_ptr, rev_q, block_size,
                                                        scale, _stream(q))
    return dq, dk, dv


@cuda_sparse_attn_bwd.register_fake
def _(dout, q, k, v, out, lse2, qb_start, qb_len, kv_idx, kv_cnt, rev_ptr, rev_q, block_size, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _CudaSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RoutingPlan, scale: float):
        tabs = (plan.qb_start, plan.qb_len, plan.kv_idx, plan.kv_cnt)
        out, lse2 = cuda_sparse_attn_fwd(q, k, v, *tabs, plan.block_size, scale)
        ctx.save_for_backward(q, k, v, out, lse2, *tabs, *reverse_index(plan))
        ctx.block_size, ctx.scale = plan.block_size, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, *tabs = ctx.saved_tensors
        dq, dk, dv = cuda_sparse_attn_bwd(dout.contiguous(), q, k, v, out, lse2, *tabs,
                                          ctx.block_size, ctx.scale)
        return dq, dk, dv, None, None


def cuda_sparse_attention(q, k, v, plan: RoutingPlan, scale: float) -> torch.Tensor:
    """Sparse attention of CUDA ``q [T, H, D]``, ``k, v [T, Hkv, D]`` along ``plan``."""
    return _CudaSparseAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                      plan.to(q.device), scale)
