"""Attention recall (benchmarks.harness.longctx.recall) against a brute-force computation:
full dense causal probabilities per document times the keep mask of the
independent routing oracle (sparsebalance.ops.reference)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from benchmarks.harness.longctx.recall import Recall, block_topk_recall, pool
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS
from sparsebalance.ops.plan import per_doc_topk
from sparsebalance.ops.reference import _doc_mask


def brute_force(q, k, cu, topk, B, scale):
    """float64 ``[H]`` mean kept mass per head, from ``[H, L, L]`` dense probabilities."""
    H = q.shape[1]
    rep = H // k.shape[1]
    bounds = cu.tolist()
    kd = per_doc_topk(topk, len(bounds) - 1)
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


# --- benchmarks/attention_recall.py end to end on a 1-step pretrain_gpt.py checkpoint ---------

MODEL = [*PROJECT_RUN_FLAGS, "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "4",
         "--seq-length", "256", "--seed", "7", "--split", "80,20,0"]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
REAL = {"arms": {"megatron": {"step_ms": 1000.0, "tokens_per_s": 50.0},
                 "sab": {"step_ms": 1100.0, "tokens_per_s": 40.0}, "dst": {"step_ms": 990.0, "tokens_per_s": 52.0},
                 "dense": {"step_ms": 2000.0, "tokens_per_s": 25.0}, "wlb": {"step_ms": 1200.0}}}



def _run(*args):
    """``python args`` from the repository root, single-process (no torchrun variables)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_attention_recall_tool_end_to_end(tmp_path, world):
    """The corpus, the one-step training and the tool run in the session's warm world
    (tests/_world.py): what is checked is what they write and report, not a process."""

    def _run(script, *args):
        return world.launch(os.path.join(REPO, script), args, timeout=120)

    data, ckpt = str(tmp_path / "c"), str(tmp_path / "ckpt")
    p = _run("tools/make_corpus.py", "--output-prefix", data, "--num-docs", "80", "--max-length", "384",
             "--quantile", "0.99")
    assert p.returncode == 0, p.stderr
    p = _run("pretrain_gpt.py", *MODEL, "--global-batch-size", "2", "--lr", "1e-3", "--no-progress-bar",
             "--data-path", data, "--train-iters", "1", "--save", ckpt)
    assert p.returncode == 0, p.stderr[-2000:]
    # stage 0 (layer 1) at top-k 0, stage 1 (layer 2) at 3; "same" repeats the static budget
    dst, same = {"budget": [[[0, 3], [0, 3]]]}, {"budget": [[[1, 1]]]}
    (tmp_path / "dst.json").write_text(json.dumps(dst))
    (tmp_path / "same.json").write_text(json.dumps(same))
    (tmp_path / "avg").mkdir()
    (tmp_path / "avg" / "step_1.json").write_text(json.dumps(dst))
    (tmp_path / "avg" / "step_2.json").write_text(json.dumps(same))
    (tmp_path / "real.json").write_text(json.dumps(REAL))
    png = tmp_path / "recall.png"
    p = _run("benchmarks/attention_recall.py", "--load", ckpt, "--data-path", data, "--train-args", " ".join(MODEL),
             "--sb-block-size", "16", "--sb-topk", "1", "--num-microbatches", "2",
             "--budgets", f"dst={tmp_path / 'dst.json'}", "--budgets", f"same={tmp_path / 'same.json'}",
             "--budgets", f"avg={tmp_path / 'avg' / 'step_*.json'}",
             "--budgets", f"avg2={tmp_path / 'dst.json'},{tmp_path / 'same.json'}",
             "--step-times", str(tmp_path / "real.json"), "--json", "--plot", str(png))
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    arms = rep["arms"]
    assert set(arms) == {"static", "dense", "dst", "same", "avg", "avg2"}
    assert rep["config"]["documents"] > rep["config"]["microbatches"]  # packed: several documents each
    for a in arms.values():
        assert len(a["per_layer"]) == 2 and all(len(h) == 4 for h in a["per_layer_head"])
        assert a["queries"] == arms["static"]["queries"]  # every held-out query once, however many tables
    assert arms["dense"]["per_layer_head"] == [[1.0] * 4] * 2 and arms["dense"]["density"] == 1.0
    assert 0 < arms["static"]["mean"] < 1 and arms["static"]["density"] < 1  # routing really drops keys
    assert {k: v for k, v in arms["same"].items() if k != "vs_static"} == arms["static"]
    assert arms["dst"]["per_layer"][0] < arms["static"]["per_layer"][0]
    assert arms["dst"]["per_layer"][1] > arms["static"]["per_layer"][1]
    # several tables: the mean over them (the glob and the comma list name the same two)
    assert arms["avg"] == arms["avg2"]
    assert rep["config"]["budgets"]["avg"] == [str(tmp_path / "avg" / f"step_{i}.json") for i in (1, 2)]
    heads = lambda name: torch.tensor(arms[name]["per_layer_head"], dtype=torch.float64)
    torch.testing.assert_close(heads("avg"), (heads("dst") + heads("same")) / 2, atol=1e-12, rtol=0)
    # frontier: static at megatron's step time, sab at its own with static's recall
    front = {f["arm"]: f for f in rep["frontier"]}
    assert set(front) == {"static", "sab", "dst", "dense"}
    assert front["static"]["step_ms"] == 1000.0 and front["static"]["compare_arm"] == "megatron"
    assert front["static"]["ms_per_1k_tokens"] == 1e6 / 50.0
    assert front["sab"]["recall_per_layer"] == arms["static"]["per_layer"] and front["sab"]["step_ms"] == 1100.0
    assert front["dst"]["recall_mean"] == arms["dst"]["mean"]
    assert "static" in front["sab"]["dominated_by"]
    assert png.stat().st_size > 0 and (tmp_path / "recall_frontier.png").stat().st_size > 0
    # paired differences to static: none for static itself, exactly 0 for its twin
    assert "vs_static" not in arms["static"]
    for name in ("dense", "dst", "same", "avg", "avg2"):
        vs = arms[name]["vs_static"]
        for layer, cell in enumerate(vs["per_layer"]):
            assert cell["diff"] == pytest.approx(arms[name]["per_layer"][layer] - arms["static"]["per_layer"][layer])
            assert cell["ci95"][0] <= cell["diff"] + 1e-12 and cell["diff"] - 1e-12 <= cell["ci95"][1]
        assert vs["mean"]["diff"] == pytest.approx(arms[name]["mean"] - arms["static"]["mean"])
        assert vs["microbatches"] == 2
    assert arms["same"]["vs_static"]["mean"] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    assert arms["dst"]["vs_static"]["per_layer"][0]["ci95"][1] < 0  # top-k 0 loses on both micro-batches


