"""Attention dropout of the dense core-attention module (Megatron-LM's --attention-dropout):
drawn in training only, from torch's generator, and refused by the sparse module."""

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from sparsebalance.attention.dense import CausalVarlenAttention, causal_varlen_attention


def _config(p: float) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=p)


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(12, 2, 16, generator=g) for _ in range(3)], torch.tensor([0, 5, 12], dtype=torch.int32)


def test_dropout_in_training_only():
    (q, k, v), cu = _qkv()
    module = CausalVarlenAttention(_config(0.5), 1, AttnMaskType.causal, "self")
    plain = causal_varlen_attention(q, k, v, cu)
    module.eval()
    assert torch.equal(module._attend(q, k, v, cu), plain)
    module.train()
    torch.manual_seed(3)
    dropped = module._attend(q, k, v, cu)
    torch.manual_seed(3)
    assert torch.equal(module._attend(q, k, v, cu), dropped)  # the same draw from the same seed
    assert not torch.allclose(dropped, plain)
    # each document's first query sees one key: per head its output is that value, kept
    # (scaled by 1 / (1 - p) = 2) or dropped (0)
    for row in (0, 5):
        for h in range(2):
            out = dropped[row, h]
            assert torch.allclose(out, 2 * v[row, h]) or torch.equal(out, torch.zeros_like(out))


def test_sparse_module_refuses_dropout():
    from sparsebalance.attention.sparse import SparseAttention

    with pytest.raises(ValueError, match="attention_dropout must be 0"):
        SparseAttention(_config(0.1), 1, AttnMaskType.causal, "self", block_size=4, topk=1)
