"""benchmarks/sparsity_study.py: its statistics on made-up densities, and one end-to-end run on a
checkpoint that benchmarks/make_hetero_corpus.py trains for two iterations."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

import make_hetero_corpus as mhc  # noqa: E402
import sparsity_study as st  # noqa: E402


def test_pack_in_order_keeps_order_and_the_token_cap():
    groups = st.pack_in_order([100, 50, 60, 200, 10, 300], 210)
    assert groups == [[0, 1, 2], [3, 4], [5]]
    assert st.pack_in_order([500], 100) == [[0]]  # too long: alone


def test_spread_is_zero_when_density_follows_length_and_seen_when_it_does_not():
    lengths = [256, 256, 512, 512] * 10
    by_len = [0.8 if L == 256 else 0.5 for L in lengths]
    ms = st.microbatch_spread(lengths, by_len, 768)
    assert ms["microbatches"] > 10 and ms["cv_measured_over_length_only"] == pytest.approx(0.0, abs=1e-12)
    assert ms["cv_measured"] == pytest.approx(ms["cv_length_only"])
    # two sources at equal lengths: the length-only view misses the spread
    srcs = ["a", "b"] * 20
    dens = [0.9 if s == "a" else 0.3 for s in srcs]
    lengths = [512] * 40
    ms = st.microbatch_spread(lengths, dens, 512)
    assert ms["cv_length_only"] == pytest.approx(0.0, abs=1e-12) and ms["cv_measured"] == pytest.approx(0.5)
    err = st.estimator_errors(lengths, dens, srcs, 1024)
    assert err["fit_documents"] == err["heldout_documents"] == 20
    assert err["source_and_length"] == pytest.approx(0.0, abs=1e-12)  # (source, bucket) means are exact
    assert err["length_only"] == pytest.approx(0.0, abs=1e-12)  # a pair of a+b per micro-batch averages out
    err = st.estimator_errors(lengths, dens, srcs, 512)  # one document per micro-batch
    assert err["length_only"] == pytest.approx(np.mean([0.3 / 0.9, 0.3 / 0.3]))  # predicts 0.6 for both
    assert err["source_and_length"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("tau,cap,kmin", [(0.5, 4, 1), (0.9, 16, 1), (0.7, 3, 2)])
def test_routed_pairs_are_what_sparse_attention_reports(tau, cap, kmin):
    import torch

    from sparsebalance.ops import sparse_attention
    from sparsebalance.ops.plan import RoutingRule

    torch.manual_seed(0)
    L, H, D, B = 300, 4, 16, 32
    q, k, v = torch.randn(L, H, D), torch.randn(L, 2, D), torch.randn(L, 2, D)
    k[:, :, 0] += torch.linspace(-3, 3, L).view(L, 1)  # some gate structure
    (kept,), (causal,) = st.routed_pairs(q, k, [0, L], D ** -0.5, B, cap, RoutingRule(threshold=tau, topk_min=kmin))
    _, density = sparse_attention(q, k, v, torch.tensor([0, L], dtype=torch.int32), topk=cap, block_size=B,
                                  backend="cpu", return_density=True, threshold=tau, topk_min=kmin)
    assert causal == H * L * (L + 1) // 2 and kept / causal == pytest.approx(float(density))
    if cap < 8:  # 10 blocks: a cap under 8 cannot keep them all
        assert kept < causal


def test_oracle_counts_the_blocks_that_hold_the_mass():
    import torch

    L, B = 64, 16
    q, k = torch.zeros(L, 2, 8), torch.zeros(L, 1, 8)
    o = st.oracle_pairs(q, k, 1.0, B, 1.0)  # uniform attention, TAU 1: every block, dense
    assert o["causal"] == 2 * L * (L + 1) / 2
    assert o["oracle"] == o["per_head"] == o["total_mass"] == pytest.approx(o["causal"])
    q[:, 0, 0] = 10.0
    k[B:2 * B, :, 0] = 10.0  # head 0: every query past block 1 attends to block 1; head 1 uniform
    o = st.oracle_pairs(q, k, 1.0, B, 0.9)
    tri, whole = B * (B + 1) / 2, B * B
    rows = [tri, whole + tri, 2 * whole + tri, 3 * whole + tri]  # diagonal; + sink; + 1 or 2 candidates
    assert o["oracle"] == pytest.approx(2 * sum(rows))  # head 1 needs both candidates of block 3
    assert o["per_head"] == pytest.approx(sum(rows) + sum(rows[:3]) + 2 * whole + tri)  # head 0: 1 candidate
    assert o["total_mass"] == pytest.approx(2 * sum(rows))  # head 1's block 3: 1 candidate holds ~0.73 < 0.9
    # local attention (each query on its own block): the candidates' tiny residue is uniform, so the
    # plan's rule keeps every candidate, while sink + diagonal already hold TAU of all the mass
    q, k = torch.zeros(L, 1, 8), torch.zeros(L, 1, 8)
    for t in range(L):
        q[t, 0, t // B] = k[t, 0, t // B] = 10.0
    o = st.oracle_pairs(q, k, 1.0, B, 0.9)
    assert o["oracle"] == pytest.approx(sum(rows))
    assert o["total_mass"] == pytest.approx(tri + 3 * (whole + tri))


CORPUS = ["--num-docs", "60", "--seq-length", "128", "--train-iters", "2", "--train-layers", "1",
          "--train-hidden", "32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("hetero")
    prefix, ckpt = str(d / "corpus"), str(d / "ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        assert mhc.main(["--output-prefix", prefix, "--train-checkpoint", ckpt, *CORPUS]) == 0
    return prefix, ckpt


def test_corpus_tool_trains_then_reuses_its_checkpoint(trained, capsys):
    prefix, ckpt = trained
    capsys.readouterr()
    assert mhc.main(["--output-prefix", prefix, "--train-checkpoint", ckpt, *CORPUS]) == 0
    again = json.loads(capsys.readouterr().out)["checkpoint"]
    assert again["reused"] and again["iterations"] == [1, 2]
    with pytest.raises(SystemExit) as e:  # another corpus (seed): the directory holds a different run
        mhc.main(["--output-prefix", prefix + "_5", "--train-checkpoint", ckpt, *CORPUS, "--seed", "5"])
    assert e.value.code == 2 and "holds a run" in capsys.readouterr().err
    assert not os.path.exists(prefix + "_5.bin")  # refused before anything is written


def test_study_end_to_end(trained, tmp_path, world):
    """The study runs as a job of the session's warm world (tests/_world.py)."""
    prefix, ckpt = trained
    out = tmp_path / "study.json"
    p = world.launch(os.path.join(REPO, "benchmarks", "sparsity_study.py"),
                     ["--load", ckpt, "--data-path", prefix, "--docs", "all", "--num-docs", "40", "--block-size",
                      "16", "--topk", "4", "--tau", "0.5", "--drift-docs", "10", "--json", "--output", str(out)],
                     timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    assert json.loads(out.read_text()) == rep
    assert isinstance(rep["cv_equal_length"], float) and isinstance(rep["estimator_mape"], float)
    assert set(rep["by_source"]) <= {"code", "docs", "retrieval", "copy", "markov"} and len(rep["by_source"]) >= 3
    docs = rep["per_document"]
    assert len(docs) == 40 and all(0 < d["density"] <= 1 and 0 < d["oracle_total_mass"] <= 1 + 1e-9 for d in docs)
    assert isinstance(rep["oracle"]["cv_equal_length"], float) and set(rep["oracle"]) > {"per_head", "total_mass"}
    assert all(d["density"] == 1.0 for d in docs if d["length"] <= 16 * 3)  # sink + up to 1 + diagonal
    assert any(d["density"] < 1.0 for d in docs if d["length"] > 16 * 6)  # the cap of 4 binds
    assert rep["config"]["iteration"] == 2 and set(rep["drift"]["iterations"]) == {"1", "2"}
    assert rep["estimator"]["heldout_documents"] == 20
