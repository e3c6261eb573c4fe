"""SparseBalance kernels: block top-k sparse attention behind one interface.

``sparse_attention(q, k, v, cu_seqlens, *, topk, ...)`` dispatches to one of the
backends in :data:`BACKENDS` (reference, cpu, triton, cuda, flex). Importing this
package never needs the compiled extensions or Triton.
"""

from sparsebalance.ops.autoselect import resolve_backend
from sparsebalance.ops.backends import (
    BACKENDS,
    HAS_CPU_EXT,
    HAS_CUDA_EXT,
    HAS_FLEX,
    HAS_TRITON,
    is_available,
    override_backend,
)
from sparsebalance.ops.interface import sparse_attention
from sparsebalance.ops.plan import RoutingPlan, build_plan

__all__ = [
    "BACKENDS", "HAS_CPU_EXT", "HAS_CUDA_EXT", "HAS_FLEX", "HAS_TRITON", "RoutingPlan", "build_plan",
    "is_available", "override_backend", "resolve_backend", "sparse_attention",
]
