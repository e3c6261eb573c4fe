"""Backend registry: one name -> implementation map, resolved once per call.

Every implementation has the signature
``impl(q, k, v, cu_seqlens, topk, block_size, scale) -> (out, kept)`` on
validated inputs (``kept``: the kept pairs, an int or the plan's
:class:`~sparsebalance.ops.kept.KeptPairs`, which threshold routing keeps on the device
until read); :func:`run_backend` runs one by name. ``"auto"`` here is the rule
(:func:`rule_backend`): ``triton`` > ``cuda`` for CUDA tensors (on an H100 the Triton
kernels ran far faster than the SIMT CUDA extension, see docs/gpu.md) and ``cpu`` >
``reference`` for CPU tensors; :mod:`sparsebalance.ops.autoselect`, one layer up,
refines CUDA's choice by measurement. ``flex`` is
PyTorch's FlexAttention fed the same plan (:mod:`sparsebalance.ops.flex`; forward only
on the CPU); ``fa4`` is FlashAttention-4's block-sparse kernels fed the same plan
(:mod:`sparsebalance.ops.fa4`; CUDA only, needs the optional ``flash-attn-4``). Tests
steer ``"auto"`` with :func:`override_backend`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Callable, Iterator, Optional, Union

import numpy as np
import torch

from sparsebalance.ops import _ext
from sparsebalance.ops.kept import KeptPairs
from sparsebalance.ops.plan import build_plan, default_scale, host_cu
from sparsebalance.ops.reference import reference_sparse_attention

HAS_CPU_EXT = _ext.HAS_CPU_EXT
HAS_CUDA_EXT = _ext.HAS_CUDA_EXT
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def _fa4_installed() -> bool:
    from sparsebalance.ops.fa4 import HAS_FA4

    return HAS_FA4


HAS_FA4 = _fa4_installed()


def _reference(q, k, v, cu_seqlens, topk, block_size, scale):
    return reference_sparse_attention(q, k, v, cu_seqlens, topk, block_size, scale,
                                      return_kept_pairs=True)


def plan_kernel(name: str) -> Callable:
    """The kernel of backend ``name`` (``cpu``, ``triton`` or ``cuda``) that runs a built
    :class:`~sparsebalance.ops.plan.RoutingPlan`: ``kernel(q, k, v, plan, scale) -> out``."""
    if name == "cpu":
        from sparsebalance.ops.cpu import cpu_sparse_attention as kernel
    elif name == "triton":
        from sparsebalance.ops.triton_backend import triton_sparse_attention as kernel
    elif name == "cuda":
        from sparsebalance.ops.cuda import cuda_sparse_attention as kernel
    else:
        raise ValueError(f"no plan kernel for backend {name!r}")
    return kernel


def _planned(name: str) -> Callable:
    """Backend ``name``: route (:func:`build_plan`), then run :func:`plan_kernel`."""

    def impl(q, k, v, cu_seqlens, topk, block_size, scale):
        plan = build_plan(q, k, cu_seqlens, topk, block_size, scale)
        return plan_kernel(name)(q, k, v, plan, scale), plan.kept

    return impl


def _flex(q, k, v, cu_seqlens, topk, block_size, scale):
    from sparsebalance.ops.flex import flex_sparse_attention

    return flex_sparse_attention(q, k, v, cu_seqlens, topk, block_size, scale)


def _fa4(q, k, v, cu_seqlens, topk, block_size, scale):
    from sparsebalance.ops.fa4 import fa4_sparse_attention

    return fa4_sparse_attention(q, k, v, cu_seqlens, topk, block_size, scale)


BACKENDS: dict[str, Callable] = {
    "reference": _reference,
    "cpu": _planned("cpu"),
    "triton": _planned("triton"),
    "cuda": _planned("cuda"),
    "flex": _flex,
    "fa4": _fa4,
}

FP16_BACKENDS = ("fa4", "reference")
"""Backends that take float16 (the others: float32 and bfloat16)."""
_override: Optional[str] = None


def is_available(name: str, device: torch.device) -> bool:
    """Whether backend ``name`` can run on tensors of ``device``."""
    on_cuda = device.type == "cuda"
    if name == "reference":
        return True
    if name == "cpu":
        return HAS_CPU_EXT and device.type == "cpu"
    if name == "cuda":
        return HAS_CUDA_EXT and on_cuda
    if name == "flex":  # CPU: eager, forward only
        return HAS_FLEX
    if name == "fa4":  # FlashAttention-4 (flash-attn-4), CUDA only
        if not (HAS_FA4 and on_cuda):
            return False
        from sparsebalance.ops.fa4 import fa4_importable

        return fa4_importable()
    if name == "triton":  # CPU tensors only through Triton's interpreter (tests)
        return HAS_TRITON and (on_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    return False


def rule_backend(name: str, device: torch.device) -> str:
    """Map a backend name (or "auto") to a registered, usable backend name, by the rule
    (the test override, else the first available of triton, cuda on CUDA, of cpu,
    reference on the CPU); :func:`sparsebalance.ops.autoselect.resolve_backend` measures."""
    if not isinstance(name, str) or (name != "auto" and name not in BACKENDS):
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {name!r}")
    if name == "auto":
        if _override is not None:
            return _override
        order = ("triton", "cuda") if device.type == "cuda" else ("cpu", "reference")
        return next((n for n in order if is_available(n, device)), "reference")
    if not is_available(name, device):
        raise ValueError(f"backend {name!r} is not available for {device.type} tensors "
                         f"(cpu ext: {HAS_CPU_EXT}, cuda ext: {HAS_CUDA_EXT}, triton: {HAS_TRITON}, "
                         f"flex: {HAS_FLEX}, fa4: {HAS_FA4}"
                         + ("; install flash-attn-4: pip install -r requirements-gpu.txt" if name == "fa4"
                            and not HAS_FA4 else "") + ")")
    return name


def overridden() -> Optional[str]:
    """The backend :func:`override_backend` makes ``"auto"`` resolve to, or None."""
    return _override


def run_backend(name: str, q, k, v, cu_seqlens, topk, block_size: int,
                softmax_scale: Optional[float] = None):
    """Run the usable backend ``name`` on validated inputs (shapes of
    :func:`~sparsebalance.ops.interface.sparse_attention`): ``(out, kept pairs over heads)``.

    Raises:
        ValueError: float16 on a backend without it.
    """
    if q.dtype == torch.float16 and name not in FP16_BACKENDS:
        raise ValueError(f"float16 runs on backends {', '.join(FP16_BACKENDS)} only, not {name!r}: "
                         f"use bfloat16 or float32")
    scale = default_scale(q.shape[2], softmax_scale)
    return BACKENDS[name](q, k, v, cu_seqlens, topk, block_size, scale)


def kept_density(kept: Union[int, KeptPairs], cu_seqlens: torch.Tensor, heads: int) -> float:
    """Kept (query, key) pairs over all heads / causal pairs of the documents (1.0 if none)."""
    if isinstance(kept, KeptPairs):
        kept = kept.total
    lens = np.diff(host_cu(cu_seqlens))
    causal = int((lens * (lens + 1) // 2).sum()) * heads
    return kept / causal if causal else 1.0


@contextlib.contextmanager
def override_backend(name: Optional[str]) -> Iterator[None]:
    """Make ``backend="auto"`` resolve to ``name`` inside the block (test hook)."""
    global _override
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    prev, _override = _override, name
    try:
        yield
    finally:
        _override = prev
