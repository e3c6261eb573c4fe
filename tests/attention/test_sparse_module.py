"""SparseAttention in megatron-core's TransformerLayer (THD and SBHD) on CPU."""

import pytest
import torch

from sparsebalance.pairs import kept_pairs


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                use_cpu_initialization=True, bf16=False, params_dtype=torch.float32,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _layer(cfg, layer_number, **spec_kw):
    from megatron.core.transformer.spec_utils import build_module

    from sparsebalance.attention import get_gpt_layer_sparse_spec

    spec = get_gpt_layer_sparse_spec(use_te=False, **spec_kw)
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=layer_number)


def _thd(cfg, lens, seed=0, records=None):
    """(input, packed params); ``records``: the list the params carry (None: plain
    megatron-core ``PackedSeqParams``, which carry no record list)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
              max_seqlen_kv=max(lens))
    psp = PackedSeqParams(**kw) if records is None else BudgetedPackedSeqParams(**kw, records=records)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 1, cfg.hidden_size, generator=g).requires_grad_()
    return x, psp


def test_transformer_layer_thd_forward_backward_budget_and_records(mp):
    from sparsebalance.attention import SparseAttention

    cfg = _config()
    layer = _layer(cfg, 1, block_size=16, topk=1, backend="cpu")
    assert isinstance(layer.self_attention.core_attention, SparseAttention)
    lens = [100, 7, 60]
    records = []
    x, psp = _thd(cfg, lens, records=records)
    out, _ = layer(x, attention_mask=None, packed_seq_params=psp)
    assert out.shape == x.shape
    out.square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    w = layer.self_attention.linear_qkv.weight
    assert w.grad is not None and w.grad.abs().sum() > 0
    (rec,) = records  # the backward added none
    H = cfg.num_attention_heads
    assert rec.layer_number == 1 and rec.topk == 1 and rec.doc_lengths == tuple(lens)
    assert rec.kept_pairs == int(kept_pairs(lens, 1, 16).sum()) * H
    assert rec.head_kept_pairs == (rec.kept_pairs // H,) * H  # top-k: every head alike
    assert rec.density < 1.0

    # A budget the packed params carry (the micro-batch's) overrides the static topk
    # and changes the output.
    import dataclasses

    records3 = []
    bpsp = dataclasses.replace(psp, budget=3, microbatch=5, records=records3)
    out3, _ = layer(x, attention_mask=None, packed_seq_params=bpsp)
    (rec3,) = records3
    assert len(records) == 1  # each micro-batch's params carry their own list
    assert rec3.topk == 3 and rec3.microbatch == 5
    assert rec3.kept_pairs == int(kept_pairs(lens, 3, 16).sum()) * H > rec.kept_pairs
    assert not torch.allclose(out3, out)


def test_dense_layers_and_backends_agree_in_layer(mp):
    cfg = _config()
    lens = [90, 40]
    x, psp = _thd(cfg, lens, seed=1)
    outs = {}
    for be in ("reference", "cpu"):
        layer = _layer(cfg, 2, block_size=16, topk=0, backend=be)
        outs[be] = layer(x, attention_mask=None, packed_seq_params=psp)[0]
    torch.testing.assert_close(outs["cpu"], outs["reference"], rtol=1e-4, atol=1e-5)
    dense_layer = _layer(cfg, 2, block_size=16, topk=0, backend="cpu", dense_layers=(2,))
    records = []
    _, rpsp = _thd(cfg, lens, seed=1, records=records)
    dense = dense_layer(x, attention_mask=None, packed_seq_params=rpsp)[0]
    (rec,) = records
    assert rec.topk is None and rec.density == 1.0
    assert rec.head_kept_pairs == (rec.causal_pairs // cfg.num_attention_heads,) * cfg.num_attention_heads
    big = _layer(cfg, 2, block_size=16, topk=100, backend="cpu")(x, attention_mask=None,
                                                                  packed_seq_params=psp)[0]
    torch.testing.assert_close(big, dense, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(outs["cpu"], dense, atol=1e-3)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_threshold_records_count_pairs_per_head(mp, backend):
    """Under threshold routing the record's per-head kept pairs add up to its kept pairs;
    per-head counts keep no more than per-block ones (the largest head's count). The
    reference routes on its own: no per-head pairs to read (empty), the total is still
    counted."""
    cfg = _config()
    lens = [300, 40, 200]
    got = {}
    for per_head in (True, False):
        layer = _layer(cfg, 1, block_size=16, topk=6, backend=backend, threshold=0.5, topk_min=1,
                       per_head=per_head)
        assert layer.self_attention.core_attention.rule.per_head is per_head
        records = []
        x, psp = _thd(cfg, lens, records=records)
        out, _ = layer(x, attention_mask=None, packed_seq_params=psp)
        (rec,) = records
        got[per_head] = rec, out.detach()
        if backend == "reference":
            assert rec.head_kept_pairs == ()
        else:
            assert len(rec.head_kept_pairs) == cfg.num_attention_heads
            assert sum(rec.head_kept_pairs) == rec.kept_pairs == sum(rec.doc_kept_pairs)
    assert got[True][0].kept_pairs <= got[False][0].kept_pairs
    assert 0 < got[True][0].density < 1.0


def test_threshold_records_read_the_device_once_per_step(mp):
    """Under threshold routing a layer's record holds its kept pairs as the plan left them,
    on the device (no read per layer; a backend whose backward index needs the widest
    head's count, cpu / triton / cuda, reads it there); the step reads all of its records with one copy
    (``read_records``), and a record read alone (its first field read) gets the same values."""
    from sparsebalance.attention.packed import read_records

    cfg = _config()
    lens = [300, 40, 200]
    runs = []
    for _ in range(2):
        records = []
        x, psp = _thd(cfg, lens, records=records)
        for n in (1, 2):  # flex: its kernel reads nothing of the plan on the host (forward only here)
            layer = _layer(cfg, n, block_size=16, topk=6, backend="flex", threshold=0.5, topk_min=1)
            with torch.no_grad():
                x = layer(x, attention_mask=None, packed_seq_params=psp)[0]
        assert len(records) == 2 and all(object.__getattribute__(r, "kept").pending for r in records)
        runs.append(records)
    assert read_records(runs[0]) == 1 and read_records(runs[0]) == 0
    for r, alone in zip(runs[0], runs[1]):
        assert object.__getattribute__(r, "kept") is None
        assert alone.kept_pairs == r.kept_pairs and object.__getattribute__(alone, "kept") is None
        assert alone.head_kept_pairs == r.head_kept_pairs and alone.doc_kept_pairs == r.doc_kept_pairs
        assert sum(r.head_kept_pairs) == r.kept_pairs == sum(r.doc_kept_pairs) and 0 < r.density < 1
        assert len(r.head_kept_pairs) == cfg.num_attention_heads and len(r.doc_kept_pairs) == len(lens)


def test_sbhd_equals_thd_of_equal_documents(mp):
    from megatron.core.transformer.enums import AttnMaskType

    from sparsebalance.attention import SparseAttention

    cfg = _config()
    core = SparseAttention(cfg, 1, AttnMaskType.causal, "self", block_size=16, topk=1, backend="cpu")
    S, B, H, D = 70, 2, 4, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, B, h, D, generator=g) for h in (H, 2, 2))
    sbhd = core(q, k, v, None)
    assert sbhd.shape == (S, B, H * D)
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, S, 2 * S], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    thd = lambda t: t.transpose(0, 1).reshape(B * S, t.shape[2], D)
    flat = core(thd(q), thd(k), thd(v), None, packed_seq_params=psp)
    torch.testing.assert_close(sbhd.transpose(0, 1).reshape(B * S, -1), flat)


def test_module_rejects_bad_params(mp):
    from megatron.core.transformer.enums import AttnMaskType

    from sparsebalance.attention import SparseAttention

    cfg = _config()
    for kw, msg in [(dict(block_size=0), "block_size"), (dict(topk=-2), "topk"),
                    (dict(backend="x"), "backend")]:
        with pytest.raises(ValueError, match=msg):
            SparseAttention(cfg, 1, AttnMaskType.causal, "self", **kw)
    with pytest.raises(ValueError, match="attn_mask_type"):
        SparseAttention(cfg, 1, AttnMaskType.no_mask, "self")


def test_attention_package_import_is_light():
    import subprocess
    import sys

    code = "import sys, sparsebalance.attention, sparsebalance.ops; print('megatron' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_sequence_parallel_padding_rows_are_left_out(mp, sparse):
    """Sequence parallelism stores rows after the last document (``cu_seqlens_q_padded``
    extends it; ``cu_seqlens_q`` keeps the real lengths): the documents' output, their
    gradients and the record equal the unpadded call's; padding rows get zeros and no
    gradient reaches them."""
    from megatron.core.transformer.enums import AttnMaskType

    from sparsebalance.attention import SparseAttention
    from sparsebalance.attention.dense import CausalVarlenAttention
    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    cfg = _config()
    core = (SparseAttention(cfg, 1, AttnMaskType.causal, "self", block_size=16, topk=1, backend="cpu")
            if sparse else CausalVarlenAttention(cfg, 1, AttnMaskType.causal, "self"))
    lens, pad = [70, 33], 3
    T = sum(lens)
    cu = torch.tensor([0, 70, T], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T + pad, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    outs, grads, recs = [], [], []
    for rows, padded in ((T, None), (T + pad, torch.tensor([0, 70, T + pad], dtype=torch.int32))):
        records = []
        psp = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=70,
                                      max_seqlen_kv=70, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                                      cu_seqlens_host=cu, records=records)
        out = core(q[:rows], k[:rows], v[:rows], None, packed_seq_params=psp)
        assert out.shape == (rows, 64)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        recs.append(records)
        for t in (q, k, v):
            t.grad = None
    torch.testing.assert_close(outs[1][:T], outs[0], rtol=0, atol=0)
    assert (outs[1][T:] == 0).all()
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # padding rows: zero in both
        assert (a[T:] == 0).all()
    assert [r.doc_lengths for r in recs[1]] == [r.doc_lengths for r in recs[0]] == ([tuple(lens)] if sparse else [])


@pytest.mark.parametrize("backend", ["cpu", "reference", "flex"])
def test_micro_batch_tau_reaches_the_kernel(mp, backend):
    """Under threshold routing a TAU the micro-batch's packed params carry (DST's level) is the
    TAU the layer routes at: a lower one keeps fewer pairs in the real kernel, the cap (the
    module's top-k) stays, and the record says which TAU ran. No TAU: the module's own."""
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType

    from sparsebalance.attention import SparseAttention

    cfg = _config()
    layer = _layer(cfg, 1, block_size=16, topk=6, backend=backend, threshold=0.7, topk_min=0)
    lens = [300, 40, 200]
    kept, outs = {}, {}
    for tau in (None, 0.5, 0.7, 0.95):
        records = []
        x, psp = _thd(cfg, lens, records=records)
        with torch.no_grad():  # flex has no CPU backward
            outs[tau] = layer(x, attention_mask=None, packed_seq_params=dataclasses.replace(psp, tau=tau))[0]
        (rec,) = records
        assert rec.tau == (0.7 if tau is None else tau) and rec.topk == 6
        kept[tau] = rec.kept_pairs
    assert kept[0.5] < kept[0.7] < kept[0.95] and kept[None] == kept[0.7]
    torch.testing.assert_close(outs[None], outs[0.7])
    assert not torch.allclose(outs[0.5], outs[0.7])
    topk_only = SparseAttention(cfg, 1, AttnMaskType.causal, "self", block_size=16, topk=6, backend=backend)
    x, psp = _thd(cfg, lens, records=[])
    with pytest.raises(ValueError, match="needs threshold routing"):
        topk_only.rule_of(dataclasses.replace(psp, tau=0.8))
