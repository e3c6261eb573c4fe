"""cuda and triton backends on a real GPU equal the reference (skipped without CUDA).

Run order matters on a short GPU lease, where gpu-check may cut this module at its time
share and counts the tests finished before the cut: the bf16 training shapes first, each
backend through all its cases before the next (triton, then the tensor-core CUDA kernels,
then the SIMT ones), then fp32 exactness."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

from _cases import CASES, make_inputs, run, structured_inputs

from sparsebalance.ops import HAS_CUDA_EXT, HAS_TRITON, is_available

BACKENDS = [b for b, ok in (("triton", HAS_TRITON), ("cuda", HAS_CUDA_EXT)) if ok]

# bf16 shapes of training: the tensor-core CUDA kernels' tiles (64 rows, head dim padded
# to 32/64/128), several row passes per routing block, partial last blocks, GQA.
BF16_CASES = {
    "d128-block128-gqa": ([700, 300, 1100], 8, 2, 128, 128, 2),
    "d64-block48-mqa": ([500, 37, 1], 4, 1, 64, 48, 1),
    "d80-block64-per-doc": ([900, 260], 4, 2, 80, 64, torch.tensor([3, 0])),
}


def _on(dev, *ts):
    return [t.to(dev) for t in ts]


BF16_BACKENDS = [*(["triton"] if HAS_TRITON else []), *(["cuda-tensor-cores", "cuda"] if HAS_CUDA_EXT else [])]


@pytest.mark.parametrize("name", [*BF16_CASES, "ragged-gqa-single-tokens", "per-doc-topk"])
@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_gpu_bf16_error_within_twice_reference(backend, name, monkeypatch):
    """cuda-tensor-cores: the extension's WMMA kernels (opt-in by environment variable,
    read at every launch); plain cuda: its SIMT kernels."""
    monkeypatch.setenv("SPARSEBALANCE_CUDA_TENSOR_CORES", "1" if backend == "cuda-tensor-cores" else "0")
    backend = backend.replace("-tensor-cores", "")
    lens, H, Hkv, D, B, topk = {**CASES, **BF16_CASES}[name]
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, dtype=torch.bfloat16)
    truth = run("reference", q.float(), k.float(), v.float(), cu, dout.float(), topk, B)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run(backend, *_on("cuda", q, k, v, cu, dout), topk, B)
    for what, t, r, g in zip(("out", "dq", "dk", "dv"), truth, ref, got):
        ref_err = (r.float() - t).abs().max().item()
        err = (g.float().cpu() - t).abs().max().item()
        assert err <= 2 * ref_err + 1e-5, f"{what}: {err:.3g} vs reference {ref_err:.3g}"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_matches_reference_fp32(backend, name):
    lens, H, Hkv, D, B, topk = CASES[name]
    q, k, v, cu, dout = make_inputs(lens, H, Hkv, D)
    ref = run("reference", q, k, v, cu, dout, topk, B)
    got = run(backend, *_on("cuda", q, k, v, cu, dout), topk, B)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")
    assert got[4] == ref[4]


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
@pytest.mark.parametrize("backend", [*BACKENDS, *(["flex"] if is_available("flex", torch.device("cuda")) else [])])
def test_gpu_threshold_routing_matches_reference_fp32(backend, per_head):
    """Threshold routing (ragged, GQA, per-document caps, a minimum): per-head counts give
    rows of unequal length per head; outputs, gradients and kept pairs equal the reference."""
    lens, H, Hkv, D, B = [700, 1, 300, 129, 1100], 4, 2, 32, 32
    q, k, v, cu, dout = structured_inputs(lens, H, Hkv, D, B)
    kw = dict(threshold=0.8, topk_min=1, per_head=per_head)
    caps = torch.tensor([8, 0, 3, 8, 20])
    ref = run("reference", q, k, v, cu, dout, caps, B, **kw)
    got = run(backend, *_on("cuda", q, k, v, cu, dout), caps, B, **kw)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=5e-5, msg=lambda m: f"{what}: {m}")
    assert got[4] == ref[4] < 1.0
