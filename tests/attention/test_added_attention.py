"""--smeared-keys and --qk-conv: smear_keys and short_conv per document, the attention
modules with their learned weights (at init: the plain model), in megatron-core's
TransformerLayer on CPU."""

import pytest
import torch

from sparsebalance.attention.dense import position_in_document, short_conv, smear_keys


def test_smear_keys_mixes_the_previous_key_within_each_document():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(9, 2, 4, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    assert torch.equal(smear_keys(k, cu, torch.zeros(2)), k)
    full = smear_keys(k, cu, torch.ones(2))
    for t in range(9):  # weight 1: a key is the one before it, except at a document's start
        assert torch.allclose(full[t], k[t] if t in (0, 4) else k[t - 1], atol=1e-6), t
    w = torch.tensor([0.25, -0.5])
    mixed = smear_keys(k, cu, w)
    assert torch.allclose(mixed[6], k[6] + w.view(2, 1) * (k[5] - k[6]))
    assert torch.equal(mixed[4], k[4])  # never reaches into the document before
    with pytest.raises(ValueError, match="one entry per key head"):
        smear_keys(k, cu, torch.zeros(3))


def _layer(sparse: bool, smeared: bool, qk_conv: int = 0):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance.attention import get_gpt_layer_sparse_spec
    from sparsebalance.attention.spec import get_gpt_layer_dense_spec

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            use_cpu_initialization=True, bf16=False, params_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0)
    if sparse:
        spec = get_gpt_layer_sparse_spec(use_te=False, block_size=16, topk=1, smeared_keys=smeared, qk_conv=qk_conv)
    else:
        spec = get_gpt_layer_dense_spec(use_te=False,
                                        core_attention_params={"smeared_keys": smeared, "qk_conv": qk_conv})
    torch.manual_seed(0)
    return build_module(spec, config=cfg, layer_number=1)


def _thd(lens, hidden=64):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    x = torch.randn(sum(lens), 1, hidden, generator=torch.Generator().manual_seed(1))
    return x, psp


@pytest.mark.parametrize("sparse", [False, True])
def test_layer_starts_as_the_plain_one_and_learns_the_weights(mp, sparse):
    plain, smeared = _layer(sparse, False), _layer(sparse, True)
    core = smeared.self_attention.core_attention
    assert core.key_smear.shape == (2,) and float(core.key_smear.detach().abs().sum()) == 0.0  # 2 key heads
    assert set(smeared.state_dict()) - set(plain.state_dict()) == {"self_attention.core_attention.key_smear"}
    x, psp = _thd([40, 24])
    same = smeared(x, attention_mask=None, packed_seq_params=psp)[0]
    assert torch.equal(same, plain(x, attention_mask=None, packed_seq_params=psp)[0])
    out = smeared(x.clone().requires_grad_(), attention_mask=None, packed_seq_params=psp)[0]
    out.square().sum().backward()
    assert core.key_smear.grad is not None and float(core.key_smear.grad.abs().min()) > 0.0
    with torch.no_grad():
        core.key_smear.fill_(0.5)
    moved = smeared(x, attention_mask=None, packed_seq_params=psp)[0]
    assert float((moved - same).detach().abs().max()) > 1e-4
    # The second document's output does not depend on the first (no smearing across them).
    alone, psp2 = x[40:], _thd([24])[1]
    assert torch.allclose(smeared(alone, attention_mask=None, packed_seq_params=psp2)[0], moved[40:], atol=1e-5)


def test_sbhd_equals_thd(mp):
    layer = _layer(False, True)
    with torch.no_grad():
        layer.self_attention.core_attention.key_smear.copy_(torch.tensor([0.3, -0.7]))
    x, psp = _thd([32, 32])
    thd = layer(x, attention_mask=None, packed_seq_params=psp)[0]
    sbhd = layer(x.view(2, 32, 64).transpose(0, 1).contiguous(), attention_mask=None)[0]  # [S, B, h]
    assert torch.allclose(sbhd.transpose(0, 1).reshape(64, 1, 64), thd, atol=1e-5)


def test_position_in_document():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # an empty document in the middle
    assert position_in_document(cu, 7).tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert position_in_document(cu, 9).tolist()[-2:] == [0, 1]  # padding past the last document


def test_short_conv_sums_earlier_tokens_of_the_same_document_only():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 2, 3, generator=g), torch.randn(3, 2, 3, generator=g)
    pos = position_in_document(torch.tensor([0, 4, 9], dtype=torch.int32), 9)
    out = short_conv(x, pos, w)
    for t in range(9):
        start = 0 if t < 4 else 4
        want = sum(w[i] * x[t - i] for i in range(3) if t - i >= start)
        assert torch.allclose(out[t], want, atol=1e-6), t
    ident = torch.zeros(3, 2, 3)
    ident[0] = 1
    assert torch.equal(short_conv(x, pos, ident), x)
    with pytest.raises(ValueError, match=r"weight must be \[taps, 2, 3\]"):
        short_conv(x, pos, torch.zeros(3, 1, 3))


@pytest.mark.parametrize("sparse", [False, True])
def test_qk_conv_layer_starts_as_the_plain_one_and_learns_the_taps(mp, sparse):
    plain, conv = _layer(sparse, False), _layer(sparse, False, 3)
    core = conv.self_attention.core_attention
    assert core.query_conv.shape == (3, 4, 16) and core.key_conv.shape == (3, 2, 16)  # taps, heads, dim
    assert set(conv.state_dict()) - set(plain.state_dict()) == {
        "self_attention.core_attention.query_conv", "self_attention.core_attention.key_conv"}
    x, psp = _thd([40, 24])
    same = conv(x, attention_mask=None, packed_seq_params=psp)[0]
    assert torch.equal(same, plain(x, attention_mask=None, packed_seq_params=psp)[0])
    out = conv(x.clone().requires_grad_(), attention_mask=None, packed_seq_params=psp)[0]
    out.square().sum().backward()
    for w in (core.query_conv, core.key_conv):  # every tap gets a gradient from the start
        assert w.grad is not None and (w.grad.abs().sum(dim=(1, 2)) > 0).all()
    with torch.no_grad():
        core.key_conv[1].fill_(0.5)
        core.query_conv[2].fill_(-0.3)
    moved = conv(x, attention_mask=None, packed_seq_params=psp)[0]
    assert float((moved - same).detach().abs().max()) > 1e-4
    # The second document's output does not depend on the first (no taps across them).
    alone, psp2 = x[40:], _thd([24])[1]
    assert torch.allclose(conv(alone, attention_mask=None, packed_seq_params=psp2)[0], moved[40:], atol=1e-5)


def test_qk_conv_sbhd_equals_thd(mp):
    layer = _layer(False, False, 2)
    with torch.no_grad():
        layer.self_attention.core_attention.key_conv[1].fill_(0.4)
        layer.self_attention.core_attention.query_conv[1].fill_(-0.6)
    x, psp = _thd([32, 32])
    thd = layer(x, attention_mask=None, packed_seq_params=psp)[0]
    sbhd = layer(x.view(2, 32, 64).transpose(0, 1).contiguous(), attention_mask=None)[0]  # [S, B, h]
    assert torch.allclose(sbhd.transpose(0, 1).reshape(64, 1, 64), thd, atol=1e-5)


def test_bad_tap_count():
    with pytest.raises(ValueError, match="qk_conv must be 0"):
        _layer(False, False, 1)
