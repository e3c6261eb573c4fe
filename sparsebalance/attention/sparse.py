"""Block top-k sparse attention for megatron-core's ``core_attention`` slot.

:class:`SparseAttention` has the constructor and forward signature of
megatron-core 0.16's ``DotProductAttention`` plus four spec params
(``block_size``, ``topk``, ``backend``, ``dense_layers``). Per call it reads the
micro-batch's budget from the
:class:`~sparsebalance.attention.packed.BudgetedPackedSeqParams` megatron hands it
(falling back to its static ``topk``; under threshold routing also its TAU, falling back
to its static ``threshold``), runs :func:`sparsebalance.ops.sparse_attention` (or dense
causal attention for layers in ``dense_layers`` or a ``None`` budget) and
appends an :class:`~sparsebalance.attention.packed.AttentionRecord` of the kept/causal
pair counts to the record list the packed params carry.

Layouts as in :mod:`sparsebalance.attention.dense`: THD ``[T, H, D]`` with
``packed_seq_params.cu_seqlens_q`` (returns ``[T, H * D]``) or SBHD
``[S, B, H, D]`` (returns ``[S, B, H * D]``).

Activation recomputation (megatron-core's full or selective recompute) re-runs
this forward during backward with the same packed params, hence the same budget:
the recomputed forward routes exactly as the original one did, although other
micro-batches ran in between (pipeline parallelism); a recomputed call is not
recorded again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional

import numpy as np
import torch
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from sparsebalance.attention.dense import CausalVarlenAttention, causal_local_attention, causal_varlen_attention
from sparsebalance.attention.packed import AttentionRecord, budget_of, record, tau_of
from sparsebalance.attention.spec import get_gpt_layer_spec
from sparsebalance.ops import BACKENDS, sparse_attention
from sparsebalance.ops.kept import KeptPairs
from sparsebalance.ops.plan import RoutingRule, default_scale, host_cu, plan_slot, routing_rule


class SparseAttention(CausalVarlenAttention):
    """Block top-k sparse causal attention with ``DotProductAttention``'s signature.

    Extra keyword args (ModuleSpec params):
        block_size: routing block size in tokens.
        topk: static budget (key blocks besides sink and diagonal) when the packed
            params carry none; ``None`` means dense.
        backend: kernel backend name ("auto", "reference", "cpu", "triton", "cuda", "flex", "fa4").
        dense_layers: 1-based global layer numbers that stay dense.
        threshold: threshold routing's TAU (the budget is then the cap), None: top-k.
        topk_min: threshold routing's least count of chosen blocks.
        per_head: threshold routing's count per (query block, head) (default); False: one
            count per query block (the largest head's), for comparisons.
    """

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
        block_size: int = 64,
        topk: Optional[int] = 8,
        backend: str = "auto",
        dense_layers: Iterable[int] = (),
        threshold: Optional[float] = None,
        topk_min: int = 0,
        per_head: bool = True,
    ):
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout, softmax_scale, cp_comm_type, pg_collection)
        if self.attention_dropout:
            raise ValueError(f"attention_dropout must be 0 for {type(self).__name__} (its kernels have no "
                             f"dropout), got {self.attention_dropout}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if topk is not None and (not isinstance(topk, int) or topk < 0):
            raise ValueError(f"topk must be None or an int >= 0, got {topk!r}")
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        self.block_size = block_size
        self.topk = topk
        self.backend = backend
        self.dense_layers = frozenset(int(x) for x in dense_layers)
        self.rule = None if threshold is None else RoutingRule(threshold=float(threshold), topk_min=int(topk_min),
                                                               per_head=bool(per_head))

    def budget_of(self, packed_seq_params) -> tuple:
        """(top-k or None for dense, micro-batch id) of this layer for the micro-batch
        whose ``packed_seq_params`` megatron handed down."""
        topk, microbatch = budget_of(packed_seq_params, self.topk)
        return (None if self.layer_number in self.dense_layers else topk), microbatch

    def rule_of(self, packed_seq_params) -> Optional[RoutingRule]:
        """The routing rule of this layer for the micro-batch: the module's, at the TAU the
        packed params carry (DST's level under threshold routing); None: top-k routing."""
        tau = tau_of(packed_seq_params, None)
        if self.rule is None:
            if tau is not None:
                raise ValueError(f"the micro-batch carries TAU {tau}, but layer {self.layer_number} routes "
                                 "by top-k (a TAU level needs threshold routing)")
            return None
        return self.rule if tau is None or tau == self.rule.threshold else replace(self.rule, threshold=tau)

    def _attend(self, q, k, v, cu_seqlens, packed_seq_params=None) -> torch.Tensor:
        """``[T, H, D]`` attention over documents of ``cu_seqlens``; records what it did."""
        topk, microbatch = self.budget_of(packed_seq_params)
        rule = self.rule_of(packed_seq_params)
        host = getattr(packed_seq_params, "cu_seqlens_host", None)
        if host is None:
            host = cu_seqlens  # copied to the host once per micro-batch (plan.host_cu)
        lens = torch.from_numpy(np.diff(host_cu(host)))
        H = q.shape[1]
        causal = int((lens * (lens + 1) // 2).sum()) * H
        if topk is None:
            out = causal_varlen_attention(q, k, v, cu_seqlens, self.softmax_scale)
            kept = KeptPairs(head=np.full(H, causal // H, dtype=np.int64), total=causal)
        else:
            # under activation recompute the forward keeps its plan and the recomputation
            # in backward takes it back: one routing per layer and micro-batch
            mode = ("reuse" if torch.is_grad_enabled() else "store") if is_checkpointing() else None
            with plan_slot(packed_seq_params, self.layer_number, mode if packed_seq_params is not None else None):
                # the kept pairs as the plan holds them: threshold routing's stay on the device
                # until the step's records are read (read_records), no host sync per layer
                out, kept = sparse_attention(
                    q, k, v, host, topk=topk, block_size=self.block_size, softmax_scale=self.softmax_scale,
                    backend=self.backend, return_kept=True,
                    threshold=None if rule is None else rule.threshold,
                    topk_min=0 if rule is None else rule.topk_min,
                    per_head=True if rule is None else rule.per_head)
        if _recomputing():  # the original forward of this call was recorded already
            return out
        record(packed_seq_params, AttentionRecord(
            layer_number=self.layer_number, microbatch=microbatch, topk=topk, kept_pairs=0,
            causal_pairs=causal, doc_lengths=tuple(lens.tolist()), kept=kept,
            tau=None if rule is None or topk is None else rule.threshold))
        return out

    def _attend_cp(self, q, query, k_full, v_full, layout, group, packed_seq_params=None
                   ) -> torch.Tensor:
        """Context parallelism: this rank's real queries ``q [n, H, D]`` against the gathered
        whole documents, routed as a CP=1 run routes them; records this rank's pairs
        (kept and causal of its own queries: the CP ranks' records add up to the
        micro-batch's) with the documents' real lengths."""
        from sparsebalance.attention.context_parallel import sparse_attention_local

        topk, microbatch = self.budget_of(packed_seq_params)
        rule = self.rule_of(packed_seq_params)
        H = q.shape[1]
        causal = layout.causal_pairs * H
        if topk is None:
            out, kept = causal_local_attention(q, k_full, v_full, layout, self.softmax_scale), causal
            head_kept = [causal // H] * H
        else:
            scale = default_scale(q.shape[2], self.softmax_scale)
            with routing_rule(rule):
                out, kept, head_kept = sparse_attention_local(
                    q, query, k_full, v_full, layout, group, topk=topk, block_size=self.block_size,
                    scale=scale, backend=self.backend, return_head_kept=True)
        if not _recomputing():
            lens = (layout.cu_real[1:] - layout.cu_real[:-1]).long()
            record(packed_seq_params, AttentionRecord(
                layer_number=self.layer_number, microbatch=microbatch, topk=topk, kept_pairs=kept,
                causal_pairs=causal, doc_lengths=tuple(lens.tolist()),
                head_kept_pairs=() if head_kept is None else tuple(int(x) for x in head_kept),
                tau=None if rule is None or topk is None else rule.threshold))
        return out


def _recomputing() -> bool:
    """True inside megatron-core's recomputation of a checkpointed forward (backward pass).

    ``CheckpointFunction`` flags both of its forwards as checkpointing; the original one
    runs without autograd, the recomputation with it."""
    return is_checkpointing() and torch.is_grad_enabled()


def get_gpt_layer_sparse_spec(
    *,
    block_size: int,
    topk: Optional[int],
    backend: str = "auto",
    dense_layers: Iterable[int] = (),
    use_te: Optional[bool] = None,
    normalization: str = "LayerNorm",
    threshold: Optional[float] = None,
    topk_min: int = 0,
    per_head: bool = True,
    qk_layernorm: bool = False,
) -> ModuleSpec:
    """megatron-core's GPT layer spec with :class:`SparseAttention` as ``core_attention``.

    Args mirror the flags ``--sb-block-size``, ``--sb-topk``, ``--sb-attention-backend``,
    ``--sb-dense-layers`` (1-based layer numbers); ``use_te``, ``normalization`` and
    ``qk_layernorm`` are passed to :func:`sparsebalance.attention.spec.get_gpt_layer_spec`.
    """
    params = dict(block_size=block_size, topk=topk, backend=backend,
                  dense_layers=tuple(int(x) for x in dense_layers), threshold=threshold, topk_min=topk_min,
                  per_head=per_head)
    return get_gpt_layer_spec(SparseAttention, params, use_te=use_te, normalization=normalization,
                              qk_layernorm=qk_layernorm)
