"""The autograd and fake-op plumbing shared by the kernel backends (cpu, triton, cuda).

Every backend exposes the same pair of custom ops — ``fwd(q, k, v, *tables,
block_size, scale) -> (out [T, H, D], lse2 [H, T] fp32)`` and
``bwd(dout, q, k, v, out, lse2, *tables, [*reverse,] block_size, scale) -> (dq, dk, dv)``
— so one autograd.Function factory serves all; only the kernels differ. The GPU
backward kernels also take the plan's reverse index (which query blocks read each key
block, for dk/dv without atomics); the CPU kernel derives what it needs itself.
"""

from __future__ import annotations

import torch

from sparsebalance.ops.plan import RoutingPlan, reverse_index


def register_fakes(fwd_op, bwd_op) -> None:
    """Shape-only (meta) implementations of a backend's fwd/bwd custom ops."""

    @fwd_op.register_fake
    def _(q, k, v, qb_start, qb_len, kv_idx, kv_cnt, block_size, scale):
        return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @bwd_op.register_fake
    def _(dout, q, k, v, *tables_and_scalars):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def make_attention_function(fwd_op, bwd_op, name: str, reverse: bool = True):
    """Returns ``apply(q, k, v, plan, scale) -> out`` differentiable in q, k, v
    (``reverse``: pass the plan's reverse index to ``bwd_op``)."""

    class _SparseAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, plan: RoutingPlan, scale: float):
            tabs = (plan.qb_start, plan.qb_len, plan.kv_idx, plan.kv_cnt)
            out, lse2 = fwd_op(q, k, v, *tabs, plan.block_size, scale)
            ctx.save_for_backward(q, k, v, out, lse2, *tabs,
                                  *(reverse_index(plan) if reverse else ()))
            ctx.block_size, ctx.scale = plan.block_size, scale
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse2, *tabs = ctx.saved_tensors
            dq, dk, dv = bwd_op(dout.contiguous(), q, k, v, out, lse2, *tabs,
                                ctx.block_size, ctx.scale)
            return dq, dk, dv, None, None

    _SparseAttention.__name__ = _SparseAttention.__qualname__ = name

    def apply(q, k, v, plan: RoutingPlan, scale: float) -> torch.Tensor:
        return _SparseAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                      plan.to(q.device), scale)

    return apply