# --- the frontier on a tiny case (no model) --------------------------------------------


def _tool():
    spec = importlib.util.spec_from_file_location("attention_recall", os.path.join(REPO, "benchmarks",
                                                                                   "attention_recall.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_frontier_tiny_case():
    tool = _tool()

    def arm(*per_layer):
        return {"mean": sum(per_layer) / len(per_layer), "per_layer": list(per_layer)}

    arms = {"static": arm(0.8, 1.0), "dense": arm(1.0, 1.0), "sparsebalance": arm(0.9, 0.96),
            "sparsebalance-anchor": arm(0.78, 0.98), "dst": arm(0.95, 0.95), "mine": arm(0.5, 0.5)}
    # speed is per token: sparsebalance's step is longer than static's but it trains more tokens
    sp = lambda ms, tps: {"step_ms": ms, "tokens_per_s": tps, "ms_per_1k_tokens": 1e6 / tps}
    steps = {"megatron": sp(1000.0, 8.0), "sab": sp(1100.0, 7.9), "sparsebalance": sp(1050.0, 10.0),
             "sparsebalance-anchor": sp(1040.0, 7.5), "dense": sp(2000.0, 4.0)}  # no "dst": no point
    pts = tool.frontier(arms, steps)
    assert [p["arm"] for p in pts] == ["sparsebalance", "static", "sab", "sparsebalance-anchor", "dense"]
    by = {p["arm"]: p for p in pts}
    assert by["static"]["compare_arm"] == "megatron" and by["sab"]["compare_arm"] == "sab"
    assert by["sab"]["recall_mean"] == arms["static"]["mean"] and by["sab"]["recall_per_layer"] == [0.8, 1.0]
    assert by["sparsebalance"]["recall_per_layer"] == [0.9, 0.96] and by["sparsebalance"]["tokens_per_s"] == 10.0
    # static: slower per token than sparsebalance with less recall; anchor and sab: slower still
    assert by["static"]["dominated_by"] == ["sparsebalance"]
    assert by["sparsebalance-anchor"]["dominated_by"] == ["static", "sparsebalance", "sab"]
    assert by["sab"]["dominated_by"] == ["static", "sparsebalance"]
    assert all(not by[a]["dominated_by"] for a in ("sparsebalance", "dense"))
    # equal points do not dominate each other; arms without a step time or a mapping drop out
    twins = tool.frontier({"static": arm(0.9, 0.9)}, {"megatron": sp(5.0, 2.0), "sab": sp(6.0, 2.0)})
    assert [p["dominated_by"] for p in twins] == [[], []]
    assert tool.frontier({"mine": arm(0.5, 0.5)}, steps) == []
    # a budget arm named like a compare arm is placed at that arm's speed
    eps = tool.frontier({"critical-path-eps0.05": arm(0.85, 0.96)}, {"critical-path-eps0.05": sp(990.0, 9.0)})
    assert [(p["arm"], p["compare_arm"], p["tokens_per_s"]) for p in eps] == [
        ("critical-path-eps0.05", "critical-path-eps0.05", 9.0)]
    assert tool.frontier_path("out/recall.png") == "out/recall_frontier.png"


def test_paired_vs_static_tiny_case():
    """Differences pool micro-batches by queries; the interval is paired over micro-batches."""
    from benchmarks.harness.longctx.recall import Recall

    tool = _tool()

    def mbs(*per_mb):  # one layer, 2 heads: (recall, queries) per micro-batch
        return {1: [Recall(torch.tensor([r * q, r * q], dtype=torch.float64), q) for r, q in per_mb]}

    static = mbs((0.5, 10), (0.9, 30), (0.7, 20), (0.6, 40))
    per_arm = {"static": static,
               "up": mbs((0.6, 10), (0.95, 30), (0.75, 20), (0.7, 40)),  # higher on every micro-batch
               "mixed": mbs((0.8, 10), (0.8, 30), (0.7, 20), (0.6, 40)),  # +0.3 on one, -0.1 on another
               "twin": mbs((0.5, 10), (0.9, 30), (0.7, 20), (0.6, 40))}
    out = tool.paired_vs_static(per_arm, resamples=500, seed=1)
    assert set(out) == {"up", "mixed", "twin"}
    pooled = lambda rs: sum(r * q for r, q in rs) / sum(q for _, q in rs)
    base = pooled([(0.5, 10), (0.9, 30), (0.7, 20), (0.6, 40)])
    assert out["up"]["per_layer"][0]["diff"] == pytest.approx(
        pooled([(0.6, 10), (0.95, 30), (0.75, 20), (0.7, 40)]) - base)
    assert out["up"]["mean"] == out["up"]["per_layer"][0]  # one layer: the mean is that layer
    assert out["up"]["per_layer"][0]["ci95"][0] > 0  # every resample favours it
    lo, hi = out["mixed"]["per_layer"][0]["ci95"]
    assert lo < 0 < hi  # resamples without the +0.3 micro-batch go negative
    assert out["twin"]["per_layer"][0] == {"diff": 0.0, "ci95": [0.0, 0.0]}
    assert out["up"]["microbatches"] == 4 and out["up"]["resamples"] == 500


# --- bad input to the new options: one error line, exit 2, no plot ------------------------

BAD = [
    ("step-times-missing", ["--step-times", "{d}/nope.json"], r"nope\.json"),
    ("step-times-not-json", ["--step-times", "{d}/garbage.json"], r"garbage\.json.*JSON"),
    ("step-times-no-arms", ["--step-times", "{d}/budget.json"], r"'arms'"),
    ("step-times-bad-ms", ["--step-times", "{d}/bad_ms.json"], r"'sab'.*step_ms"),
    ("step-times-no-tokens-per-s", ["--step-times", "{d}/no_tps.json"], r"'megatron'.*tokens_per_s"),
    ("step-times-no-known-arm", ["--step-times", "{d}/other_arms.json"], r"none of the arms"),
    ("budgets-glob-no-match", ["--budgets", "dst={d}/none_*.json"], r"none_\*\.json matches no file"),
    ("budgets-empty-part", ["--budgets", "dst={d}/budget.json,"], r"empty path"),
    ("budgets-one-bad-of-many", ["--budgets", "dst={d}/budget.json,{d}/garbage.json"], r"garbage\.json"),
    ("budgets-stages-disagree", ["--budgets", "dst={d}/budget.json,{d}/three_stages.json"], r"disagree"),
]


@pytest.mark.parametrize("argv,mention", [(a, m) for _, a, m in BAD], ids=[i for i, _, _ in BAD])
def test_attention_recall_bad_input(tmp_path, argv, mention):
    sys.path.insert(0, REPO)
    from megatron.training.indexed_io import write_documents

    d = str(tmp_path)
    write_documents(f"{d}/good", [torch.arange(1, 40).numpy(), torch.arange(1, 70).numpy()], 256)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "budget.json").write_text(json.dumps({"budget": [[[1, 2]]]}))
    (tmp_path / "three_stages.json").write_text(json.dumps({"budget": [[[1, 2, 3]]]}))
    (tmp_path / "bad_ms.json").write_text(json.dumps({"arms": {"megatron": {"step_ms": 5, "tokens_per_s": 9},
                                                                "sab": {"step_ms": "x"}}}))
    (tmp_path / "no_tps.json").write_text(json.dumps({"arms": {"megatron": {"step_ms": 5, "tokens_per_s": 0}}}))
    (tmp_path / "other_arms.json").write_text(json.dumps({"arms": {"wlb": {"step_ms": 5}}}))
    png = tmp_path / "r.png"
    p = _run("benchmarks/attention_recall.py", "--load", f"{d}/ckpt", "--data-path", f"{d}/good", "--plot", str(png),
             *[a.format(d=d) for a in argv])
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attention_recall.py: error: "), p.stderr[-2000:]
    assert re.search(mention, lines[0]), lines[0]
    assert "Traceback" not in p.stdout + p.stderr
    assert not png.exists() and not (tmp_path / "r_frontier.png").exists()
