"""The fused routing on a real GPU (skipped without CUDA): the three Triton kernels
choose the blocks the torch route chooses on the same device (up to near ties of the
fp32 gates, summed in another order), their plans run every backend to the same
kept-pair counts, and fa4's query-direction lists from the kernel equal the torch ones;
threshold routing too (per-head and per-block counts), where a count may also differ at a
near tie of the softmax mass with TAU (the kernel sums it in another order).

Ordered for a short GPU lease: it runs right after test_fa4_gpu.py (benchmarks/gpu_lease.sh)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available", allow_module_level=True)

from _cases import fused_descriptors_checked, make_inputs, plan_rows_checked, structured_inputs

from sparsebalance.ops import plan as P


def _plan(mode, q, k, cu, topk, B, rule=None):
    os.environ["SPARSEBALANCE_ROUTE"] = mode
    try:
        P._skeletons.clear()
        with P.routing_rule(rule):
            return P.build_plan(q, k, cu, topk, B, q.shape[2] ** -0.5)
    finally:
        del os.environ["SPARSEBALANCE_ROUTE"]


@pytest.mark.parametrize("lens,H,Hkv,D,topk,dtype", [
    ([65536], 16, 2, 128, 8, torch.bfloat16),  # the bench's target point
    ([9000, 1, 30000, 700, 25835], 14, 2, 64, torch.tensor([4, 0, 8, 1, 3]), torch.bfloat16),
    ([5000, 129, 3000], 8, 2, 128, 2, torch.float16),
])
def test_fused_route_matches_torch_route_on_cuda(lens, H, Hkv, D, topk, dtype):
    q, k, _, cu, _ = make_inputs(lens, H, Hkv, D, dtype=dtype)
    q, k, cu = q.cuda(), k.cuda(), cu.cuda()
    ref, got = _plan("torch", q, k, cu, topk, 128), _plan("fused", q, k, cu, topk, 128)
    assert torch.equal(got.kv_cnt, ref.kv_cnt) and got.kept_pairs == ref.kept_pairs
    rows_differ = (got.kv_idx != ref.kv_idx).any(-1)
    # a row may differ only by a near tie of its k-th gate: at most 1 row in 1,000
    assert rows_differ.float().mean().item() <= 1e-3, rows_differ.sum().item()
    plan_rows_checked(got)
    fused_descriptors_checked(got)


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
@pytest.mark.parametrize("lens,H,Hkv,D,cap,tau,kmin", [
    ([65536], 16, 2, 128, 16, 0.9, 2),  # the bench's shape
    ([9000, 1, 30000, 700, 25835], 14, 2, 64, torch.tensor([8, 0, 24, 1, 6]), 0.7, 1),
])
def test_fused_threshold_route_matches_torch_route_on_cuda(lens, H, Hkv, D, cap, tau, kmin, per_head):
    """Per (head, query block) a count or a row may differ only at a near tie (of the gates
    at the chosen boundary, or of the softmax mass with TAU): at most 1 in 1,000 rows; the
    kept pairs then differ by those rows' counts only."""
    q, k, _, cu, _ = structured_inputs(lens, H, Hkv, D, 128, dtype=torch.bfloat16)
    q, k, cu = q.cuda(), k.cuda(), cu.cuda()
    rule = P.RoutingRule(tau, kmin, per_head=per_head)
    ref, got = _plan("torch", q, k, cu, cap, 128, rule), _plan("fused", q, k, cu, cap, 128, rule)
    assert got.kept.pending  # nothing read back while routing
    rows_differ = (got.kv_idx != ref.kv_idx).any(-1) | (got.kv_cnt != ref.kv_cnt)
    assert rows_differ.float().mean().item() <= 1e-3, rows_differ.sum().item()
    pairs = (got.kv_cnt.long() - ref.kv_cnt.long()).abs().sum().item() * 128 * 128
    assert abs(got.kept_pairs - ref.kept_pairs) <= pairs
    assert bool((got.kv_cnt < _plan("torch", q, k, cu, cap, 128).kv_cnt).any())  # the threshold binds
    plan_rows_checked(got)
    fused_descriptors_checked(got)
