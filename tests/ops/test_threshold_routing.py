"""Threshold routing (issue 41): per query block the smallest count of candidate key
blocks that holds TAU of each head's gate softmax, within [topk_min, topk], plus sink and
diagonal. The reference routes on its own (the oracle); every CPU backend runs the shared
plan and must match it, fa4's descriptors must expand to its mask, TAU = 1 with a cap of
every block is dense, and documents of equal length get different densities when their
content differs."""

import pytest
import torch
from _cases import descriptor_mask, make_inputs, plan_rows_checked, structured_inputs

from sparsebalance.ops import fa4, sparse_attention
from sparsebalance.ops.flex import flex_layout
from sparsebalance.ops.plan import RoutingRule, build_plan, routing_rule
from sparsebalance.ops.reference import _doc_mask

# name -> (doc lengths, H, Hkv, D, block_size, cap, tau, topk_min)
CASES = {
    "ragged-gqa-tau0.8": ([700, 1, 300, 129, 1100], 4, 2, 32, 32, 8, 0.8, 0),
    "tau0.5-min2": ([900, 640], 4, 1, 16, 32, 12, 0.5, 2),
    "tau0.95-cap3": ([1000, 77], 2, 2, 16, 32, 3, 0.95, 1),
    "per-doc-caps": ([600, 600, 600], 4, 2, 16, 32, torch.tensor([0, 4, 20]), 0.9, 1),
    "block64-min-over-cap": ([2000], 2, 1, 32, 64, 2, 0.7, 5),
}


def _inputs(case, seed=0):
    return structured_inputs(*case[:5], seed=seed)


def _run(backend, case, threshold=True, seed=0, per_head=True, grads=False):
    """(out, density) of one backend, and (dq, dk, dv) when ``grads``."""
    lens, H, Hkv, D, B, cap, tau, kmin = case
    q, k, v, cu, dout = _inputs(case, seed=seed)
    if grads:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, dens = sparse_attention(q, k, v, cu, topk=cap, block_size=B, backend=backend, return_density=True,
                                 threshold=tau if threshold else None, topk_min=kmin, per_head=per_head)
    if not grads:
        return out, dens
    return out.detach(), dens, torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("backend", ["cpu", "flex"])
