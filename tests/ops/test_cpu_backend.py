"""The C++ ``cpu`` backend equals the reference (outputs and gradients) over a grid."""

import pytest
import torch
import torch.nn.functional as F
from _cases import CASES, expects_selection, make_inputs, run, structured_inputs

from sparsebalance.ops import HAS_CPU_EXT
from sparsebalance.pairs import density as exact_density

# `make test` builds the extension first, so a missing build is a failure, not a skip.
assert HAS_CPU_EXT, "sparsebalance._C is not built: run `make build`"


def _exact_density(lens, topk, B, H):
    if isinstance(topk, torch.Tensor):
        from sparsebalance.pairs import causal_pairs, kept_pairs

        kept = sum(int(kept_pairs([L], int(k), B)[0]) for L, k in zip(lens, topk.tolist()))
        return kept / int(causal_pairs(lens).sum())
    return exact_density(lens, topk, B)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_matches_reference_fp32(name):
    lens, H, Hkv, D, B, topk = CASES[name]
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run("cpu", q, k, v, cu, dout, topk, B)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")
    # Both backends report the closed-form kept-pair count of sparsebalance.pairs.
    assert got[4] == pytest.approx(_exact_density(lens, topk, B, H), rel=1e-12)
    assert ref[4] == pytest.approx(got[4], rel=1e-12)
    assert (got[4] < 1.0) == expects_selection(lens, B, topk)


@pytest.mark.parametrize("name", ["ragged-gqa-single-tokens", "topk1", "per-doc-topk", "odd-block-and-dim"])
def test_cpu_bf16_error_within_twice_reference(name):
    lens, H, Hkv, D, B, topk = CASES[name]
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, dtype=torch.bfloat16)
    truth = run("reference", q.float(), k.float(), v.float(), cu, dout.float(), topk, B)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run("cpu", q, k, v, cu, dout, topk, B)
    for what, t, r, g in zip(("out", "dq", "dk", "dv"), truth, ref, got):
        assert g.dtype == torch.bfloat16
        ref_err = (r.float() - t).abs().max().item()
        err = (g.float() - t).abs().max().item()
        assert ref_err > 0, "bf16 reference is exact: the comparison would be vacuous"
        assert err <= 2 * ref_err + 1e-5, f"{what}: kernel err {err:.3g} vs reference bf16 err {ref_err:.3g}"


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("lens,B", [([300, 1, 129], 64), ([513], 32)])
def test_topk_at_least_blocks_is_causal_sdpa(backend, lens, B):
    H, Hkv, D = 4, 2, 32
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, seed=3)
    got = run(backend, q, k, v, cu, dout, max(lens) // B + 1, B)
    assert got[4] == 1.0
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        f = lambda t: t[s:e].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(f(qq), f(kk), f(vv), is_causal=True, enable_gqa=True)
        outs.append(o.squeeze(0).transpose(0, 1))
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (qq, kk, vv), dout)
    for a, b in zip(got[:4], (out.detach(), *grads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("hkv", [1, 2])
@pytest.mark.parametrize("routing", [{}, dict(threshold=0.8, topk_min=1)], ids=["topk", "threshold-per-head"])
def test_cpu_backend_is_deterministic_and_threads_agree(routing, hkv):
    """Two threads (dK/dV by kv-head ownership, or per-thread buffers over a fixed split:
    1 kv head, or per-head counts that load the kv heads unequally) run twice bit for bit
    alike, and agree with one thread."""
    lens, H, _, D, B, topk = CASES["ragged-gqa-single-tokens"]
    q, k, v, cu, dout = structured_inputs(lens, H, hkv, D, B, seed=5)
    topk = 4 if routing else topk
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = run("cpu", q, k, v, cu, dout, topk, B, **routing)
        b = run("cpu", q, k, v, cu, dout, topk, B, **routing)
        torch.set_num_threads(1)  # other dk/dv strategy (ownership vs per-thread buffers)
        c = run("cpu", q, k, v, cu, dout, topk, B, **routing)
    finally:
        torch.set_num_threads(n)
    for x, y, z in zip(a[:4], b[:4], c[:4]):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-5)  # fp32 sums in another order


def test_cpu_kernel_rejects_bad_plan():
    from sparsebalance.ops import _ext

    q, k, v, cu, _ = make_inputs([64], 1, 1, 16)
    qb_start = torch.tensor([0, 32], dtype=torch.int32)
    qb_len = torch.tensor([32, 32], dtype=torch.int32)
    kv_cnt = torch.tensor([[1, 2]], dtype=torch.int32)  # [H, NB]
    bad = torch.tensor([[[0, -1], [1, 0]]], dtype=torch.int32)  # diagonal not last
    with pytest.raises(RuntimeError, match="diagonal"):
        _ext.cpu_ext.sparse_attention_fwd(q, k, v, qb_start, qb_len, bad, kv_cnt, 32, 0.25)
    with pytest.raises(RuntimeError, match="int32"):
        _ext.cpu_ext.sparse_attention_fwd(q, k, v, qb_start.long(), qb_len, bad, kv_cnt, 32, 0.25)
