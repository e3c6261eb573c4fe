"""The ``flex`` backend on a real GPU (skipped without CUDA): compiled FlexAttention,
outputs and dq/dk/dv against the reference, and no recompilation when a second step
brings new budgets and new document lengths in the same shape bucket.

Run order matters on a short GPU lease, where gpu-check may cut this module at its time
share and counts the tests finished before the cut: the training shape first (bf16, head
dim 128, GQA 16:2, block 128, no recompilation), then bf16 and fp32 exactness, the
compile counter, and last the bf16 block-64 case (compiled with autotuning)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

from _cases import expects_selection, make_inputs, run

from sparsebalance.ops import flex

# name -> (doc lengths, H, Hkv, D, block_size, topk)
FP32_CASES = {
    "d64-block32-ragged-gqa": ([200, 1, 77, 333], 4, 2, 64, 32, 2),
    "d128-block64-per-doc": ([400, 300, 500], 4, 1, 128, 64, torch.tensor([0, 3, 1])),
    "d64-block128-k-ge-blocks": ([700, 129], 2, 2, 64, 128, 50),
    "d128-block128-selects": ([1500, 260], 4, 2, 128, 128, 3),
}
BF16_CASES = {
    "d128-block128-gqa": ([700, 300, 1100], 8, 2, 128, 128, 2),
    "d128-block64-gqa-per-doc": ([900, 260, 1], 8, 2, 128, 64, torch.tensor([3, 0, 1])),
    "d64-block128-mqa": ([1300, 37], 4, 1, 64, 128, 1),
}


def _on(dev, *ts):
    return [t.to(dev) for t in ts]


def test_second_step_with_new_budgets_and_lengths_compiles_nothing():
    """Training-like steps (bf16, head dim 128, GQA 16:2, block 128): step 2 has other
    documents and other budgets but the same bucket; it must not compile (dynamo is told
    to raise on a recompilation, and the counter must not move), and its result must
    still be right (the new indices were really used)."""
    import torch._dynamo.config as dc

    B = 128
    flex.reset_buckets()
    # step 3 has fewer tokens (24 blocks, its own bucket) and reuses the first bucket (34)
    steps = [([1500, 1800, 796], 4), ([1000, 2000, 1096], torch.tensor([2, 6, 1])), ([1000, 1200, 700], 5)]
    assert [flex.bucket_blocks(sum(-(-L // B) for L in lens)) for lens, _ in steps] == [34, 34, 24]
    counts = [flex.compile_count()]
    for i, (lens, topk) in enumerate(steps):
        q, k, v, cu, dout = make_inputs(lens, 16, 2, 128, dtype=torch.bfloat16, seed=i)
        if i == 0:
            got = run("flex", *_on("cuda", q, k, v, cu, dout), topk, B)
        else:
            with dc.patch(error_on_recompile=True):
                got = run("flex", *_on("cuda", q, k, v, cu, dout), topk, B)
        counts.append(flex.compile_count())
        truth = run("reference", *_on("cuda", q.float(), k.float(), v.float(), cu, dout.float()), topk, B)
        ref = run("reference", *_on("cuda", q, k, v, cu, dout), topk, B)
        assert got[4] == ref[4] < 1.0
        for what, t, r, g in zip(("out", "dq", "dk", "dv"), truth, ref, got):
            ref_err = (r.float() - t).abs().max().item()
            err = (g.float() - t).abs().max().item()
            assert err <= 2 * ref_err + 1e-5, f"step {i} {what}: {err:.3g} vs {ref_err:.3g}"
    assert counts[1] > counts[0], f"the first step should have compiled flex_attention: {counts}"
    assert counts[3] == counts[2] == counts[1], f"a later step compiled again: {counts}"


@pytest.mark.parametrize("name", [n for n in BF16_CASES if BF16_CASES[n][4] >= 128])
def test_flex_bf16_error_within_twice_reference(name):
    _bf16_within_twice_reference(*BF16_CASES[name])


def _bf16_within_twice_reference(lens, H, Hkv, D, B, topk):
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, dtype=torch.bfloat16)
    truth = run("reference", q.float(), k.float(), v.float(), cu, dout.float(), topk, B)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run("flex", *_on("cuda", q, k, v, cu, dout), topk, B)
    assert got[4] == ref[4]
    for what, t, r, g in zip(("out", "dq", "dk", "dv"), truth, ref, got):
        ref_err = (r.float() - t).abs().max().item()
        err = (g.float().cpu() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-5, f"{what}: {err:.3g} vs reference {ref_err:.3g}"


@pytest.mark.parametrize("name", sorted(FP32_CASES))
def test_flex_fwd_bwd_matches_reference_fp32(name):
    lens, H, Hkv, D, B, topk = FP32_CASES[name]
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run("flex", *_on("cuda", q, k, v, cu, dout), topk, B)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=5e-5, msg=lambda m: f"{what}: {m}")
    assert got[4] == ref[4]
    assert (ref[4] < 1.0) == expects_selection(lens, B, topk)


def test_new_bucket_compiles_and_is_counted():
    """The counter sees a real compilation (so the no-recompilation test can fail)."""
    flex.reset_buckets()  # no reuse of a bucket compiled by the tests above
    before = flex.compile_count()
    lens = [5000]  # 40 blocks: a bucket no other test here uses
    q, k, v, cu, dout = make_inputs(lens, 16, 2, 128, dtype=torch.bfloat16, seed=5)
    run("flex", *_on("cuda", q, k, v, cu, dout), 3, 128)
    assert flex.compile_count() > before


@pytest.mark.parametrize("name", [n for n in BF16_CASES if BF16_CASES[n][4] < 128])
def test_flex_bf16_block_under_128_autotuned(name):
    """Last: bf16 blocks under 128 compile with Inductor's autotuning (minutes)."""
    _bf16_within_twice_reference(*BF16_CASES[name])
