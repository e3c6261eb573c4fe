"""cuda and triton backends on a real GPU equal the reference (skipped without CUDA)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

from sparsebalance.ops import HAS_CUDA_EXT, HAS_TRITON

from _cases import CASES, make_inputs, run

BACKENDS = [b for b, ok in (("cuda", HAS_CUDA_EXT), ("triton", HAS_TRITON)) if ok]


def _on(dev, *ts):
    return [t.to(dev) for t in ts]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_matches_reference_fp32(backend, name):
    lens, H, Hkv, D, B, topk = CASES[name]
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run(backend, *_on("cuda", q, k, v, cu, dout), topk, B)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")
    assert got[4] == ref[4]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["ragged-gqa-single-tokens", "per-doc-topk"])
def test_gpu_bf16_error_within_twice_reference(backend, name):
    lens, H, Hkv, D, B, topk = CASES[name]
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, dtype=torch.bfloat16)
    truth = run("reference", q.float(), k.float(), v.float(), cu, dout.float(), topk, B)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run(backend, *_on("cuda", q, k, v, cu, dout), topk, B)
    for what, t, r, g in zip(("out", "dq", "dk", "dv"), truth, ref, got):
        ref_err = (r.float() - t).abs().max().item()
        err = (g.float().cpu() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-5, f"{what}: {err:.3g} vs reference {ref_err:.3g}"
