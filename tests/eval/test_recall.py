"""Attention recall (sparsebalance.eval.recall) against a brute-force computation:
full dense causal probabilities per document times the keep mask of the
independent routing oracle (sparsebalance.ops.reference)."""

from __future__ import annotations

import math

import pytest
import torch

from sparsebalance.eval.recall import Recall, block_topk_recall, pool
from sparsebalance.ops.plan import _per_doc_topk
from sparsebalance.ops.reference import _doc_mask


def brute_force(q, k, cu, topk, B, scale):
    """float64 ``[H]`` mean kept mass per head, from ``[H, L, L]`` dense probabilities."""
    H = q.shape[1]
    rep = H // k.shape[1]
    bounds = cu.tolist()
    kd = _per_doc_topk(topk, len(bounds) - 1)
    total = torch.zeros(H, dtype=torch.float64)
    for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        if e <= s:
            continue
        qd, kx = q[s:e].double(), k[s:e].repeat_interleave(rep, dim=1).double()
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        p = torch.softmax((torch.einsum("qhd,khd->hqk", qd, kx) * scale).masked_fill(~causal, -math.inf), -1)
        mask = _doc_mask(q[s:e], k[s:e].repeat_interleave(rep, dim=1), int(kd[d]), B, B, scale)
        total += (p * mask).sum((1, 2))
    return total / q.shape[0]


def case(lens, H=4, hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, hkv, D, generator=g) * 1.5  # peaky logits: recall well below 1
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return q, k, cu


@pytest.mark.parametrize("lens,hkv,topk,B", [
    ((100, 37, 160), 2, 2, 8),  # ragged, GQA, partial last blocks
    ((64, 1, 90), 4, 1, 16),  # a one-token document, MHA
    ((200,), 1, 3, 8),  # multi-query attention
    ((50, 130, 77), 2, torch.tensor([0, 3, 1]), 8),  # per-document budgets
    ((120, 40), 2, 0, 8),  # topk 0: sink + diagonal only
])
def test_recall_equals_brute_force(lens, hkv, topk, B):
    q, k, cu = case(lens, hkv=hkv)
    assert len(lens) > 1 or lens[0] > 4 * B  # several documents, or several routed blocks
    scale = 1 / math.sqrt(q.shape[2])
    got = block_topk_recall(q, k, cu, topk, B, scale)
    want = brute_force(q, k, cu, topk, B, scale)
    assert got.queries == q.shape[0]
    torch.testing.assert_close(got.per_head, want, atol=1e-5, rtol=0)
    assert float(want.min()) < 0.99  # not vacuous: routing really drops mass


def test_topk_at_least_blocks_is_exactly_one():
    q, k, cu = case((100, 37, 64))
    r = block_topk_recall(q, k, cu, 100 // 8 + 1, 8)
    assert torch.equal(r.per_head, torch.ones(4, dtype=torch.float64))
    assert float((block_topk_recall(q, k, cu, None, 8).per_head - 1).abs().max()) == 0.0


def test_topk_zero_keeps_sink_and_diagonal():
    q, k, cu = case((96,), hkv=4)
    r = block_topk_recall(q, k, cu, 0, 8)
    # the first two blocks' queries see only sink + diagonal: their recall is 1
    r2 = block_topk_recall(q[:16], k[:16], torch.tensor([0, 16]), 0, 8)
    assert float((r2.per_head - 1).abs().max()) < 1e-6
    assert bool((r.per_head > 0).all()) and bool((r.per_head < 1).all())


def test_recall_is_monotone_in_topk():
    q, k, cu = case((160, 90), hkv=1, seed=3)
    vals = [block_topk_recall(q, k, cu, t, 8).per_head for t in range(0, 20)]
    for lo, hi in zip(vals, vals[1:]):
        assert bool((hi >= lo - 1e-9).all())
    assert float(vals[-1].min()) == 1.0 and float(vals[0].max()) < 0.99


def test_pool_weights_by_queries():
    a = Recall(torch.tensor([1.0, 2.0], dtype=torch.float64), 2)
    b = Recall(torch.tensor([3.0, 3.0], dtype=torch.float64), 6)
    torch.testing.assert_close(pool([a, b]).per_head, torch.tensor([0.5, 0.625], dtype=torch.float64))


def test_bad_inputs():
    q, k, cu = case((20,))
    with pytest.raises(ValueError, match="multiple"):
        block_topk_recall(q, torch.randn(20, 3, 16), cu, 1, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        block_topk_recall(q, k, torch.tensor([0, 10]), 1, 8)
    with pytest.raises(ValueError, match="topk"):
        block_topk_recall(q, k, cu, -1, 8)


# --- tools/attention_recall.py end to end on a 1-step pretrain_gpt.py checkpoint ---------

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "256", "--seed", "7", "--split", "80,20,0"]


def test_attention_recall_tool_end_to_end(tmp_path):
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=repo, env=env, capture_output=True, text=True,
                                    timeout=120)
    data, ckpt = str(tmp_path / "c"), str(tmp_path / "ckpt")
    p = run("tools/make_corpus.py", "--output-prefix", data, "--num-docs", "80", "--max-length", "384",
            "--quantile", "0.99")
    assert p.returncode == 0, p.stderr
    p = run("pretrain_gpt.py", *MODEL, "--global-batch-size", "2", "--lr", "1e-3", "--no-progress-bar",
            "--data-path", data, "--train-iters", "1", "--save", ckpt)
    assert p.returncode == 0, p.stderr[-2000:]
    # stage 0 (layer 1) at top-k 0, stage 1 (layer 2) at 3; "same" repeats the static budget
    (tmp_path / "dst.json").write_text(json.dumps({"budget": [[[0, 3], [0, 3]]]}))
    (tmp_path / "same.json").write_text(json.dumps({"budget": [[[1, 1]]]}))
    png = tmp_path / "recall.png"
    p = run("tools/attention_recall.py", "--load", ckpt, "--data-path", data, "--train-args", " ".join(MODEL),
            "--sb-block-size", "16", "--sb-topk", "1", "--num-microbatches", "2",
            "--budgets", f"dst={tmp_path / 'dst.json'}", "--budgets", f"same={tmp_path / 'same.json'}",
            "--json", "--plot", str(png))
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    arms = rep["arms"]
    assert set(arms) == {"static", "dense", "dst", "same"}
    assert rep["config"]["documents"] > rep["config"]["microbatches"]  # packed: several documents each
    for a in arms.values():
        assert len(a["per_layer"]) == 2 and all(len(h) == 4 for h in a["per_layer_head"])
    assert arms["dense"]["per_layer_head"] == [[1.0] * 4] * 2 and arms["dense"]["density"] == 1.0
    assert 0 < arms["static"]["mean"] < 1 and arms["static"]["density"] < 1  # routing really drops keys
    assert arms["same"] == arms["static"]
    assert arms["dst"]["per_layer"][0] < arms["static"]["per_layer"][0]
    assert arms["dst"]["per_layer"][1] > arms["static"]["per_layer"][1]
    assert png.stat().st_size > 0
