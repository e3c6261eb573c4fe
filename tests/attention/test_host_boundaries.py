"""SparseAttention routes from the host copy of the document boundaries that rides with
the micro-batch (``BudgetedPackedSeqParams.cu_seqlens_host``): its ``cu_seqlens_q`` (on
the GPU in training) is never copied back, and the layers of a micro-batch share one
routing skeleton."""

import torch


def test_module_reads_the_host_copy_that_rides_with_the_microbatch(routing_counts, mp):
    """SparseAttention given BudgetedPackedSeqParams(cu_seqlens_host=...) routes from the
    host tensor; the micro-batch's cu_seqlens_q (on the GPU in training) is never copied."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance.attention import SparseAttention
    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True)
    lens = [130, 7, 60]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    device_cu, host = cu.clone(), cu.clone()
    psp = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=device_cu, cu_seqlens_kv=device_cu,
                                  budget=1, cu_seqlens_host=host)
    outs = []
    for layer in (1, 2):
        core = SparseAttention(cfg, layer, AttnMaskType.causal, "self", block_size=16, topk=1, backend="cpu")
        outs.append(core(q, k, v, None, packed_seq_params=psp))
    assert routing_counts["copies"]() == 1 and routing_counts["copied"]() == [host]
    assert routing_counts["skeletons"] == 1
    plain = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=device_cu, cu_seqlens_kv=device_cu, budget=1)
    core = SparseAttention(cfg, 1, AttnMaskType.causal, "self", block_size=16, topk=1, backend="cpu")
    torch.testing.assert_close(core(q, k, v, None, packed_seq_params=plain), outs[0])


def test_recomputed_layer_reuses_its_forwards_plan(routing_counts, mp, monkeypatch):
    """Under activation checkpointing the original forward (no grad) keeps its plan and the
    recomputation in backward (grad enabled) takes it back: the gates run once, and the
    recomputed output equals the forward's."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance.attention import SparseAttention
    from sparsebalance.attention import sparse as sparse_mod
    from sparsebalance.attention.packed import BudgetedPackedSeqParams
    from sparsebalance.ops import plan as plan_mod

    runs = []
    route = plan_mod._route
    monkeypatch.setattr(plan_mod, "_route", lambda *a, **k: runs.append(1) or route(*a, **k))
    monkeypatch.setattr(sparse_mod, "is_checkpointing", lambda: True)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True)
    lens = [300, 70]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    psp = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, budget=1,
                                  cu_seqlens_host=cu.clone())
    core = SparseAttention(cfg, 1, AttnMaskType.causal, "self", block_size=16, topk=1, backend="cpu")
    with torch.no_grad():  # the checkpointed forward
        first = core(q, k, v, None, packed_seq_params=psp)
    assert len(runs) == 1 and len(plan_mod._memo) == 1
    again = core(q, k, v, None, packed_seq_params=psp)  # the recomputation (grad enabled)
    assert len(runs) == 1 and len(plan_mod._memo) == 0
    torch.testing.assert_close(again, first)
    core(q, k, v, None, packed_seq_params=psp)  # nothing kept: a later call routes again
    assert len(runs) == 2


def test_records_carry_each_documents_kept_pairs(mp):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance import runtime
    from sparsebalance.attention import SparseAttention
    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True)
    lens = [300, 20, 200]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    psp = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, budget=2)
    runtime.pop_records()
    core = SparseAttention(cfg, 1, AttnMaskType.causal, "self", block_size=16, topk=2, backend="cpu",
                           threshold=0.5)
    core(q, k, v, None, packed_seq_params=psp)
    (rec,) = runtime.pop_records()
    assert len(rec.doc_kept_pairs) == 3 and sum(rec.doc_kept_pairs) == rec.kept_pairs
    assert rec.doc_kept_pairs[1] == 20 * 21 // 2 * 4  # a one-block document keeps all it has
