"""The ``fa4`` backend on a real GPU (skipped without CUDA or without flash-attn-4):
FlashAttention-4's block-sparse kernels fed the routing plan, outputs and dq/dk/dv
against the reference (error at most twice the reference's own error at the dtype, and
the same kept-pair count), bf16 and fp16, GQA, ragged documents; and no compilation
when a second step brings new document lengths and new budgets.

Ordered for a short GPU lease: the training shape first (it also compiles the kernels
the others reuse)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

from sparsebalance.ops import fa4

if not fa4.HAS_FA4:
    pytest.skip("flash-attn-4 not installed", allow_module_level=True)

from _cases import make_inputs, run, structured_inputs

B = 128


def _on(dev, *ts):
    return [t.to(dev) for t in ts]


def _check(lens, H, Hkv, D, topk, dtype, seed=0, where="", **routing):
    """``routing``: threshold routing's keywords (then block-structured inputs)."""
    if routing:
        q, k, v, cu, dout = structured_inputs(lens, H, Hkv, D, B, seed=seed, dtype=dtype)
    else:
        q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, dtype=dtype, seed=seed)
    got = run("fa4", *_on("cuda", q, k, v, cu, dout), topk, B, **routing)
    truth = run("reference", *_on("cuda", q.float(), k.float(), v.float(), cu, dout.float()), topk, B, **routing)
    ref = run("reference", *_on("cuda", q, k, v, cu, dout), topk, B, **routing)
    assert got[4] == ref[4], f"{where} kept pairs differ: {got[4]} vs {ref[4]}"
    for what, t, r, g in zip(("out", "dq", "dk", "dv"), truth, ref, got):
        ref_err = (r.float() - t).abs().max().item()
        err = (g.float() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-4, f"{where} {what}: {err:.3g} vs reference {ref_err:.3g}"
    return got[4]


def test_second_step_with_new_lengths_and_budgets_compiles_nothing():
    """bf16, head dim 128, GQA 16:2 (the bench shape): step 1 compiles; steps 2 and 3
    bring other lengths, other block counts and other budgets (per document too) and
    must compile nothing, and still be right (the new descriptors were really used)."""
    steps = [([1500, 1800, 796], 4), ([1000, 2000, 1096, 300], torch.tensor([2, 6, 1, 0])),
             ([5000, 129], 9)]
    counts = [fa4.compile_count()]
    densities = []
    for i, (lens, topk) in enumerate(steps):
        densities.append(_check(lens, 16, 2, 128, topk, torch.bfloat16, seed=i, where=f"step {i}"))
        counts.append(fa4.compile_count())
    assert counts[1] > counts[0], f"the first step should have compiled FA4's kernels: {counts}"
    assert counts[3] == counts[2] == counts[1], f"a later step compiled again: {counts}"
    assert all(d < 1.0 for d in densities), densities


def test_preset_shape_bf16():
    """Qwen2.5-0.5B's attention: 14 query heads, 2 KV groups, head dim 64."""
    _check([3000, 1, 700, 2100], 14, 2, 64, 3, torch.bfloat16)


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
def test_threshold_routing_bf16(per_head):
    """Threshold routing: per-head counts give per-head forward and backward lists."""
    _check([3000, 1, 700, 2100], 4, 2, 64, 8, torch.bfloat16, threshold=0.8, topk_min=1, per_head=per_head)


def test_fp16():
    _check([1300, 900, 37], 8, 2, 128, 2, torch.float16)


def test_dense_when_budget_covers_every_block():
    """top-k >= blocks: causal attention, which FA4's own dense causal kernel computes."""
    from flash_attn.cute import flash_attn_func

    q, k, v, cu, _ = make_inputs([2048], 8, 2, 128, dtype=torch.bfloat16, seed=3)
    q, k, v = _on("cuda", q, k, v)
    got = run("fa4", q, k, v, cu.cuda(), torch.zeros_like(q), 100, B)
    dense, _ = flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal=True)
    assert got[4] == 1.0
    assert (got[0].float() - dense[0].float()).abs().max().item() < 2e-2
