"""The ``triton`` backend equals the reference, run by Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported, so the outer test
re-runs this file in a child pytest with the variable set; the rest of the
suite never sees it. Sizes are tiny: the interpreter is slow.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from _cases import make_inputs, run

# name -> (doc lengths, H, Hkv, D, block_size, topk)
CASES = {
    "ragged-gqa-single-tokens": ([70, 1, 1, 9, 40], 4, 2, 16, 16, 1),
    "topk0-odd-block-and-dim": ([90], 2, 2, 24, 20, 0),
    "per-doc-topk": ([100, 80], 2, 1, 16, 16, torch.tensor([2, 0])),
}

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_triton_backend_under_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env=env, cwd=repo, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        passed = re.search(r"(\d+) passed", r.stdout)
        assert passed and int(passed.group(1)) == len(CASES) + 1, r.stdout[-2000:]

    def test_autotune_configs(monkeypatch):
        """GPU: a small warps x stages list per (block, head dim, precision); the
        interpreter gets one config (nothing to time on CPU)."""
        from sparsebalance.ops import triton_kernels as tk

        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        gpu = tk._configs()
        assert sorted((c.num_warps, c.num_stages) for c in gpu) == [
            (w, s) for w in (4, 8) for s in (1, 2, 3)]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert [(c.num_warps, c.num_stages) for c in tk._configs()] == [(4, 1)]
        for kernel in (tk._fwd_kernel, tk._bwd_dq_kernel, tk._bwd_dkdv_kernel):
            assert list(kernel.keys) == ["BLOCK", "BLOCK_D", "F32"]

else:
    from sparsebalance.ops import is_available

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_triton_matches_reference_fp32(name):
        assert is_available("triton", torch.device("cpu"))
        lens, H, Hkv, D, B, topk = CASES[name]
        q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, seed=1)
        ref = run("reference", q, k, v, cu, dout, topk, B)
        got = run("triton", q, k, v, cu, dout, topk, B)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")
        assert got[4] == ref[4] < 1.0

    def test_triton_bf16_error_within_twice_reference():
        lens, H, Hkv, D, B, topk = CASES["ragged-gqa-single-tokens"]
        q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, dtype=torch.bfloat16, seed=2)
        truth = run("reference", q.float(), k.float(), v.float(), cu, dout.float(), topk, B)
        ref = run("reference", q, k, v, cu, dout, topk, B)
        got = run("triton", q, k, v, cu, dout, topk, B)
        for what, t, r, g in zip(("out", "dq", "dk", "dv"), truth, ref, got):
            ref_err = (r.float() - t).abs().max().item()
            err = (g.float() - t).abs().max().item()
            assert ref_err > 0
            assert err <= 2 * ref_err + 1e-5, f"{what}: {err:.3g} vs reference {ref_err:.3g}"
