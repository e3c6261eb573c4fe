"""Dense causal attention over packed documents, for megatron-core's
``core_attention`` slot.

megatron-core's local ``DotProductAttention`` cannot run on CPU (it builds its
causal mask on ``cuda``) and refuses ``packed_seq_params``. This module accepts
both layouts megatron hands to ``core_attention``:

* THD (packed documents): ``query [T, H, D]``, ``key/value [T, Hkv, D]`` and
  ``packed_seq_params.cu_seqlens_q`` delimiting documents; attention never
  crosses a document boundary. Returns ``[T, H * D]``.
* SBHD: ``query [S, B, H, D]``, ``key/value [S, B, Hkv, D]``; causal over S.
  Returns ``[S, B, H * D]``.

Attention runs per document through ``torch.nn.functional.scaled_dot_product_attention``
(whose CPU kernel is torch's optimised flash path), so its speed is the honest
"dense" baseline for the sparse kernels.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def causal_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention per document of a packed batch.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, Hkv, D]`` with ``H % Hkv == 0``.
        cu_seqlens: int ``[n_docs + 1]`` document boundaries (0 .. T).
        softmax_scale: defaults to ``1 / sqrt(D)``.

    Returns:
        ``[T, H, D]``.
    """
    T, H, D = q.shape
    hkv = k.shape[1]
    if H % hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({hkv})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        # [1, H, L, D] views: SDPA handles GQA via enable_gqa.
        qd = q[s:e].transpose(0, 1).unsqueeze(0)
        kd = k[s:e].transpose(0, 1).unsqueeze(0)
        vd = v[s:e].transpose(0, 1).unsqueeze(0)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, is_causal=True, scale=scale, enable_gqa=hkv != H
        )
        out[s:e] = od.squeeze(0).transpose(0, 1)
    return out


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
    ):
        super().__init__(config=config)
        name = type(self).__name__
        if config.context_parallel_size > 1:
            raise ValueError(f"context parallelism is not supported by {name}")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"attn_mask_type must be causal for {name}, got {attn_mask_type}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def _attend(self, q, k, v, cu_seqlens) -> torch.Tensor:
        """``[T, H, D]`` attention over the documents of ``cu_seqlens`` (subclasses swap it)."""
        return causal_varlen_attention(q, k, v, cu_seqlens, self.softmax_scale)

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
            cu = packed_seq_params.cu_seqlens_q.to(torch.int32)
            out = self._attend(query, key, value, cu)
            return out.reshape(out.shape[0], -1)
        # SBHD: every sequence of the batch is one document of length S.
        S, B, H, D = query.shape
        to_thd = lambda t: t.transpose(0, 1).reshape(B * S, t.shape[2], D)
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
        out = self._attend(to_thd(query), to_thd(key), to_thd(value), cu)
        return out.reshape(B, S, H * D).transpose(0, 1).contiguous()
