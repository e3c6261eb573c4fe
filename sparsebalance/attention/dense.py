"""Dense causal attention over packed documents, for megatron-core's
``core_attention`` slot.

megatron-core's local ``DotProductAttention`` cannot run on CPU (it builds its
causal mask on ``cuda``) and refuses ``packed_seq_params``. This module accepts
both layouts megatron hands to ``core_attention``:

* THD (packed documents): ``query [T, H, D]``, ``key/value [T, Hkv, D]`` and
  ``packed_seq_params.cu_seqlens_q`` delimiting documents; attention never
  crosses a document boundary. Returns ``[T, H * D]``. Rows after the last
  document (``cu_seqlens_q_padded`` set: sequence parallelism's padding) get zeros.
* SBHD: ``query [S, B, H, D]``, ``key/value [S, B, Hkv, D]``; causal over S.
  Returns ``[S, B, H * D]``.

With context parallelism (``config.context_parallel_size > 1``, THD only) the
``packed_seq_params`` must carry a ``cp_layout``
(:class:`~sparsebalance.attention.context_parallel.CPLayout`): the module gathers
K and V of whole documents over the CP group and attends with this rank's queries
only, causal by their position in the document (see
:mod:`sparsebalance.attention.context_parallel`).

On the CPU, and on CUDA without ``flash-attn-4``, attention runs per document through
``torch.nn.functional.scaled_dot_product_attention`` (whose CPU kernel is torch's
optimised flash path). On CUDA with 16-bit inputs and ``flash-attn-4`` installed, the
whole packed batch runs in one FlashAttention-4 varlen causal call (no per-document loop,
no host sync): the strong dense baseline the sparse kernels are measured against.
``SPARSEBALANCE_DENSE_BACKEND=sdpa`` keeps the per-document SDPA path. Where torch's
deterministic algorithms are on (``--deterministic-mode`` on CUDA), CUDA inputs take SDPA's
math kernel, whose backward accumulates without atomics.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

DENSE_BACKENDS = ("auto", "sdpa", "fa4")
"""Dense varlen kernels: per-document SDPA, or FlashAttention-4's varlen call."""


def dense_backend(q: torch.Tensor, backend: Optional[str] = None) -> str:
    """The dense kernel for ``q``: ``backend`` or ``$SPARSEBALANCE_DENSE_BACKEND`` (default
    auto: ``fa4`` on CUDA for 16-bit inputs when flash-attn-4 is installed, else ``sdpa``)."""
    return dense_backend_for(q.device, q.dtype, backend)


def dense_backend_for(device: torch.device, dtype: torch.dtype, backend: Optional[str] = None) -> str:
    """:func:`dense_backend` for tensors of ``device`` and ``dtype``."""
    name = backend or os.environ.get("SPARSEBALANCE_DENSE_BACKEND") or "auto"
    if name not in DENSE_BACKENDS:
        raise ValueError(f"dense backend must be one of {', '.join(DENSE_BACKENDS)}, got {name!r}")
    fa4_ok = torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if fa4_ok:
        from sparsebalance.ops.fa4 import fa4_importable

        fa4_ok = fa4_importable()
    if name == "fa4" and not fa4_ok:
        raise ValueError("dense backend 'fa4' needs CUDA, 16-bit inputs and flash-attn-4")
    return "fa4" if name == "fa4" or (name == "auto" and fa4_ok) else "sdpa"


def _fa4_varlen(q, k, v, cu_seqlens, scale: float) -> torch.Tensor:
    """One FlashAttention-4 varlen causal call over every document (cu_seqlens on q's
    device, int32; the maximum length is left to FA4's bound, so no host sync)."""
    from flash_attn.cute import flash_attn_varlen_func

    cu = cu_seqlens.to(q.device, torch.int32, non_blocking=True)
    res = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale=scale,
                                 causal=True)
    return res[0] if isinstance(res, tuple) else res


