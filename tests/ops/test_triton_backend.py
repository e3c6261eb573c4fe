"""The ``triton`` backend equals the reference, run by Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported, so the outer test
re-runs this file in a child pytest with the variable set, side by side with
test_route_kernels.py's (``_interpreter.py``); the rest of the suite never sees it.
Sizes are tiny: the interpreter is slow.
"""

import os
import re

import _interpreter
import pytest
import torch
from _cases import make_inputs, run, structured_inputs

# name -> (doc lengths, H, Hkv, D, block_size, topk)
CASES = {
    "ragged-gqa-single-tokens": ([70, 1, 1, 9, 40], 4, 2, 16, 16, 1),
    "topk0-odd-block-and-dim": ([90], 2, 2, 24, 20, 0),
    "per-doc-topk": ([100, 80], 2, 1, 16, 16, torch.tensor([2, 0])),
}

if os.environ.get("TRITON_INTERPRET") != "1":
    _interpreter.register(__file__)

    def test_triton_backend_under_interpreter():
        rc, out = _interpreter.run(__file__)
        assert rc == 0, out[-6000:]
        passed = re.search(r"(\d+) passed", out)
        assert passed and int(passed.group(1)) == 2 * len(CASES) + 3, out[-2000:]

    def test_autotune_configs(monkeypatch):
        """GPU: a small warps x stages list per (block, head dim, precision); the
        interpreter gets one config (nothing to time on CPU)."""
        from sparsebalance.ops import triton_kernels as tk

        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.delenv("SPARSEBALANCE_TRITON_AUTOTUNE", raising=False)
        gpu = tk._configs()
        assert sorted((c.kwargs["SPLIT"], c.num_warps, c.num_stages) for c in gpu) == sorted(
            tk.GPU_CONFIGS)
        assert {c.kwargs["SPLIT"] for c in gpu} == {1, 2} and {c.num_warps for c in gpu} == {4, 8}
        # 16-bit inputs at block 128, head dim >= 64: only the 8-warp configs (4 spill)
        kept = tk._prune(gpu, {"BLOCK": 128, "BLOCK_D": 128, "F32": False})
        assert sorted((c.kwargs["SPLIT"], c.num_warps) for c in kept) == [(1, 8), (2, 8)]
        assert len(tk._prune(gpu, {"BLOCK": 128, "BLOCK_D": 128, "F32": True})) == 5  # fp32: all
        assert len(tk._prune(gpu, {"BLOCK": 64, "BLOCK_D": 128, "F32": False})) == 5  # block 64: all
        monkeypatch.setenv("SPARSEBALANCE_TRITON_AUTOTUNE", "0")
        assert [(c.kwargs["SPLIT"], c.num_warps, c.num_stages) for c in tk._configs()] == [(2, 8, 2)]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert [(c.kwargs["SPLIT"], c.num_warps, c.num_stages) for c in tk._configs()] == [(2, 4, 1)]
        # sub-tiles under 16 rows are pruned; a 16-row block still gets one config
        assert {c.kwargs["SPLIT"] for c in tk._prune(gpu, {"BLOCK": 32})} == {1, 2}
        assert {c.kwargs["SPLIT"] for c in tk._prune(gpu, {"BLOCK": 16})} == {1}
        assert [c.kwargs["SPLIT"] for c in tk._prune(tk._configs(), {"BLOCK": 16})] == [1]
        for kernel in (tk._fwd_kernel, tk._bwd_dq_kernel, tk._bwd_dkdv_kernel):
            assert list(kernel.keys) == ["BLOCK", "BLOCK_D", "F32"]

    @pytest.mark.parametrize("arch", [80, 90])
    def test_gpu_kernels_compile_without_a_gpu(arch):
        """Every kernel compiles to a cubin for sm_80 / sm_90 in bf16 with the sub-tile
        path (what the interpreter never exercises: bf16 tensor-core dots, the real
        compiler's constexpr and shared-memory checks)."""
        triton = pytest.importorskip("triton")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from sparsebalance.ops import triton_kernels as tk

        ptr, i32, f32 = "*bf16", "i32", "fp32"
        tables = lambda *names: {n: "*i32" for n in names}
        scalars = lambda *names: {n: i32 for n in names}
        ce = {"BLOCK": 128, "BLOCK_D": 128, "F32": False, "SPLIT": 2}
        sigs = {
            tk._fwd_kernel: {**{n: ptr for n in "Q K V Out".split()}, "LSE": "*fp32",
                             **tables("QB_START", "QB_LEN", "KV_IDX", "KV_CNT"), "qk_scale": f32,
                             **scalars("s_qt", "s_qh", "s_kt", "s_kh", "T", "NB", "W", "REP", "D")},
            tk._bwd_dq_kernel: {**{n: ptr for n in "Q K V DO DQ".split()}, "LSE": "*fp32",
                                "DELTA": "*fp32", **tables("QB_START", "QB_LEN", "KV_IDX", "KV_CNT"),
                                "qk_scale": f32, "sm_scale": f32,
                                **scalars("s_qt", "s_qh", "s_kt", "s_kh", "T", "NB", "W", "REP", "D")},
            tk._bwd_dkdv_kernel: {**{n: ptr for n in "Q K V DO DK DV".split()}, "WS_DK": "*fp32",
                                  "WS_DV": "*fp32", "LSE": "*fp32", "DELTA": "*fp32",
                                  **tables("QB_START", "QB_LEN", "ITEM_SEG", "ITEM_LO", "ITEM_HI",
                                           "ITEM_SLOT", "VISITS"), "qk_scale": f32, "sm_scale": f32,
                                  **scalars("s_qt", "s_qh", "s_kt", "s_kh", "T", "NB", "REP", "D")},
        }
        for kernel, sig in sigs.items():
            src = ASTSource(fn=kernel.fn, signature={**sig, **{k: "constexpr" for k in ce}}, constexprs=ce)
            out = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                 options={"num_warps": 4, "num_stages": 2})
            assert out.asm["cubin"] and out.metadata.shared <= 160 * 1024, kernel.fn.__name__
        red = {"BLOCK": 128, "BLOCK_D": 128}
        sig = {"DK": ptr, "DV": ptr, "WS_DK": "*fp32", "WS_DV": "*fp32",
               **tables("QB_START", "QB_LEN", "RED_SEG", "RED_FIRST", "RED_N"), "sm_scale": f32,
               **scalars("s_kt", "s_kh", "NB", "D"), **{k: "constexpr" for k in red}}
        out = triton.compile(ASTSource(fn=tk._reduce_kernel, signature=sig, constexprs=red),
                             target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        assert out.asm["cubin"]

    def test_dkdv_work_covers_every_visit_once():
        """Items tile each (kv head, key block) segment's visits exactly; split segments
        get consecutive slots and one reduce entry."""
        from sparsebalance.ops.plan import build_plan
        from sparsebalance.ops.triton_backend import dkdv_work

        q, k, _, cu, _ = make_inputs([300, 40, 200], 4, 2, 16, seed=3)
        plan = build_plan(q, k, cu, 2, 16, 0.25)
        H, NB, W = plan.kv_idx.shape
        want = {}
        for h in range(H):
            for b in range(NB):
                for j in plan.kv_idx[h, b].tolist():
                    if j >= 0:
                        want.setdefault((h // 2) * NB + j, []).append(h * NB + b)
        for chunk in (0, 1, 5):
            wk = dkdv_work(plan.kv_idx, 2, chunk)
            got, slots = {}, {}
            for seg, lo, hi, slot in zip(*(wk[x].tolist() for x in ("seg", "lo", "hi", "slot"))):
                assert 0 < hi - lo <= (chunk or hi - lo)
                got.setdefault(seg, []).extend(wk["visits"][lo:hi].tolist())
                slots.setdefault(seg, []).append(slot)
            assert {s: sorted(v) for s, v in got.items()} == {s: sorted(v) for s, v in want.items()}
            red = dict(zip(wk["red_seg"].tolist(), zip(wk["red_first"].tolist(), wk["red_n"].tolist())))
            for seg, sl in slots.items():
                if len(sl) == 1:
                    assert sl == [-1] and seg not in red
                else:
                    assert sl == list(range(red[seg][0], red[seg][0] + red[seg][1]))
            assert wk["n_slots"] == sum(n for _, n in red.values())
            if chunk == 1:
                assert wk["n_slots"] > 0

else:
    from sparsebalance.ops import is_available

    @pytest.mark.parametrize("chunk", [0, 3])
    @pytest.mark.parametrize("name", sorted(CASES))
    def test_triton_matches_reference_fp32(name, chunk, monkeypatch):
        """chunk 3: every segment with more than 3 visits is split (partials + reduce)."""
        from sparsebalance.ops import triton_backend

        monkeypatch.setattr(triton_backend, "DKDV_CHUNK", chunk)
        assert is_available("triton", torch.device("cpu"))
        lens, H, Hkv, D, B, topk = CASES[name]
        q, k, v, cu, dout = make_inputs(lens, H, Hkv, D, seed=1)
        ref = run("reference", q, k, v, cu, dout, topk, B)
        got = run("triton", q, k, v, cu, dout, topk, B)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")
        assert got[4] == ref[4] < 1.0

    @pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
    def test_triton_matches_reference_under_threshold_routing(per_head):
        """Threshold routing (ragged, GQA, a minimum): per-head rows of unequal length."""
        lens, H, Hkv, D, B = [100, 1, 70], 4, 2, 16, 16
        q, k, v, cu, dout = structured_inputs(lens, H, Hkv, D, B, seed=1)
        kw = dict(threshold=0.8, topk_min=1, per_head=per_head)
        ref = run("reference", q, k, v, cu, dout, 4, B, **kw)
        got = run("triton", q, k, v, cu, dout, 4, B, **kw)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5, msg=lambda m: f"{what}: {m}")
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
