"""The ``cuda`` backend: sparsebalance._C_cuda (csrc/cuda) behind custom ops and autograd.

Only usable where the CUDA extension was built (setup.py builds it when torch
has CUDA and nvcc exists).
"""

from __future__ import annotations

import torch

from sparsebalance.ops import _ext
from sparsebalance.ops.autograd_factory import make_attention_function, register_fakes


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


register_fakes(cuda_sparse_attn_fwd, cuda_sparse_attn_bwd)

cuda_sparse_attention = make_attention_function(
    cuda_sparse_attn_fwd, cuda_sparse_attn_bwd, '_CudaSparseAttention')
cuda_sparse_attention.__doc__ = 'Sparse attention of CUDA ``q [T, H, D]``, ``k, v [T, Hkv, D]`` along ``plan``.'
