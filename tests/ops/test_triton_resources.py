"""Register spills of the Triton kernels' autotune configs, compiled for sm_90 on the CPU.

The configs the prune hook keeps at the main shape (bf16, head dim 128, routing block
128) must not spill more than audited (benchmarks/triton_resource_audit.py): a kernel change
that spills more fails here, without a GPU. fwd, reduce and dq at SPLIT 2 do not spill;
dq at SPLIT 1 and dkdv still do (255 registers a thread), so their budgets are the
audited spill stores (bytes a thread) plus ~10%; lower them when a change spills less.
"""

import os

import pytest

# (kernel, SPLIT) -> bytes of spill stores allowed; audited (8 warps, 2 stages): fwd 0 / 0,
# dq 20 / 0, dkdv 932 / 168 (SPLIT 1 / 2), reduce 0 (8 warps).
BUDGET = {("fwd", 1): 0, ("fwd", 2): 0, ("dq", 1): 32, ("dq", 2): 0,
          ("dkdv", 1): 1024, ("dkdv", 2): 184, ("reduce", None): 0}

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the interpreter does not compile")


def _kept_configs():
    pytest.importorskip("triton")
    from sparsebalance.ops import triton_kernels as tk

    with pytest.MonkeyPatch.context() as mp:  # the autotuner's list, not the test-only single config
        mp.delenv("SPARSEBALANCE_TRITON_AUTOTUNE", raising=False)
        configs = tk._configs()
    kept = tk._prune(configs, {}, BLOCK=128, BLOCK_D=128, F32=False)
    return [(c.kwargs["SPLIT"], c.num_warps, c.num_stages) for c in kept]


def test_kept_configs_at_main_shape():
    kept = _kept_configs()
    assert len(kept) >= 2 and all(w == 8 for _, w, _ in kept), kept


def test_kept_configs_do_not_spill_more_than_audited():
    pytest.importorskip("triton")
    from concurrent.futures import ProcessPoolExecutor

    from benchmarks.triton_resource_audit import audit_one
    from sparsebalance.ops.triton_backend import _RED_WARPS

    jobs = [(k, 128, 128, "bf16", sp, w, s) for k in ("fwd", "dq", "dkdv") for sp, w, s in _kept_configs()]
    jobs.append(("reduce", 128, 128, "bf16", 1, _RED_WARPS, 3))
    with ProcessPoolExecutor(2) as ex:  # ~5-10 s a compile
        rows = list(ex.map(audit_one, *zip(*jobs)))
    for r in rows:
        name = f"{r['kernel']} SPLIT={r['split']} warps={r['num_warps']} stages={r['num_stages']}"
        assert r["regs"] > 0, name  # the ptxas log was read
        assert r["spill_stores"] <= BUDGET[r["kernel"], r["split"]], (name, r)
        assert not r["wgmma_serialized"] and r["smem"] <= 227 * 1024, (name, r)