def test_backends_match_the_reference(name, backend, per_head):
    grads = backend == "cpu"  # flex on the CPU has no backward
    ref = _run("reference", CASES[name], per_head=per_head, grads=grads)
    got = _run(backend, CASES[name], per_head=per_head, grads=grads)
    assert got[1] == ref[1]
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # fp32, logits up to ~50
    for a, b in zip(got[2:][0] if grads else (), ref[2:][0] if grads else ()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_head_counts_keep_fewer_pairs_and_differ_by_head(name):
    """Per-head counts never keep more pairs than the per-block count (the largest head's),
    and on these inputs some query block's heads keep different counts."""
    lens, H, Hkv, D, B, cap, tau, kmin = CASES[name]
    q, k, _, cu, _ = _inputs(CASES[name])
    plans = {}
    for per_head in (True, False):
        with routing_rule(RoutingRule(tau, kmin, per_head=per_head)):
            plans[per_head] = build_plan(q, k, cu, cap, B, D ** -0.5)
    ph, pb = plans[True], plans[False]
    assert ph.kv_cnt.shape == pb.kv_cnt.shape == (H, ph.qb_len.numel())
    assert torch.equal(pb.kv_cnt, pb.kv_cnt[:1].expand_as(pb.kv_cnt))  # one count per block
    assert torch.equal(ph.kv_cnt.amax(0), pb.kv_cnt[0])  # the per-block count is the largest head's
    assert ph.kept_pairs <= pb.kept_pairs
    for p in (ph, pb):
        assert int(p.head_kept.sum()) == p.kept_pairs == int(p.doc_kept.sum())
        assert p.kv_nnz == int(p.kv_cnt.sum(1).max())
        assert torch.equal((p.kv_idx >= 0).sum(-1), p.kv_cnt)  # -1 past each head's count
        plan_rows_checked(p)  # the row layout the GPU route test checks (test_route_gpu.py)
    if name != "block64-min-over-cap":  # there the minimum binds every head
        assert bool((ph.kv_cnt != ph.kv_cnt[:1]).any()) and ph.kept_pairs < pb.kept_pairs


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_counts_and_fa4_descriptors_follow_the_rule(name, per_head):
    lens, H, Hkv, D, B, cap, tau, kmin = CASES[name]
    q, k, _, cu, _ = _inputs(CASES[name])
    scale = D ** -0.5
    rule = RoutingRule(tau, kmin, per_head=per_head)
    with routing_rule(rule):
        plan = build_plan(q, k, cu, cap, B, scale)
    caps = cap.tolist() if isinstance(cap, torch.Tensor) else [cap] * len(lens)
    i = 0
    for L, c in zip(lens, caps):  # chosen blocks per query block within [min(kmin, cand), min(cap, cand)]
        for b in range(-(-L // B)):
            cand = max(b - 1, 0)
            chosen = plan.kv_cnt[:, i] - 1 - int(b > 0)
            assert bool(((min(kmin, c, cand) <= chosen) & (chosen <= min(c, cand))).all()), (L, b, chosen)
            i += 1
    # fa4's descriptors, expanded as FA4 reads them, equal the reference's threshold mask
    layout = flex_layout(cu, B, q.device, bucket=False)
    want = torch.zeros((H, layout.padded_tokens, layout.padded_tokens), dtype=torch.bool)
    s, rep = 0, H // Hkv
    with routing_rule(rule):
        for L, c in zip(lens, caps):
            m = _doc_mask(q[s:s + L], k[s:s + L].repeat_interleave(rep, dim=1), c, B, B, scale)
            p = layout.pos[s:s + L]
            want[:, p.view(-1, 1), p.view(1, -1)] = m
            s += L
    desc = fa4.fa4_descriptors(plan)
    for direction in ("forward", "backward"):
        got = descriptor_mask(desc, direction)
        assert torch.equal(got[:, layout.pos], want[:, layout.pos]), direction


def test_tau_one_with_room_for_every_block_is_dense():
    case = ([900, 300], 4, 2, 16, 32, 10 ** 6, 1.0, 0)
    out, dens = _run("cpu", case)
    dense, _ = _run("reference", case[:5] + (10 ** 6, 1.0, 0), threshold=False)
    assert dens == 1.0
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_lower_tau_keeps_fewer_blocks_and_topk_routing_is_unchanged():
    case = CASES["ragged-gqa-tau0.8"]
    dens = [_run("cpu", case[:6] + (tau, 0))[1] for tau in (0.3, 0.6, 0.9, 0.99)]
    assert dens == sorted(dens) and dens[0] < dens[-1]
    # the rule is scoped: after threshold calls, a top-k call routes as it always did
    topk_out, topk_dens = _run("cpu", case, threshold=False)
    ref_out, ref_dens = _run("reference", case, threshold=False)
    assert topk_dens == ref_dens
    torch.testing.assert_close(topk_out, ref_out, rtol=1e-5, atol=1e-5)


def test_equal_lengths_different_content_different_density():
    """Two 1,024-token documents: in one every query points at one early key block (its
    gate softmax is peaked), in the other gates are random (flat). Threshold routing keeps
    far fewer blocks for the first; top-k routing keeps the same number for both."""
    L, H, D, B = 1024, 2, 32, 32
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2 * L, H, D, generator=g) * 0.1
    q = torch.randn(2 * L, H, D, generator=g) * 0.1
    k[3 * B:4 * B] += 3.0  # block 3 of document 0 stands out ...
    q[:L] += 3.0  # ... and every query of document 0 looks for it
    cu = torch.tensor([0, L, 2 * L], dtype=torch.int32)
    dens = {}
    for name, kw in (("threshold", dict(threshold=0.9)), ("topk", {})):
        plan_d = []
        for d in range(2):
            sl = slice(d * L, (d + 1) * L)
            _, dd = sparse_attention(q[sl], k[sl], k[sl], cu[:2], topk=16, block_size=B, backend="cpu",
                                     return_density=True, **kw)
            plan_d.append(dd)
        dens[name] = plan_d
    assert dens["topk"][0] == dens["topk"][1]
    assert dens["threshold"][0] < 0.5 * dens["threshold"][1]


@pytest.mark.parametrize("tau, kmin, said", [(0.0, 0, "threshold must be in"), (1.5, 0, "threshold must be in"),
                                             (0.5, -1, "topk_min must be an int")])
def test_bad_rule_is_one_line(tau, kmin, said):
    with pytest.raises(ValueError, match=said) as exc:
        _run("cpu", ([100], 2, 2, 16, 32, 2, tau, kmin))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("threshold", [None, 0.7])
def test_per_document_kept_pairs_add_up_and_match_each_document_alone(threshold):
    """``return_doc_kept``: the kept pairs of each document of a packed batch equal what the
    document alone keeps (routing never crosses documents), and they add up to the total."""
    lens, H, Hkv, D, B = [700, 1, 300, 129, 1100], 4, 2, 32, 32
    q, k, v, cu, _ = make_inputs(lens, H, Hkv, D)
    out, dens, doc_kept = sparse_attention(q, k, v, cu, topk=6, block_size=B, backend="cpu", return_density=True,
                                           return_doc_kept=True, threshold=threshold, topk_min=1)
    causal = sum(L * (L + 1) // 2 for L in lens) * H
    assert doc_kept.shape == (len(lens),) and int(doc_kept.sum()) == round(dens * causal)
    s = 0
    for L, got in zip(lens, doc_kept):
        one = torch.tensor([0, L], dtype=torch.int32)
        _, d1 = sparse_attention(q[s:s + L], k[s:s + L], v[s:s + L], one, topk=6, block_size=B, backend="cpu",
                                 return_density=True, threshold=threshold, topk_min=1)
        assert got == round(d1 * (L * (L + 1) // 2) * H)
        s += L
    _, _, none = sparse_attention(q, k, v, cu, topk=6, block_size=B, backend="reference", return_density=True,
                                  return_doc_kept=True)
    assert none is None  # the reference routes on its own: no plan to read


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
def test_a_cap_past_a_short_documents_blocks_keeps_them_all_at_most(per_head):
    """A short document whose cap exceeds its candidates, batched with a longer routed
    document of a small cap (the torch route once sized the short one's rows by its cap
    and failed): every row is laid out right and keeps at most its candidates."""
    lens, H, D, B = [400, 130], 2, 8, 16
    q, k, _, cu, _ = structured_inputs(lens, H, 1, D, B)
    with routing_rule(RoutingRule(0.5, 2, per_head=per_head)):
        plan = build_plan(q, k, cu, torch.tensor([0, 20]), B, D ** -0.5)
    plan_rows_checked(plan)
    i = torch.cat([torch.arange(-(-L // B)) for L in lens])
    caps = torch.tensor([0] * 25 + [20] * 9)
    assert bool((plan.kv_cnt <= torch.minimum(i + 1, caps + 2)).all())
    assert plan.kept_pairs == int(plan.head_kept.sum()) == int(plan.doc_kept.sum())
