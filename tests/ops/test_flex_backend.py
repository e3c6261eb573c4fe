"""The ``flex`` backend on the CPU: FlexAttention's forward (eager, and once compiled) equals
the reference; the block-aligned layout, the bucket ladder and the block mask's lists are
exactly the plan's. (FlexAttention has no CPU backward: fwd+bwd is in test_flex_gpu.py.)"""

import numpy as np
import pytest
import torch
from _cases import CASES, expects_selection, make_inputs

from sparsebalance.ops import build_plan, flex, sparse_attention
from sparsebalance.ops.reference import _doc_mask

# name -> (doc lengths, H, Hkv, D, block_size, topk): blocks 16 and 32, ragged documents,
# GQA, per-document budgets, and budgets past the block count (dense causal).
FLEX_CASES = {
    **CASES,
    "block16-ragged-gqa": ([130, 17, 64, 250], 4, 2, 16, 16, 3),
    "block32-many-budgets": ([300, 260, 90, 33], 4, 1, 32, 32, torch.tensor([0, 2, 5, 1])),
    "block32-k-ge-blocks-dense": ([400, 129], 2, 2, 32, 32, 50),
    "block16-gqa-8to2": ([333], 8, 2, 16, 16, 4),
}


def _fwd(backend, q, k, v, cu, topk, B):
    return sparse_attention(q, k, v, cu, topk=topk, block_size=B, backend=backend, return_density=True)


@pytest.mark.parametrize("name", sorted(FLEX_CASES))
def test_flex_forward_matches_reference(name):
    lens, H, Hkv, D, B, topk = FLEX_CASES[name]
    q, k, v, cu, _ = make_inputs(lens, H, Hkv, D, seed=3)
    ref, dens_ref = _fwd("reference", q, k, v, cu, topk, B)
    out, dens = _fwd("flex", q, k, v, cu, topk, B)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
    assert dens == dens_ref
    dense, _ = _fwd("reference", q, k, v, cu, 10 ** 6, B)
    if expects_selection(lens, B, topk):  # the mask really drops blocks: not dense attention
        assert dens < 1.0 and (out - dense).abs().max() > 1e-3
    else:
        assert dens == 1.0
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=2e-6)


def test_flex_bf16_error_within_twice_reference():
    lens, H, Hkv, D, B, topk = FLEX_CASES["block16-ragged-gqa"]
    q, k, v, cu, _ = make_inputs(lens, H, Hkv, D, dtype=torch.bfloat16)
    truth, _ = _fwd("reference", q.float(), k.float(), v.float(), cu, topk, B)
    ref, _ = _fwd("reference", q, k, v, cu, topk, B)
    out, _ = _fwd("flex", q, k, v, cu, topk, B)
    assert out.dtype == torch.bfloat16
    err, ref_err = (out.float() - truth).abs().max().item(), (ref.float() - truth).abs().max().item()
    assert ref_err > 0 and err <= 2 * ref_err + 1e-5, (err, ref_err)


@pytest.mark.parametrize("n", [0, 1, 7, 16, 17, 100, 256, 257, 511, 513, 4096, 4097])
def test_bucket_ladder(n):
    b = flex.bucket_blocks(n)
    assert b >= max(n, 1)
    if n > 16:
        assert b <= n * 9 / 8 + 1 and flex.bucket_blocks(b) == b
    assert flex.bucket_blocks(n + 1) >= b  # monotone


def test_bucket_ladder_has_few_values_per_octave():
    assert {flex.bucket_blocks(n) for n in range(256, 513)} == set(range(256, 513, 32))
    # a 64K batch at block 128 with up to 60 documents (512..572 blocks): two buckets
    assert {flex.bucket_blocks(n) for n in range(512, 573)} == {512, 576}


