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

With ``smeared_keys=True`` (``--smeared-keys``) each key head also carries the key
of the token before it, ``k'_t = k_t + b_h (k_{t-1} - k_t)`` within a document, with
one learned ``b_h`` per key head starting at 0 (the plain model, so weights trained
without it load unchanged). A query can then match "the token after an occurrence of
mine" in one attention layer, which is how content-based copying (an induction head)
works: the smeared keys of Olsson et al., *In-context Learning and Induction Heads*
(2022). It sits before the kernel, so every attention backend sees the same keys.

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


def smear_keys(k: torch.Tensor, cu_seqlens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``k_t + weight_h * (k_{t-1} - k_t)`` per document (a document's first key unchanged).

    Args:
        k: ``[T, Hkv, D]`` keys of packed documents.
        cu_seqlens: int ``[n_docs + 1]`` document boundaries (0 .. T).
        weight: ``[Hkv]`` smearing weight per key head.
    """
    if weight.shape != (k.shape[1],):
        raise ValueError(f"weight must have one entry per key head ({k.shape[1]}), got {tuple(weight.shape)}")
    prev = torch.roll(k, 1, dims=0)
    starts = cu_seqlens[:-1].long().to(k.device)
    starts = starts[starts < k.shape[0]]  # empty documents at the end start past T
    prev[starts] = k[starts]  # nothing before a document's first token
    return k + weight.to(k.dtype).view(1, -1, 1) * (prev - k)


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
        *,
        smeared_keys: bool = False,
    ):
        super().__init__(config=config)
        name = type(self).__name__
        if config.context_parallel_size > 1:
            raise ValueError(f"context parallelism is not supported by {name}")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"attn_mask_type must be causal for {name}, got {attn_mask_type}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.key_smear = None
        if smeared_keys:
            groups = config.num_query_groups or config.num_attention_heads
            if groups % config.tensor_model_parallel_size:
                raise ValueError(f"smeared keys: {groups} key heads do not split over "
                                 f"tensor parallel size {config.tensor_model_parallel_size}")
            # One weight per key head of this tensor-parallel rank; 0 = plain keys.
            self.key_smear = torch.nn.Parameter(torch.zeros(groups // config.tensor_model_parallel_size,
                                                            dtype=config.params_dtype))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """As MegatronModule's, with ``key_smear`` split over tensor-parallel ranks like the heads."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)

        if self.key_smear is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(state, prefix, {"key_smear": 0}, sharded_offsets,
                                                   tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])

    def attended_keys(self, key: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The ``[T, Hkv, D]`` keys attention uses: ``key`` itself, or smeared (``--smeared-keys``)."""
        return key if self.key_smear is None else smear_keys(key, cu_seqlens, self.key_smear)

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
            out = self._attend(query, self.attended_keys(key, cu), value, cu)
            return out.reshape(out.shape[0], -1)
        # SBHD: every sequence of the batch is one document of length S.
        S, B, H, D = query.shape
        to_thd = lambda t: t.transpose(0, 1).reshape(B * S, t.shape[2], D)
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
        out = self._attend(to_thd(query), self.attended_keys(to_thd(key), cu), to_thd(value), cu)
        return out.reshape(B, S, H * D).transpose(0, 1).contiguous()
