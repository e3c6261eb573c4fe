"""SparseAttention routes from the host copy of the document boundaries that rides with
the micro-batch (``BudgetedPackedSeqParams.cu_seqlens_host``): its ``cu_seqlens_q`` (on
the GPU in training) is never copied back, and the layers of a micro-batch share one
routing skeleton."""

import torch


def _core(layer=1, topk=1, **kw):
    """A SparseAttention module (4 query heads, 2 KV groups, block 16) on the cpu backend."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance.attention import SparseAttention

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, attention_dropout=0.0)  # the sparse kernels apply none
    return SparseAttention(cfg, layer, AttnMaskType.causal, "self", block_size=16, topk=topk, backend="cpu", **kw)


def _inputs(lens, seed):
    """q [T, 4, 16], k and v [T, 2, 16] and int32 cu_seqlens of ``lens``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g) for h in (4, 2, 2))
    return q, k, v, torch.tensor([0] + lens).cumsum(0).to(torch.int32)


def _params(cu, budget, **kw):
    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    return BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, budget=budget, **kw)


def test_module_reads_the_host_copy_that_rides_with_the_microbatch(routing_counts, mp):
    """SparseAttention given BudgetedPackedSeqParams(cu_seqlens_host=...) routes from the
    host tensor; the micro-batch's cu_seqlens_q (on the GPU in training) is never copied."""
    q, k, v, cu = _inputs([130, 7, 60], 0)
    device_cu, host = cu.clone(), cu.clone()
    psp = _params(device_cu, 1, cu_seqlens_host=host)
    outs = [_core(layer)(q, k, v, None, packed_seq_params=psp) for layer in (1, 2)]
    assert routing_counts["copies"]() == 1 and routing_counts["copied"]() == [host]
    assert routing_counts["skeletons"] == 1
    torch.testing.assert_close(_core()(q, k, v, None, packed_seq_params=_params(device_cu, 1)), outs[0])


def test_recomputed_layer_reuses_its_forwards_plan(routing_counts, mp, monkeypatch):
    """Under activation checkpointing the original forward (no grad) keeps its plan and the
    recomputation in backward (grad enabled) takes it back: the gates run once, and the
    recomputed output equals the forward's."""
    from sparsebalance.attention import sparse as sparse_mod
    from sparsebalance.ops import plan as plan_mod

    runs = []
    route = plan_mod._route
    monkeypatch.setattr(plan_mod, "_route", lambda *a, **k: runs.append(1) or route(*a, **k))
    monkeypatch.setattr(sparse_mod, "is_checkpointing", lambda: True)
    q, k, v, cu = _inputs([300, 70], 1)
    psp = _params(cu, 1, cu_seqlens_host=cu.clone())
    core = _core()
    with torch.no_grad():  # the checkpointed forward
        first = core(q, k, v, None, packed_seq_params=psp)
    assert len(runs) == 1 and len(plan_mod._memo) == 1
    again = core(q, k, v, None, packed_seq_params=psp)  # the recomputation (grad enabled)
    assert len(runs) == 1 and len(plan_mod._memo) == 0
    torch.testing.assert_close(again, first)
    core(q, k, v, None, packed_seq_params=psp)  # nothing kept: a later call routes again
    assert len(runs) == 2


def test_records_carry_each_documents_kept_pairs(mp):
    q, k, v, cu = _inputs([300, 20, 200], 2)
    records = []
    _core(topk=2, threshold=0.5)(q, k, v, None, packed_seq_params=_params(cu, 2, records=records))
    (rec,) = records
    assert len(rec.doc_kept_pairs) == 3 and sum(rec.doc_kept_pairs) == rec.kept_pairs
    assert rec.doc_kept_pairs[1] == 20 * 21 // 2 * 4  # a one-block document keeps all it has