def causal_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention per document of a packed batch.

    Args:
        q: ``[T, H, D]``; k: ``[T, Hkv, D]``, v: ``[T, Hkv, Dv]`` with ``H % Hkv == 0`` (``Dv``: D, or
            multi-latent attention's value head size).
        cu_seqlens: int ``[n_docs + 1]`` document boundaries (0 .. T).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        backend: :data:`DENSE_BACKENDS` name (default: :func:`dense_backend`'s choice).
        dropout_p: dropout of the attention probabilities (SDPA's; > 0 always takes the SDPA
            path, fa4 has no dropout).

    Returns:
        ``[T, H, Dv]``.
    """
    T, H, D = q.shape
    hkv = k.shape[1]
    if H % hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({hkv})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if dropout_p == 0 and not _deterministic(q) and v.shape[-1] == D and dense_backend(q, backend) == "fa4":
        return _fa4_varlen(q, k, v, cu_seqlens, scale)
    bounds = cu_seqlens.tolist()
    out = q.new_empty((T, H, v.shape[-1]))
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        # [1, H, L, D] views: SDPA handles GQA via enable_gqa.
        qd = q[s:e].transpose(0, 1).unsqueeze(0)
        kd = k[s:e].transpose(0, 1).unsqueeze(0)
        vd = v[s:e].transpose(0, 1).unsqueeze(0)
        with _sdpa_kernels(q):
            od = F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=scale, enable_gqa=hkv != H, dropout_p=dropout_p
            )
        out[s:e] = od.squeeze(0).transpose(0, 1)
    return out


def _deterministic(q: torch.Tensor) -> bool:
    """CUDA input with torch's deterministic algorithms on (``--deterministic-mode``)."""
    return q.is_cuda and torch.are_deterministic_algorithms_enabled()


def _sdpa_kernels(q: torch.Tensor):
    """SDPA's math kernel where :func:`_deterministic` (its flash and memory-efficient backwards
    may accumulate with atomics); otherwise torch's choice."""
    if not _deterministic(q):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def causal_local_attention(q, k_full, v_full, layout, softmax_scale: Optional[float] = None,
                           dropout_p: float = 0.0) -> torch.Tensor:
    """Dense causal attention of some queries of each document against the whole document.

    Args:
        q: ``[n, H, D]`` queries at compact positions ``layout.local_pos`` (grouped by
            document as ``layout.local_docs`` says).
        k_full, v_full: ``[sum(lengths), Hkv, D]`` keys/values of every document.
        layout: :class:`~sparsebalance.attention.context_parallel.CPLayout`.
        dropout_p: dropout of the attention probabilities.

    Returns:
        ``[n, H, D]``: query at document position ``p`` attends to keys ``0 .. p``.
    """
    H, D = q.shape[1], q.shape[2]
    hkv = k_full.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    cu = layout.cu_real.tolist()
    outs = []
    for doc, a, b in layout.local_docs:
        s = cu[doc]
        qpos = layout.local_pos[a:b] - s  # positions of these queries in their document
        n_keys = int(qpos.max()) + 1  # no query here looks further
        mask = torch.arange(n_keys, device=q.device).view(1, -1) <= qpos.view(-1, 1)
        qd = q[a:b].transpose(0, 1).unsqueeze(0)
        kd = k_full[s:s + n_keys].transpose(0, 1).unsqueeze(0)
        vd = v_full[s:s + n_keys].transpose(0, 1).unsqueeze(0)
        with _sdpa_kernels(q):
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale,
                                                enable_gqa=hkv != H, dropout_p=dropout_p)
        outs.append(od.squeeze(0).transpose(0, 1))
    return torch.cat(outs, 0) if outs else q * 0


def _real_rows(packed_seq_params, rows: int) -> int:
    """Rows of a THD input (no CP) that belong to documents: ``cu_seqlens_q[-1]``. More
    rows are stored only when ``cu_seqlens_q_padded`` extends the last document over
    padding (sequence parallelism, ``megatron/training/data.py``); they attend to nothing
    (zero output, no gradient) and no key is ever theirs."""
    if getattr(packed_seq_params, "cu_seqlens_q_padded", None) is None:
        return rows
    from sparsebalance.ops.plan import host_cu

    host = getattr(packed_seq_params, "cu_seqlens_host", None)
    n = int(host_cu(packed_seq_params.cu_seqlens_q if host is None else host)[-1])
    if not 0 < n <= rows:
        raise ValueError(f"cu_seqlens_q ends at {n}, the input has {rows} rows")
    return n


class CausalVarlenAttention(MegatronModule):
    """Dense causal attention with megatron-core's ``DotProductAttention`` signature."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        # k_channels / v_channels: multi-latent attention's head sizes (megatron-core passes them);
        # the heads' sizes are read off the tensors
        super().__init__(config=config)
        name = type(self).__name__
        self.cp_size = config.context_parallel_size
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"attn_mask_type must be causal for {name}, got {attn_mask_type}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    @property
    def dropout_p(self) -> float:
        """Dropout of the attention probabilities now (none in evaluation)."""
        return self.attention_dropout if self.training else 0.0

    def _attend(self, q, k, v, cu_seqlens, packed_seq_params=None) -> torch.Tensor:
        """``[T, H, D]`` attention over the documents of ``cu_seqlens`` (subclasses swap it;
        ``packed_seq_params`` is the micro-batch's, None for SBHD input)."""
        return causal_varlen_attention(q, k, v, cu_seqlens, self.softmax_scale, dropout_p=self.dropout_p)

    def _attend_cp(self, q, query, k_full, v_full, layout, group, packed_seq_params=None) -> torch.Tensor:
        """``[n, H, D]`` attention of this CP rank's real queries ``q`` (subclasses swap it)."""
        return causal_local_attention(q, k_full, v_full, layout, self.softmax_scale, dropout_p=self.dropout_p)

    def _forward_cp(self, query, key, value, packed_seq_params) -> torch.Tensor:
        from sparsebalance.attention.context_parallel import depend_on_gathered, gather_kv

        layout = getattr(packed_seq_params, "cp_layout", None)
        if layout is None:
            raise ValueError(f"{type(self).__name__} with context parallelism needs packed_seq_params "
                             "with a cp_layout (sparsebalance.attention.packed.BudgetedPackedSeqParams)")
        if layout.t_local != query.shape[0]:
            raise ValueError(f"cp_layout holds {layout.t_local} local tokens, query has {query.shape[0]}")
        group = self.cp_group
        if group is None:
            from megatron.core import parallel_state as ps

            group = ps.get_context_parallel_group()
        layout = layout.to(query.device)
        k_full, v_full = gather_kv(key, value, layout, group)
        q = query.index_select(0, layout.local_rows)
        o = self._attend_cp(q, query, k_full, v_full, layout, group, packed_seq_params)
        o = depend_on_gathered(o, k_full, v_full)  # every CP rank enters the gather's backward
        # padding rows attend to nothing: zero output, no gradient
        out = query.new_zeros((*query.shape[:2], value.shape[-1])).index_copy(0, layout.local_rows, o.to(query.dtype))
        return out.reshape(out.shape[0], -1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError(f"attention_bias is not supported by {type(self).__name__}")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if self.cp_size > 1:
                return self._forward_cp(query, key, value, packed_seq_params)
            cu = packed_seq_params.cu_seqlens_q.to(torch.int32)
            n = _real_rows(packed_seq_params, query.shape[0])
            if n < query.shape[0]:  # sequence parallelism's padding after the last document
                out = self._attend(query[:n], key[:n], value[:n], cu, packed_seq_params)
                out = torch.cat([out, out.new_zeros((query.shape[0] - n, *out.shape[1:]))])
            else:
                out = self._attend(query, key, value, cu, packed_seq_params)
            return out.reshape(out.shape[0], -1)
        if self.cp_size > 1:
            raise ValueError(f"{type(self).__name__}: context parallelism needs packed THD input")
        # SBHD: every sequence of the batch is one document of length S.
        S, B, H, _ = query.shape
        to_thd = lambda t: t.transpose(0, 1).reshape(B * S, t.shape[2], t.shape[3])
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
        out = self._attend(to_thd(query), to_thd(key), to_thd(value), cu)
        return out.reshape(B, S, -1).transpose(0, 1).contiguous()
