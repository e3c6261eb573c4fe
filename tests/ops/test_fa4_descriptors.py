"""The ``fa4`` backend's block-sparse descriptors, on the CPU (no FlashAttention-4 needed).

Built from the shared routing plan, expanded to a token-level mask the way FA4 reads
them (full blocks whole, the one mask block causal), both directions (the forward's key
lists and the backward's query lists) must equal the reference selection on random
packed inputs: ragged and short documents, single tokens, GQA, per-micro-batch and
per-document budgets. Also: the registry refuses a forced fa4 in one line without the
package, and ``auto`` never picks it on the CPU."""

import pytest
import torch
from _cases import descriptor_mask, make_inputs

from sparsebalance.ops import fa4, resolve_backend, sparse_attention
from sparsebalance.ops.flex import flex_layout
from sparsebalance.ops.plan import build_plan, per_doc_topk
from sparsebalance.ops.reference import _doc_mask

# name -> (doc lengths, H, Hkv, D, block_size, topk)
CASES = {
    "ragged-gqa": ([700, 1, 300, 129, 1100], 8, 2, 32, 64, 2),
    "short-docs-only": ([5, 63, 64, 65], 4, 1, 16, 64, 3),
    "per-doc-budgets": ([900, 1300, 260], 4, 2, 16, 64, torch.tensor([0, 5, 1])),
    "topk0": ([1024], 2, 2, 16, 128, 0),
    "k-covers-all": ([1000, 2000], 2, 1, 16, 128, 40),
    "block128-many": ([3000, 17, 1500, 128, 129], 14, 2, 32, 128, 4),
}


def _reference_buffer_mask(lens, q, k, topk, B, scale, layout):
    """The reference keep mask placed in the buffer: ``[H, NB * B, NB * B]``."""
    H, rep = q.shape[1], q.shape[1] // k.shape[1]
    rows = layout.padded_tokens
    want = torch.zeros((H, rows, rows), dtype=torch.bool)
    kd = per_doc_topk(topk, len(lens))
    s = 0
    for d, L in enumerate(lens):
        m = _doc_mask(q[s:s + L], k[s:s + L].repeat_interleave(rep, dim=1), int(kd[d]), B, B, scale)
        p = layout.pos[s:s + L]
        want[:, p.view(-1, 1), p.view(1, -1)] = m
        s += L
    return want


@pytest.mark.parametrize("name", list(CASES))
def test_descriptors_expand_to_the_reference_selection(name):
    lens, H, Hkv, D, B, topk = CASES[name]
    q, k, _, cu, _ = make_inputs(lens, H, Hkv, D, seed=len(name))
    scale = D ** -0.5
    plan = build_plan(q, k, cu, topk, B, scale)
    layout = flex_layout(cu, B, q.device, bucket=False)
    assert layout.padded_blocks == plan.kv_idx.shape[1]
    desc = fa4.fa4_descriptors(plan)
    want = _reference_buffer_mask(lens, q, k, topk, B, scale, layout)
    real = layout.pos  # rows of real query tokens; padding query rows are discarded
    for direction in ("forward", "backward"):
        got = descriptor_mask(desc, direction)
        assert got.shape == want.shape
        assert torch.equal(got[:, real], want[:, real]), f"{direction} selection differs"
    # padding rows must stay finite: every buffer row keeps at least its own diagonal
    assert bool(descriptor_mask(desc).any(-1).all())


def test_descriptors_have_fa4_shapes_and_dtypes():
    lens, H, Hkv, D, B, topk = CASES["block128-many"]
    q, k, _, cu, _ = make_inputs(lens, H, Hkv, D)
    plan = build_plan(q, k, cu, topk, B, D ** -0.5)
    d = fa4.fa4_descriptors(plan)
    NB, W = plan.kv_idx.shape[1], plan.kv_idx.shape[2]
    shapes = {"fwd_full_cnt": (1, H, NB), "fwd_full_idx": (1, H, NB, W - 1), "bwd_full_cnt": (1, H, NB),
              "bwd_full_idx": (1, H, NB, NB), "diag_cnt": (1, H, NB), "diag_idx": (1, H, NB, 1)}
    for field, shape in shapes.items():
        t = getattr(d, field)
        assert tuple(t.shape) == shape, field
        assert t.dtype == torch.int32 and t.is_contiguous(), field
    # the backward lists are the forward lists transposed: same number of full blocks
    assert int(d.fwd_full_cnt.sum()) == int(d.bwd_full_cnt.sum()) > 0
    # each backward row lists its query blocks ascending, all after the key block
    for h in range(H):
        for n in range(NB):
            c = int(d.bwd_full_cnt[0, h, n])
            row = d.bwd_full_idx[0, h, n, :c]
            assert bool((row[1:] > row[:-1]).all()) and bool((row > n).all())


