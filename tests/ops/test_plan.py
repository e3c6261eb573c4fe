"""Routing plan invariants: sink and diagonal kept, counts monotone and exact, determinism."""

import numpy as np
import pytest
import torch
from _cases import make_inputs

import sparsebalance.ops.plan as plan_mod
from sparsebalance.ops.kept import KeptPairs
from sparsebalance.ops.plan import (
    RoutingRule,
    _select_rows,
    build_plan,
    per_doc_topk,
    reverse_index,
    routing_rule,
    select_topk,
)
from sparsebalance.ops.reference import _doc_mask
from sparsebalance.pairs import kept_pairs

LENS = [1, 63, 64, 65, 300, 1000, 17]


def doc_block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 mean over each block of one document ``x [L, heads, D]`` -> ``[ceil(L/B), heads, D]``
    (the per-document reference's block means)."""
    L = x.shape[0]
    nfull = L // block_size
    x = x.float()
    parts = [x[: nfull * block_size].view(nfull, block_size, *x.shape[1:]).mean(1)]
    if L > nfull * block_size:
        parts.append(x[nfull * block_size:].mean(0, keepdim=True))
    return torch.cat(parts, 0)


def _plan(topk, B=32, H=3, Hkv=1, seed=0, lens=LENS):
    q, k, _, cu, _ = make_inputs(lens, H, Hkv, 16, seed=seed)
    return build_plan(q, k, cu, topk, B, 0.25), q, k, cu


def _rows(plan):
    """Per (head, block): list of kept key block ids."""
    H, NB, _ = plan.kv_idx.shape
    cnt = plan.kv_cnt.tolist()
    return [[plan.kv_idx[h, b, : cnt[h][b]].tolist() for b in range(NB)] for h in range(H)]


@pytest.mark.parametrize("topk", [0, 1, 2, 5, 100])
def test_sink_and_diagonal_always_kept(topk):
    plan, *_ = _plan(topk)
    first = {}  # block id -> id of its document's block 0
    starts = plan.qb_start.tolist()
    cu = np.cumsum([0] + LENS)
    for b, s in enumerate(starts):
        d = int(np.searchsorted(cu, s, side="right")) - 1
        first[b] = next(i for i, x in enumerate(starts) if x == cu[d])
    for rows in _rows(plan):
        for b, row in enumerate(rows):
            assert row[-1] == b, "diagonal must be the last kept block"
            assert row[0] == first[b], "sink (document block 0) must be kept"
            assert row == sorted(set(row)), "kept blocks ascending and unique"
            assert all(first[b] <= j <= b for j in row), "never outside the document or in the future"


def test_kept_pairs_match_closed_form_and_are_monotone():
    prev = None
    for topk in list(range(0, 12)) + [20, 30, 31]:
        plan, *_ = _plan(topk)
        exact = int(kept_pairs(LENS, topk, 32).sum()) * 3
        assert plan.kept_pairs == exact
        assert plan.kept_pairs == sum(
            (len(r) - 1) * 32 * int(plan.qb_len[b]) + int(plan.qb_len[b]) * (int(plan.qb_len[b]) + 1) // 2
            for rows in _rows(plan) for b, r in enumerate(rows)), "counted from the tables"
        if prev is not None:
            assert plan.kept_pairs >= prev
        prev = plan.kept_pairs
    assert prev == plan.causal_pairs  # large topk: dense
    assert _plan(0)[0].kept_pairs < prev


def test_plan_kept_sets_nest_as_topk_grows():
    a, b = _plan(2)[0], _plan(3)[0]
    for ra, rb in zip(_rows(a), _rows(b)):
        for x, y in zip(ra, rb):
            assert set(x) <= set(y)


def test_per_document_topk_tensor():
    topk = torch.tensor([0, 1, 2, 3, 1, 0, 4])
    plan, *_ = _plan(topk)
    exact = sum(int(kept_pairs([L], int(t), 32)[0]) for L, t in zip(LENS, topk.tolist())) * 3
    assert plan.kept_pairs == exact
    assert plan.density < 1.0


def test_plan_is_deterministic_and_matches_reference_routing():
    plan, q, k, cu = _plan(2, seed=7)
    again, *_ = _plan(2, seed=7)
    assert torch.equal(plan.kv_idx, again.kv_idx)
    # The reference routes on its own: rebuild its token mask from the plan and compare.
    rows = _rows(plan)
    starts, lens_b = plan.qb_start.tolist(), plan.qb_len.tolist()
    bounds = cu.tolist()
    n_checked = 0
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e - s <= 4 * 32:
            continue
        kx = k[s:e].repeat_interleave(3, dim=1)
        ref = _doc_mask(q[s:e], kx, 2, 32, 32, 0.25)
        mine = torch.zeros_like(ref)
        for h in range(3):
            for b, st in enumerate(starts):
                if not s <= st < e:
                    continue
                for j in rows[h][b]:
                    mine[h, st - s: st - s + lens_b[b], starts[j] - s: starts[j] - s + lens_b[j]] = True
        mine &= torch.ones(e - s, e - s, dtype=torch.bool).tril()
        assert torch.equal(mine, ref)
        n_checked += 1
    assert n_checked >= 2


def test_select_topk_breaks_ties_by_lower_index():
    g = torch.tensor([[1.0, 5.0, 5.0, 5.0, 0.0, float("-inf")],
                      [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                      [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    assert select_topk(g, 2).tolist() == [[1, 2], [0, 1], [4, 5]]
    assert select_topk(g, 0).shape == (3, 0)


def test_equal_gates_pick_lowest_blocks():
    # all-zero q/k: every gate ties; the lowest candidate blocks 1..topk are kept
    q = torch.zeros(10 * 16, 2, 8)
    plan = build_plan(q, q, torch.tensor([0, 160], dtype=torch.int32), 2, 16, 1.0)
    assert plan.kv_idx[:, 9, :4].tolist() == [[0, 1, 2, 9]] * 2


@pytest.mark.parametrize("rule", [None, RoutingRule(0.7, per_head=True), RoutingRule(0.7, per_head=False)],
                         ids=["topk", "threshold-per-head", "threshold-per-block"])
def test_reverse_index_inverts_the_plan(rule):
    q, k, _, cu, _ = make_inputs(LENS, 3, 1, 16)
    q = q * torch.tensor([6.0, 1.0, 0.2]).view(1, 3, 1)  # heads from peaked to flat
    with routing_rule(rule):
        plan = build_plan(q, k, cu, 6, 32, 0.25)
    ptr, rq = reverse_index(plan)
    nnz = plan.kv_cnt.sum(1)
    if rule is not None and rule.per_head:
        assert len(set(nnz.tolist())) > 1  # heads keep different numbers of blocks
    assert rq.shape == (3, plan.kv_nnz) and torch.equal(ptr[:, -1], nnz.int())
    plan.kept = KeptPairs(doc=plan.doc_kept, head=plan.head_kept)  # the same tables without the host's count
    assert all(torch.equal(a, b) for a, b in zip((ptr, rq), reverse_index(plan)))
    rows = _rows(plan)
    H, NB = len(rows), len(rows[0])
    for h in range(H):
        inv = {j: [] for j in range(NB)}
        for b, r in enumerate(rows[h]):
            for j in r:
                inv[j].append(b)
        for j in range(NB):
            assert rq[h, ptr[h, j]: ptr[h, j + 1]].tolist() == inv[j]


# --- the batched plan against the straightforward per-document plan it replaced ---------


def _reference_topk(g, k):
    """The per-document selection the plan used to run (topk, then fix ties at the k-th value)."""
    if k == 0:
        return torch.zeros(g.shape[:-1] + (0,), dtype=torch.int64)
    vals, idx = torch.topk(g, k, dim=-1, sorted=False)
    t = vals.amin(-1, keepdim=True)
    eq = g == t
    if bool((eq.sum(-1) == 1).all()):
        return idx.sort(-1).values
    gt = g > t
    need = k - gt.sum(-1, keepdim=True)
    chosen = gt | (eq & (eq.cumsum(-1) <= need))
    n = g.shape[-1]
    cols = torch.arange(n).expand_as(chosen)
    return torch.where(chosen, cols, n).sort(-1).values[..., :k]


def _reference_plan(q, k, cu_seqlens, topk, B, scale):
    """One document at a time on the CPU: the previous implementation, kept as the oracle."""
    H, hkv = q.shape[1], k.shape[1]
    cu = cu_seqlens.to(torch.int64)
    starts, lens = cu[:-1], cu[1:] - cu[:-1]
    n_docs = lens.numel()
    kd = per_doc_topk(topk, n_docs)
    nb = (lens + B - 1) // B
    NB = int(nb.sum())
    doc_of = torch.repeat_interleave(torch.arange(n_docs), nb)
    first_block = torch.cumsum(nb, 0) - nb
    i_in_doc = torch.arange(NB) - first_block[doc_of]
    qb_start = starts[doc_of] + i_in_doc * B
    qb_len = torch.minimum(lens[doc_of] - i_in_doc * B, torch.tensor(B))
    kv_cnt = 1 + (i_in_doc > 0).long() + torch.minimum(kd[doc_of], (i_in_doc - 1).clamp(min=0))
    W = int(kv_cnt.max()) if NB else 1
    e = torch.arange(W)
    dense = first_block[doc_of].view(-1, 1) + e.view(1, -1)
    kv_idx = torch.where(e.view(1, -1) <= i_in_doc.view(-1, 1), dense, torch.tensor(-1))
    kv_idx = kv_idx.unsqueeze(0).expand(H, NB, W).clone()
    rep = H // hkv
    for d in torch.nonzero(nb > kd + 2).flatten().tolist():
        f, n, kk = int(first_block[d]), int(nb[d]), int(kd[d])
        s0, L = int(starts[d]), int(lens[d])
        r0 = kk + 2
        qm = doc_block_means(q[s0:s0 + L], B)[r0:]
        km = doc_block_means(k[s0:s0 + (n - 1) * B], B).repeat_interleave(rep, dim=1)
        g = torch.einsum("ihd,jhd->hij", qm * scale, km)
        i = torch.arange(r0, n).view(-1, 1)
        j = torch.arange(n - 1).view(1, -1)
        chosen = _reference_topk(g.masked_fill_(~((j >= 1) & (j < i)), float("-inf")), kk)
        ids = torch.cat([torch.zeros_like(i).expand(H, n - r0, 1), chosen, i.expand(H, n - r0, 1)], -1)
        kv_idx[:, f + r0:f + n, :kk + 2] = ids + f
        kv_idx[:, f + r0:f + n, kk + 2:] = -1
    full = (kv_cnt - 1) * B * qb_len + qb_len * (qb_len + 1) // 2
    return dict(qb_start=qb_start.int(), qb_len=qb_len.int(), kv_idx=kv_idx.int(),
                kv_cnt=kv_cnt.int().view(1, NB).expand(H, NB),
                kept_pairs=int(full.sum()) * H, causal_pairs=int((lens * (lens + 1) // 2).sum()) * H)


def _random_case(seed):
    """A ragged packing (docs shorter than a block, single tokens, long ones), GQA 4/2 heads,
    int or mixed per-document topk, and q/k of one of four kinds:

    - ``randn``: continuous values (ties improbable);
    - ``zeros``: all-zero q, k half zero: every gate ties at 0;
    - ``patterns``: integer q/k built from three 8-token patterns, B a power of two and the
      partial blocks 1, 2, 4 or 8 tokens, so block means and gates are exact (fp32 rounding
      cannot break a tie) while many blocks repeat: tie-heavy;
    - ``constdoc``: every token of a document alike (block means exact for any B): all gates
      of a row tie.
    """
    rng = np.random.default_rng(seed)
    mode = ["randn", "zeros", "patterns", "constdoc"][seed % 4]
    B = int(rng.choice([16, 64])) if mode == "patterns" else int(rng.choice([16, 48, 64]))
    H, hkv, D = 4, 2, int(rng.choice([16, 32]))
    nd = int(rng.integers(1, 9))
    kinds = [1, 2, int(rng.integers(1, B)), int(rng.integers(B, 12 * B)), int(rng.integers(1, 30 * B))]
    lens = [int(rng.choice(kinds)) for _ in range(nd)]
    if mode == "patterns":
        lens = [max(1, L // B * B + int(rng.choice([0, 0, 1, 2, 4, 8]))) for L in lens]
    topk = (torch.tensor(rng.integers(0, 9, nd)) if rng.random() < 0.5 else int(rng.integers(0, 9)))
    T = sum(lens)
    g = torch.Generator().manual_seed(seed)
    scale = 0.25
    if mode == "randn":
        q, k = torch.randn(T, H, D, generator=g), torch.randn(T, hkv, D, generator=g)
        scale = D ** -0.5
    elif mode == "zeros":
        q, k = torch.zeros(T, H, D), torch.randn(T, hkv, D, generator=g)
        k[::2] = 0
    elif mode == "patterns":
        pq = torch.randint(-1, 2, (3, H, D), generator=g).float()
        pk = torch.randint(-1, 2, (3, hkv, D), generator=g).float()
        which = torch.randint(0, 3, (T // 8 + 1,), generator=g).repeat_interleave(8)[:T]
        q, k = pq[which], pk[which]
    else:
        d_of = torch.repeat_interleave(torch.arange(nd), torch.tensor(lens))
        q = torch.randint(-1, 2, (nd, H, D), generator=g).float()[d_of]
        k = torch.randint(-1, 2, (nd, hkv, D), generator=g).float()[d_of]
    if rng.random() < 0.3:
        q, k = q.bfloat16(), k.bfloat16()
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return q, k, cu, topk, B, scale


def _assert_plan_equals_reference(q, k, cu, topk, B, scale, msg=""):
    plan = build_plan(q, k, cu, topk, B, scale)
    ref = _reference_plan(q, k, cu, topk, B, scale)
    for name in ("qb_start", "qb_len", "kv_idx", "kv_cnt"):
        got = getattr(plan, name)
        assert got.dtype == torch.int32 and got.is_contiguous(), (name, msg)
        assert torch.equal(got, ref[name]), (name, msg)
    assert (plan.kept_pairs, plan.causal_pairs) == (ref["kept_pairs"], ref["causal_pairs"]), msg
    assert plan.kv_nnz == int(plan.kv_cnt.sum(1).max())
    assert list(plan.head_kept) == [plan.kept_pairs // q.shape[1]] * q.shape[1]
    return plan


@pytest.mark.parametrize("group", range(6))
def test_batched_plan_matches_per_document_reference(group):
    for seed in range(group * 40, group * 40 + 40):
        _assert_plan_equals_reference(*_random_case(seed), msg=f"seed {seed}")


def test_batched_plan_matches_reference_when_chunked(monkeypatch):
    # Tiny budgets: documents split over several batches, long ones cut into row ranges,
    # block means taken a few blocks at a time.
    monkeypatch.setattr(plan_mod, "_GATE_BUDGET", 300)
    monkeypatch.setattr(plan_mod, "_CPU_CHUNK", 3000)
    for seed in range(60):
        _assert_plan_equals_reference(*_random_case(seed), msg=f"seed {seed}")


def test_batched_plan_matches_reference_in_one_gpu_style_batch(monkeypatch):
    # On the GPU every document that fits the budget goes into one padded batch.
    chunks = plan_mod._chunks
    monkeypatch.setattr(plan_mod, "_chunks", lambda rows, cols, H, gpu: chunks(rows, cols, H, True))
    for seed in range(0, 120, 3):
        _assert_plan_equals_reference(*_random_case(seed), msg=f"seed {seed}")


def test_chunks_partition_the_items_within_the_budget(monkeypatch):
    monkeypatch.setattr(plan_mod, "_GATE_BUDGET", 5000)
    rng = np.random.default_rng(0)
    cols = rng.integers(1, 300, 50)
    rows = np.minimum(rng.integers(1, 300, 50), cols)
    for gpu in (False, True):
        parts = plan_mod._chunks(rows, cols, 4, gpu)
        assert sorted(np.concatenate(parts).tolist()) == list(range(50))
        for ids in parts:
            padded = len(ids) * 4 * rows[ids].max() * cols[ids].max()
            assert len(ids) == 1 or padded <= 5000


def test_batched_plan_one_long_document_and_non_contiguous_inputs():
    q, k, _, _, _ = make_inputs([3000], 4, 2, 32, seed=3)
    cu = torch.tensor([0, 3000], dtype=torch.int32)
    for B, topk in ((16, 5), (48, 0), (64, 3), (64, torch.tensor([2]))):
        _assert_plan_equals_reference(q, k, cu, topk, B, 0.125)
    # q, k as views into a wider tensor (as from a fused projection)
    qkv = torch.randn(1200, 4 + 2, 32)
    qv, kv = qkv[:, :4], qkv[:, 4:]
    cu = torch.tensor([0, 700, 701, 1200], dtype=torch.int32)
    _assert_plan_equals_reference(qv, kv, cu, torch.tensor([3, 0, 1]), 32, 0.2)


def test_plan_of_an_empty_batch_and_of_documents_without_choice():
    q = torch.randn(0, 2, 8)
    plan = build_plan(q, q, torch.tensor([0], dtype=torch.int32), 2, 16, 1.0)
    assert plan.kv_idx.shape == (2, 0, 1) and plan.density == 1.0
    q = torch.randn(40, 2, 8)
    _assert_plan_equals_reference(q, q, torch.tensor([0, 1, 17, 40], dtype=torch.int32), 1, 16, 1.0)


def test_select_rows_per_row_k_matches_stable_sort():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        vals = torch.randint(-2, 3, (3, 5, 17), generator=g).float()  # many ties
        if trial % 2:
            vals = torch.randn(3, 5, 17, generator=g)
        vals[..., :2] = float("-inf")  # non-candidates
        kmax = 1 + trial % 9
        k = torch.randint(0, kmax + 1, (3, 1, 1), generator=g)
        got = _select_rows(vals, k, kmax)
        assert torch.equal(_select_rows(vals, k, kmax, host_check=False), got)  # the GPU's way
        order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
        for idx in np.ndindex(3, 5):
            kk = int(k[idx[0], 0, 0])
            want = sorted(order[idx][:kk].tolist()) + [-1] * (kmax - kk)
            assert got[idx].tolist() == want
        if int(k.min()) == kmax:
            assert torch.equal(_select_rows(vals, kmax, kmax), got)
            assert torch.equal(_select_rows(vals, kmax, kmax, host_check=False), got)
            assert torch.equal(select_topk(vals, kmax), got)


def test_reverse_index_without_the_hosts_count():
    plan, *_ = _plan(2)
    assert plan.kv_nnz is not None and plan.to(torch.device("cpu")).kv_nnz == plan.kv_nnz
    plan.kept = KeptPairs(doc=plan.doc_kept, head=plan.head_kept)  # no count of the valid entries
    slow = reverse_index(plan)
    plan.kept = KeptPairs(doc=plan.doc_kept, head=plan.head_kept, nnz=int(plan.kv_cnt.sum(1).max()))
    assert all(torch.equal(a, b) for a, b in zip(slow, reverse_index(plan)))
