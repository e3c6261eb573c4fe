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

With ``qk_conv=N`` (``--qk-conv N``) queries and keys each pass through a causal
depthwise convolution of ``N`` taps within a document, ``q'_t = sum_i w_i * q_{t-i}``
with one learned weight per tap, head and channel, starting as the identity (tap 0 at
1, the others at 0). A query then describes the last ``N`` tokens and a key the ``N``
before and at its position, so one attention layer can match a short n-gram and read
what follows it (the short convolutions that make associative recall learnable in the
Zoology study, Arora et al. 2023, and in H3/Based). Like the smear it sits before the
kernel, on the rotated queries and keys.

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


def position_in_document(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64: each packed token's offset from its document's first token."""
    cu = cu_seqlens.long().cpu()
    t = torch.arange(total)
    doc = torch.searchsorted(cu[1:], t, right=True).clamp(max=cu.numel() - 1)
    return t - cu[doc]


def short_conv(x: torch.Tensor, pos: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum_i weight[i] * x_{t-i}`` per document (nothing before a document's first token).

    Args:
        x: ``[T, H, D]`` queries or keys of packed documents.
        pos: ``[T]`` each token's offset in its document (:func:`position_in_document`).
        weight: ``[N, H, D]`` taps: ``weight[0]`` scales ``x_t``, ``weight[i]`` scales ``x_{t-i}``.
    """
    if weight.dim() != 3 or weight.shape[1:] != x.shape[1:]:
        raise ValueError(f"weight must be [taps, {x.shape[1]}, {x.shape[2]}], got {tuple(weight.shape)}")
    pos = pos.to(x.device)
    w = weight.to(x.dtype)
    out = x * w[0]
    for i in range(1, w.shape[0]):
        keep = (pos >= i).to(x.dtype).view(-1, 1, 1)
        out = out + torch.roll(x, i, dims=0) * keep * w[i]
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
        *,
        smeared_keys: bool = False,
        qk_conv: int = 0,
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
        self.query_conv = self.key_conv = None
        if qk_conv:
            if not isinstance(qk_conv, int) or qk_conv < 2:
                raise ValueError(f"qk_conv must be 0 (off) or an int >= 2 taps, got {qk_conv!r}")
            tp = config.tensor_model_parallel_size
            heads = config.num_attention_heads
            groups = config.num_query_groups or heads
            if heads % tp or groups % tp:
                raise ValueError(f"qk conv: {heads} query / {groups} key heads do not split over "
                                 f"tensor parallel size {tp}")
            dim = config.kv_channels or config.hidden_size // heads

            def identity(h: int) -> torch.nn.Parameter:  # tap 0 = 1: the plain queries / keys
                w = torch.zeros(qk_conv, h // tp, dim, dtype=config.params_dtype)
                w[0] = 1
                return torch.nn.Parameter(w)

            self.query_conv, self.key_conv = identity(heads), identity(groups)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """As MegatronModule's, with ``key_smear`` and the conv taps split over tensor-parallel
        ranks like the heads."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)

        split = {name: axis for name, axis in (("key_smear", 0), ("query_conv", 1), ("key_conv", 1))
                 if getattr(self, name) is not None}
        if not split:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(state, prefix, split, sharded_offsets,
                                                   tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])

    def attended(self, query: torch.Tensor, key: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[T, H, D]`` queries and ``[T, Hkv, D]`` keys attention uses: as given, keys
        smeared (``--smeared-keys``), both convolved (``--qk-conv``)."""
        if self.key_smear is not None:
            key = smear_keys(key, cu_seqlens, self.key_smear)
        if self.key_conv is None:
            return query, key
        pos = position_in_document(cu_seqlens, key.shape[0])  # once for both convolutions
        return short_conv(query, pos, self.query_conv), short_conv(key, pos, self.key_conv)

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
            out = self._attend(*self.attended(query, key, cu), value, cu)
            return out.reshape(out.shape[0], -1)
        # SBHD: every sequence of the batch is one document of length S.
        S, B, H, D = query.shape
        to_thd = lambda t: t.transpose(0, 1).reshape(B * S, t.shape[2], D)
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
        out = self._attend(*self.attended(to_thd(query), to_thd(key), cu), to_thd(value), cu)
        return out.reshape(B, S, H * D).transpose(0, 1).contiguous()