def test_layout_puts_every_document_on_block_boundaries():
    lens, B = [50, 1, 0, 77, 200], 32
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    lay = flex.flex_layout(cu, B, torch.device("cpu"))
    T = sum(lens)
    nb = [-(-L // B) for L in lens]
    assert lay.tokens == T and lay.blocks == sum(nb) == 13
    assert lay.padded_blocks == flex.bucket_blocks(13) and lay.src.numel() == lay.padded_blocks * B
    pos, src = lay.pos.numpy(), lay.src.numpy()
    np.testing.assert_array_equal(src[pos], np.arange(T))  # src inverts pos
    assert (src == T).sum() == lay.padded_tokens - T  # every other row is padding
    fb = np.cumsum([0] + nb)[:-1]
    for d, (s, L) in enumerate(zip(np.cumsum([0] + lens)[:-1], lens)):
        if L:  # document d starts at its first plan block and is contiguous
            np.testing.assert_array_equal(pos[s:s + L], fb[d] * B + np.arange(L))
    assert lay.padding_ratio == flex.padding_ratio(cu, B) == lay.padded_tokens / T > 1.0


def test_padding_ratio_of_aligned_documents_is_one():
    cu = torch.tensor([0, 128, 384, 1024], dtype=torch.int32)
    assert flex.padding_ratio(cu, 128) == 1.0  # 8 blocks: on the ladder, no partial block
    assert flex.padding_ratio(cu, 64) == 1.0
    assert flex.padding_ratio(torch.tensor([0, 100], dtype=torch.int32), 64) == 128 / 100


@pytest.mark.parametrize("name", ["ragged-gqa-single-tokens", "per-doc-topk", "block16-ragged-gqa"])
def test_block_mask_lists_are_the_plans_blocks(name):
    """The compiled path reads only the block lists plus a causal mask_mod: expanded to
    tokens they must give the reference's mask, document by document."""
    lens, H, Hkv, D, B, topk = FLEX_CASES[name]
    q, k, v, cu, _ = make_inputs(lens, H, Hkv, D, seed=1)
    scale = D ** -0.5
    plan = build_plan(q, k, cu, topk, B, scale)
    lay = flex.flex_layout(cu, B, q.device)
    mask = flex.flex_block_mask(plan, lay)  # the compiled path's mask (causal mask_mod)
    NBp, NB = lay.padded_blocks, lay.blocks
    part_n, part_i = mask.kv_num_blocks[0], mask.kv_indices[0]
    full_n, full_i = mask.full_kv_num_blocks[0], mask.full_kv_indices[0]
    assert part_i.shape == full_i.shape == (H, NBp, NBp)
    assert (part_n == 1).all() and (part_i[:, :, 0] == torch.arange(NBp)).all()  # the diagonal
    blocks = torch.zeros((H, NBp, NBp), dtype=torch.bool)
    for h in range(H):
        for b in range(NBp):
            blocks[h, b, full_i[h, b, :full_n[h, b]].long()] = True
    assert not blocks[:, torch.arange(NBp), torch.arange(NBp)].any()  # full blocks exclude it
    blocks[:, torch.arange(NBp), torch.arange(NBp)] = True
    pos = lay.pos
    rep = H // Hkv
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        p = pos[s:e]
        tok = blocks[:, p // B][:, :, p // B] & (p.view(-1, 1) >= p.view(1, -1))
        d = bounds.index(s)
        kd = topk if isinstance(topk, int) else int(topk[d])
        want = _doc_mask(q[s:e], k[s:e].repeat_interleave(rep, 1), kd, B, B, scale)
        assert torch.equal(tok, want), (s, e)
    assert int(sum(blocks[:, b, :NB].sum() for b in range(NB, NBp))) == 0  # padding sees no token


def test_compiled_forward_and_no_recompile_on_new_budgets_and_lengths(monkeypatch):
    """torch.compile'd flex on the CPU (the kernels CUDA runs are the same block lists):
    equal to the reference; a second step with new budgets and new document lengths in
    the same bucket compiles nothing."""
    monkeypatch.setenv("SPARSEBALANCE_FLEX_COMPILE", "1")
    flex.reset_buckets()
    # the third step needs 18 blocks, its own bucket, and reuses the first's 22 (SAB's
    # micro-batches of unequal token counts)
    steps = [([300, 100, 250], 2), ([280, 200, 170], torch.tensor([1, 0, 3])), ([200, 150, 180], 3)]
    counts = []
    for lens, topk in steps:
        assert flex.bucket_blocks(sum(-(-L // 32) for L in lens)) == (22 if len(counts) < 2 else 18)
        q, k, v, cu, _ = make_inputs(lens, 4, 2, 32, seed=len(counts))
        ref, dens_ref = _fwd("reference", q, k, v, cu, topk, 32)
        out, dens = _fwd("flex", q, k, v, cu, topk, 32)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
        assert dens == dens_ref < 1.0
        counts.append(flex.compile_count())
    assert counts[0] >= 1 and counts[2] == counts[1] == counts[0], counts
    assert flex._layout_cache.values()[-1].padded_blocks == 22


def test_reused_bucket_within_the_padding_limit():
    flex.reset_buckets()
    key = (128, "cuda")
    assert flex.REUSE_PAD == 4.0
    assert flex.reused_bucket(540, key) == 576  # first use: its own bucket
    assert flex.reused_bucket(512, key) == 576  # own bucket 512, but 576 is compiled
    assert flex.reused_bucket(150, key) == 576  # 576 <= 4 x 150
    assert flex.reused_bucket(140, key) == 144  # 576 > 4 x 140: its own bucket, recorded
    assert flex.reused_bucket(130, key) == 144
    assert flex.reused_bucket(600, key) == 640  # larger than every bucket used
    assert flex.reused_bucket(540, (64, "cuda")) == 576 and flex.reused_bucket(100, (64, "cuda")) == 104
    flex.reset_buckets()
    assert flex.reused_bucket(300, key) == 320


def test_layout_is_cached_per_cu_seqlens_object():
    flex.reset_buckets()
    cu = torch.tensor([0, 300, 400, 650], dtype=torch.int32)
    dev = torch.device("cpu")
    a = flex.cached_layout(cu, 32, dev, reuse=False)
    assert flex.cached_layout(cu, 32, dev, reuse=False) is a  # the next layer
    assert flex.cached_layout(cu.clone(), 32, dev, reuse=False) is not a  # another micro-batch
    b = flex.cached_layout(cu, 32, dev, reuse=False)
    assert b is not a and torch.equal(b.pos, a.pos)
    cu[1] = 200  # changed in place: the version moves, the layout is rebuilt
    c = flex.cached_layout(cu, 32, dev, reuse=False)
    assert c is not b and c.blocks == 7 + 7 + 8
    assert flex.cached_layout(cu, 64, dev, reuse=False) is not c  # another block size


def test_forward_on_a_reused_larger_bucket_matches_reference():
    """Padding to a bigger bucket than the batch needs (a reused compiled shape) changes
    nothing: the padding blocks see only their own zero diagonal."""
    from sparsebalance.ops.plan import build_plan

    flex.reset_buckets()
    lens, topk, B = [300, 100, 250], 2, 32
    flex.reused_bucket(40, (B, "cpu"))  # a bucket of 40 blocks compiled earlier
    q, k, v, cu, _ = make_inputs(lens, 4, 2, 32, seed=3)
    scale = 32 ** -0.5
    lay = flex.flex_layout(cu, B, q.device, reuse=True)
    assert (lay.blocks, lay.padded_blocks) == (22, 40)
    plan = build_plan(q, k, cu, topk, B, scale)
    mask = flex.flex_block_mask(plan, lay, exact_mask_mod=True)
    with torch.no_grad():
        out = flex.flex_run(q, k, v, lay, mask, scale, compiled=False)
    ref, _ = _fwd("reference", q, k, v, cu, topk, B)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
    flex.reset_buckets()


def test_compiled_flex_rejects_block_sizes_without_a_16_tile(monkeypatch):
    assert flex._kernel_options(48, True) == {"fwd_BLOCK_M": 16, "fwd_BLOCK_N": 16}
    assert flex._kernel_options(64, True) == {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}
    assert flex._kernel_options(128, True) is None and flex._kernel_options(256, True) is None
    assert flex._kernel_options(20, False) is None  # eager: any block size
    monkeypatch.setenv("SPARSEBALANCE_FLEX_COMPILE", "1")
    q, k, v, cu, _ = make_inputs([100], 2, 2, 16)
    with pytest.raises(ValueError, match="divisible by 16, got 20"):
        sparse_attention(q, k, v, cu, topk=1, block_size=20, backend="flex")


def test_backward_off_cuda_is_a_clear_error():
    q, k, v, cu, _ = make_inputs([100], 2, 2, 16)
    with pytest.raises(ValueError, match="no backward off CUDA"):
        sparse_attention(q.requires_grad_(), k, v, cu, topk=1, block_size=16, backend="flex")
    with torch.no_grad():  # forward only is fine
        assert sparse_attention(q, k, v, cu, topk=1, block_size=16, backend="flex").shape == q.shape


def test_expanded_kv_gives_the_same_forward(monkeypatch):
    """SPARSEBALANCE_FLEX_EXPAND_KV=1 (K/V repeated to the query heads, for measuring
    flex's GQA backward floor on a GPU) changes no result."""
    lens, H, Hkv, D, B, topk = FLEX_CASES["block16-gqa-8to2"]
    q, k, v, cu, _ = make_inputs(lens, H, Hkv, D, seed=5)
    grouped, dens = _fwd("flex", q, k, v, cu, topk, B)
    monkeypatch.setenv("SPARSEBALANCE_FLEX_EXPAND_KV", "1")
    assert flex.expand_kv()
    expanded, dens2 = _fwd("flex", q, k, v, cu, topk, B)
    assert dens2 == dens < 1.0
    torch.testing.assert_close(expanded, grouped, rtol=1e-5, atol=2e-6)
