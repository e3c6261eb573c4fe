"""The ``cpu`` backend: C++ kernels (csrc/cpu) behind torch.library custom ops.

Ladder: ``sparsebalance._C`` (validates with TORCH_CHECK) -> custom ops
``sparsebalance::cpu_sparse_attn_fwd/bwd`` with fake (meta) implementations ->
the shared autograd Function (ops/autograd_factory.py) -> :func:`cpu_sparse_attention`.
"""

from __future__ import annotations

import torch

from sparsebalance.ops import _ext
from sparsebalance.ops.autograd_factory import make_attention_function, register_fakes


@torch.library.custom_op("sparsebalance::cpu_sparse_attn_fwd", mutates_args=())
def cpu_sparse_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor,
    kv_idx: torch.Tensor, kv_cnt: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``out [T, H, D]`` and ``lse2 [H, T]`` (fp32, base-2 log-sum-exp of scaled logits)."""
    out, lse2 = _ext.cpu_ext.sparse_attention_fwd(q, k, v, qb_start, qb_len, kv_idx, kv_cnt,
                                                  block_size, scale)
    return out, lse2



@torch.library.custom_op("sparsebalance::cpu_sparse_attn_bwd", mutates_args=())
def cpu_sparse_attn_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse2: torch.Tensor, qb_start: torch.Tensor, qb_len: torch.Tensor, kv_idx: torch.Tensor,
    kv_cnt: torch.Tensor, block_size: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``dq, dk, dv`` shaped like q, k, v."""
    dq, dk, dv = _ext.cpu_ext.sparse_attention_bwd(dout, q, k, v, out, lse2, qb_start, qb_len,
                                                   kv_idx, kv_cnt, block_size, scale)
    return dq, dk, dv


register_fakes(cpu_sparse_attn_fwd, cpu_sparse_attn_bwd)

cpu_sparse_attention = make_attention_function(
    cpu_sparse_attn_fwd, cpu_sparse_attn_bwd, "_CpuSparseAttention", reverse=False)
cpu_sparse_attention.__doc__ = (
    "Sparse attention of CPU ``q [T, H, D]``, ``k, v [T, Hkv, D]`` along ``plan``.")