def test_per_head_counts_are_accepted():
    """A plan whose kept counts differ per head (``kv_cnt [H, NB]``) gives per-head rows."""
    lens, H, Hkv, D, B, topk = CASES["ragged-gqa"]
    q, k, _, cu, _ = make_inputs(lens, H, Hkv, D)
    plan = build_plan(q, k, cu, topk, B, D ** -0.5)
    H_, NB, W = plan.kv_idx.shape
    cnt = plan.kv_cnt.clone()  # [H, NB]
    cnt[0] = torch.where(cnt[0] > 2, cnt[0] - 1, cnt[0])  # head 0 drops its last full block
    kv_idx = plan.kv_idx.clone()
    rows = torch.arange(NB)
    kv_idx[0, rows, (cnt[0] - 1).long()] = rows.to(kv_idx.dtype)  # its diagonal moves left
    plan.kv_cnt, plan.kv_idx = cnt, kv_idx
    d = fa4.fa4_descriptors(plan)
    assert torch.equal(d.fwd_full_cnt[0], cnt - 1)
    assert int(d.bwd_full_cnt[0, 0].sum()) == int((cnt[0] - 1).sum())
    assert int(d.bwd_full_cnt[0, 1].sum()) == int((cnt[1] - 1).sum())


def test_forced_fa4_without_the_package_is_one_line(monkeypatch):
    from sparsebalance.ops import backends

    monkeypatch.setattr(backends, "HAS_FA4", False)
    with pytest.raises(ValueError) as exc:
        resolve_backend("fa4", torch.device("cpu"))
    msg = str(exc.value)
    assert "\n" not in msg and "'fa4' is not available" in msg and "flash-attn-4" in msg
    assert resolve_backend("auto", torch.device("cpu")) in ("cpu", "reference")


def test_fa4_refuses_what_its_kernels_cannot_run():
    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        fa4.check_inputs(q, 128)


def test_float16_is_refused_by_backends_without_it():
    q, k, v, cu, _ = make_inputs([300], 2, 2, 16, dtype=torch.float16)
    out = sparse_attention(q, k, v, cu, topk=1, block_size=64, backend="reference")
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="float16 runs on backends fa4, reference only"):
        sparse_attention(q, k, v, cu, topk=1, block_size=64, backend="cpu")


def test_buffer_is_the_tokens_themselves_when_documents_fill_whole_blocks():
    """Documents of whole blocks: no buffer copy (a view of q); else tokens at their rows,
    zeros in the padding, and the gradient flows back to the tokens only."""
    x = torch.randn(384, 2, 8, requires_grad=True)
    whole = flex_layout(torch.tensor([0, 256, 384], dtype=torch.int32), 128, x.device, bucket=False)
    buf = fa4._to_buffer(x, whole)
    assert buf.shape == (1, 384, 2, 8) and buf.data_ptr() == x.data_ptr()
    y = torch.randn(385, 2, 8, requires_grad=True)  # documents of 129 and 256 tokens: 2 + 2 blocks
    ragged = flex_layout(torch.tensor([0, 129, 385], dtype=torch.int32), 128, y.device, bucket=False)
    buf = fa4._to_buffer(y, ragged)[0]
    assert buf.shape == (512, 2, 8) and torch.equal(buf[:129], y[:129]) and torch.equal(buf[256:], y[129:])
    assert not buf[129:256].any()
    buf.sum().backward()
    assert torch.equal(y.grad, torch.ones_like(y))
