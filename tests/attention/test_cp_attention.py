"""Context parallelism: the head/tail token split and attention over gathered K/V.

Pure split invariants run in-process; the attention equivalence (CP=2 outputs and
dq/dk/dv equal CP=1, dense and sparse on the cpu and reference backends, with
routing blocks straddling the ranks' chunks) runs two gloo ranks under torchrun.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sparsebalance.attention.context_parallel import build_layout, local_causal_work
from sparsebalance.cp_split import local_token_index, padded_lengths
from sparsebalance.ops.plan import RoutingRule, build_plan, restrict_plan, routing_rule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "attention", "_cp_worker.py")
LENGTH_FILES = [os.path.join(ROOT, "data", "lengths", f) for f in ("prolong.json", "wlb_reconstruction.json")]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_every_padded_token_on_exactly_one_rank_head_tail_chunks(cp):
    P = padded_lengths([5, 300, 1, 64], cp)
    assert np.all(P % (2 * cp) == 0) and np.all(P - [5, 300, 1, 64] < 2 * cp)
    idx = [local_token_index(P, cp, r) for r in range(cp)]
    assert all(len(i) == P.sum() // cp for i in idx)  # every rank holds the same token count
    assert np.array_equal(np.sort(np.concatenate(idx)), np.arange(P.sum()))
    # rank r: chunk r then chunk 2cp-1-r of document 1 (after document 0's share)
    S, s0 = P[1] // (2 * cp), P[0]
    for r in range(cp):
        doc1 = idx[r][P[0] // cp:P[0] // cp + 2 * S]
        want = np.concatenate([s0 + r * S + np.arange(S), s0 + (2 * cp - 1 - r) * S + np.arange(S)])
        assert np.array_equal(doc1, want)


def test_layout_gather_index_reassembles_documents():
    lengths, cp = [100, 37, 250, 6, 1], 2
    P = padded_lengths(lengths, cp)
    lays = [build_layout(lengths, P, cp, r) for r in range(cp)]
    # tag each local row with its compact position (-1: padding), "all-gather", take gather_idx
    tags = []
    for lay in lays:
        t = np.full(lay.t_local, -1)
        t[lay.local_rows.numpy()] = lay.local_pos.numpy()
        tags.append(t)
    full = np.concatenate(tags)
    assert np.array_equal(full[lays[0].gather_idx.numpy()], np.arange(sum(lengths)))
    assert np.array_equal(lays[0].gather_idx, lays[1].gather_idx)
    pos = np.concatenate([lay.local_pos.numpy() for lay in lays])
    assert np.array_equal(np.sort(pos), np.arange(sum(lengths)))
    total = sum(L * (L + 1) // 2 for L in lengths)
    assert sum(lay.causal_pairs for lay in lays) == total


def _microbatches(lengths, tokens, n):
    """The first ``n`` micro-batches of whole documents (<= ``tokens`` each), in order."""
    out, cur = [], []
    for L in lengths:
        L = min(int(L), tokens)
        if sum(cur) + L > tokens:
            out.append(cur)
            cur = []
            if len(out) == n:
                break
        cur.append(L)
    return out


@pytest.mark.parametrize("path", LENGTH_FILES)
def test_16k_microbatches_split_half_the_tokens_and_equal_causal_work(path):
    mbs = _microbatches(json.load(open(path)), 16384, 40)
    assert len(mbs) == 40 and np.mean([len(m) for m in mbs]) > 2  # several documents each
    worst = 0.0
    for mb in mbs:
        w = local_causal_work(mb, 2)
        # padded tokens are split exactly in half; real tokens within 3 per document
        assert abs(int(w[0, 1]) - int(w[1, 1])) <= 3 * len(mb)
        worst = max(worst, abs(w[0, 0] - w[1, 0]) / w[:, 0].mean())
    assert worst <= 0.05, worst


@pytest.mark.parametrize("rule", [None, RoutingRule(0.6, per_head=True), RoutingRule(0.6, per_head=False)],
                         ids=["topk", "threshold-per-head", "threshold-per-block"])
def test_restricted_plan_counts_only_its_tokens_and_keeps_diagonals(rule):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 100, 137, 387], dtype=torch.int32)
    q, k = torch.randn(387, 2, 8, generator=g), torch.randn(387, 2, 8, generator=g)
    q[:, 0] *= 8  # head 0's gates peaked, head 1's flat: per-head counts differ
    with routing_rule(rule):
        plan = build_plan(q, k, cu, 4, 16, 0.35)
    if rule is not None and rule.per_head:
        assert bool((plan.kv_cnt[0] != plan.kv_cnt[1]).any())
    mine = torch.cat([torch.arange(0, 25), torch.arange(75, 100), torch.arange(137, 200)])
    sub = restrict_plan(plan, mine, causal_pairs=1)
    qs = plan.qb_start.long()
    blk = torch.searchsorted(qs, mine, right=True) - 1
    want = [sum(((int(plan.kv_cnt[h, b]) - 1) * 16 + int(t - qs[b]) + 1) for t, b in zip(mine, blk))
            for h in range(2)]
    assert sub.kept_pairs == sum(want) and list(sub.head_kept) == want and sub.causal_pairs == 1
    active = torch.zeros(len(qs), dtype=torch.bool)
    active[blk] = True
    assert torch.equal(sub.kv_idx[:, active], plan.kv_idx[:, active])
    idle = (~active).nonzero().flatten()
    assert len(idle) > 3 and torch.all(sub.kv_cnt[:, idle] == 1)
    assert torch.equal(sub.kv_cnt[:, active], plan.kv_cnt[:, active])
    assert torch.equal(sub.kv_idx[:, idle, 0], idle.int().expand(2, -1))
    assert sub.kv_nnz == int(sub.kv_cnt.sum(1).max())


@pytest.fixture(scope="module")
def triton_snippet():
    """:data:`_TRITON_SNIPPET` in the Triton interpreter, started in the background (None
    without triton or the cpu extension, where its test skips): requested by
    :func:`cp_dump` so that it runs alongside the torchrun launch; its test waits for it."""
    import importlib.util

    from sparsebalance.ops.backends import HAS_CPU_EXT

    if importlib.util.find_spec("triton") is None or not HAS_CPU_EXT:
        yield None
        return
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _TRITON_SNIPPET], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def cp_dump(triton_snippet, tmp_path_factory, world):
    dump = str(tmp_path_factory.mktemp("cp_attention"))
    proc = world.launch(WORKER, [], nproc=2, timeout=180, extra_env={"SB_TEST_DUMP": dump})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [dict(np.load(os.path.join(dump, f"rank{r}.npz"))) for r in range(2)]
    return ranks, dict(np.load(os.path.join(dump, "ref.npz"))), dict(np.load(os.path.join(dump, "padonly.npz")))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name", ["dense", "cpu", "reference"])
def test_cp2_attention_equals_cp1(cp_dump, name):
    ranks, ref, _ = cp_dump
    for key in ("out", "dq", "dk", "dv"):
        got = np.zeros_like(ref[f"{name}/{key}"])
        seen = np.zeros(len(got), dtype=int)
        for r in ranks:
            got[r[f"{name}/pos"]] = r[f"{name}/{key}"]
            seen[r[f"{name}/pos"]] += 1
        assert np.all(seen == 1)  # every real token's row came from exactly one rank
        assert _rel(got, ref[f"{name}/{key}"]) < 1e-5, (name, key)
    for r in ranks:
        assert float(r[f"{name}/pad_grad"]) == 0.0
    if name != "dense":  # the ranks' kept pairs add up to the CP=1 count: same routing
        kept = sum(int(r[f"{name}/kept"]) for r in ranks)
        assert kept == int(ref[f"{name}/kept"])
        lens = np.array([100, 37, 250, 6, 1])
        assert kept < int((lens * (lens + 1) // 2).sum()) * 4  # sparse for real


@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_rank_holding_only_padding_takes_part_in_backward(cp_dump, name):
    """A micro-batch whose CP share on rank 1 is padding only (one 1-token document, what
    --mock-data used to feed every other step): both ranks finish forward and backward
    (rank 1 still enters the K/V gather's backward collective; before, the ranks
    deadlocked), and rank 0's one real query attends to itself: output = its value
    (each of the H / Hkv query heads of a group adds its output gradient to dv)."""
    z = cp_dump[2]
    out, v, dv = z[f"{name}/out"], z[f"{name}/v"], z[f"{name}/dv"]
    group = out.shape[0] // v.shape[0]
    assert np.allclose(out, np.repeat(v, group, axis=0), atol=1e-6)
    assert np.allclose(dv, group, atol=1e-6)


_TRITON_SNIPPET = """
import torch
from sparsebalance.ops.cpu import cpu_sparse_attention
from sparsebalance.ops.plan import build_plan, restrict_plan
from sparsebalance.ops.triton_backend import triton_sparse_attention
g = torch.Generator().manual_seed(1)
cu = torch.tensor([0, 90, 130], dtype=torch.int32)
q, k, v = (torch.randn(130, 2, 16, generator=g) for _ in range(3))
mine = torch.cat([torch.arange(0, 23), torch.arange(68, 90), torch.arange(100, 110)])
q = torch.zeros_like(q).index_copy(0, mine, q[mine])  # other ranks' rows are zeros here
plan = restrict_plan(build_plan(q, k, cu, 1, 16, 0.25), mine, 1)
w = torch.randn(len(mine), 2, 16, generator=g)
res = []
for f in (cpu_sparse_attention, triton_sparse_attention):
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o = f(qq, kk, vv, plan, 0.25)[mine]
    (o * w).sum().backward()
    res.append([o, qq.grad[mine], kk.grad, vv.grad])
for a, b in zip(*res):
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
print("OK")
"""


def test_triton_kernel_runs_a_restricted_plan(triton_snippet):
    """The GPU kernel takes the CP rank's restricted plan unchanged (Triton interpreter)."""
    pytest.importorskip("triton")
    from sparsebalance.ops.backends import HAS_CPU_EXT

    if not HAS_CPU_EXT:
        pytest.skip("needs the cpu extension as the comparison")
    stdout, stderr = triton_snippet.communicate(timeout=300)
    assert triton_snippet.returncode == 0 and "OK" in stdout, stderr[-3000:]
