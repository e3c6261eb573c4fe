"""Routing without host work per layer: the plan's skeleton (what depends on the documents
and budgets only) is built once per micro-batch and reused by every layer; the document
boundaries are read from the host copy that rides with the micro-batch, never copied
back from the device tensor. On the CPU there is no device sync to observe, so these
tests count what would cause one: skeleton builds and host copies, by tensor."""

import torch
from _cases import make_inputs

from sparsebalance.ops import plan as plan_mod
from sparsebalance.ops import sparse_attention
from sparsebalance.ops.plan import build_plan


def _plans_equal(a, b):
    return (torch.equal(a.kv_idx, b.kv_idx) and torch.equal(a.kv_cnt, b.kv_cnt)
            and a.kept_pairs == b.kept_pairs and a.causal_pairs == b.causal_pairs)


def test_layers_of_one_microbatch_build_one_skeleton(routing_counts):
    lens = [700, 1, 300, 1100]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    plans = []
    for layer in range(6):  # every layer has its own q and k, the same documents and budget
        q, k, _, _, _ = make_inputs(lens, 8, 2, 32, seed=layer)
        plans.append((q, k, build_plan(q, k, cu, 3, 64, 32 ** -0.5)))
    assert routing_counts["skeletons"] == 1 and routing_counts["copies"]() == 1
    # each layer's selection is its own and equals a plan built from nothing
    for q, k, p in plans:
        plan_mod._skeletons.clear()
        plan_mod._host_cu.clear()
        assert _plans_equal(p, build_plan(q, k, cu.clone(), 3, 64, 32 ** -0.5))
    assert not torch.equal(plans[0][2].kv_idx, plans[1][2].kv_idx)


def test_new_budget_or_edited_boundaries_rebuild(routing_counts):
    lens = [900, 400]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, _, _, _ = make_inputs(lens, 4, 2, 16)
    a = build_plan(q, k, cu, 2, 64, 0.25)
    b = build_plan(q, k, cu, 5, 64, 0.25)  # another budget: another skeleton
    assert routing_counts["skeletons"] == 2 and b.kept_pairs > a.kept_pairs
    budgets = torch.tensor([1, 4])
    c = build_plan(q, k, cu, budgets, 64, 0.25)
    budgets[0] = 3  # edited in place: its version moves, the skeleton is rebuilt
    d = build_plan(q, k, cu, budgets, 64, 0.25)
    assert routing_counts["skeletons"] == 4 and d.kept_pairs > c.kept_pairs
    cu[1] = 1000  # boundaries edited in place (same tensor): copied and built again
    e = build_plan(q, k, cu, 2, 64, 0.25)
    assert routing_counts["skeletons"] == 5 and routing_counts["copies"]() == 2
    plan_mod._skeletons.clear()
    plan_mod._host_cu.clear()
    assert _plans_equal(e, build_plan(q, k, cu.clone(), 2, 64, 0.25))


def test_sparse_attention_validates_and_routes_from_one_host_copy(routing_counts):
    lens = [300, 45, 500]
    q, k, v, cu, _ = make_inputs(lens, 4, 2, 16)
    for _ in range(3):
        sparse_attention(q, k, v, cu, topk=1, block_size=32, backend="reference", return_density=True)
        sparse_attention(q, k, v, cu, topk=1, block_size=32, backend="cpu")
    assert routing_counts["copies"]() == 1 and routing_counts["copied"]()[0] is cu
