"""benchmarks/sparsity_study.py --real (benchmarks/harness/sparsity_real.py): document selection and order, the
per-layer probe's counts and recall, the aggregates, and the study end to end on a tiny GGUF
converted by convert.py gguf-to-megatron with a corpus from make_real_corpus.py."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools"),
                os.path.join(REPO, "tests", "checkpoint")]

from sparsity_study import oracle_pairs  # noqa: E402

from benchmarks.harness import sparsity_real as sr  # noqa: E402


def test_selection_takes_the_shortest_long_enough_once_and_interleaves():
    rng = np.random.default_rng(0)
    lengths = rng.integers(500, 9000, 400)
    sources = [("a", "b", "c", "d", "e")[i % 5] for i in range(400)]
    picked = sr.select_documents(lengths, sources, [(2048, 2), (4096, 2), (8192, 1)])
    assert len({i for i, _, _ in picked}) == len(picked) == 5 * 5  # every document once
    for i, L, s in picked:
        assert lengths[i] >= L and sources[i] == s
        shorter = [j for j in range(400) if sources[j] == s and L <= lengths[j] < lengths[i]]
        assert all(j in {k for k, _, _ in picked} for j in shorter)  # none skipped for a longer one
    order = sr.interleave(picked)
    assert sorted(order) == sorted(picked)
    first = order[:6]  # any prefix mixes lengths and sources
    assert len({L for _, L, _ in first}) == 3 and len({s for _, _, s in first}) == 4
    docs = sr.fit_first([{"length": L, "source": s} for _, L, s in order])
    fit, held = docs[:len(docs) // 2], docs[len(docs) // 2:]
    assert {d["source"] for d in fit} == {d["source"] for d in held} == set("abcde")


class _Core(torch.nn.Module):
    softmax_scale = None


def _probe(taus, block, L, H=4, Hkv=2, D=16, seed=0):
    args = argparse.Namespace(taus=taus, topk_min=1, block_size=block, topk=None)
    core = _Core()
    probe = sr.Probe(args, [core], with_mass=True)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, H, D, generator=g) * 2, torch.randn(L, Hkv, D, generator=g) * 2
    probe(core, (q, k, k), {})
    return probe, q, k


def test_probe_counts_recall_and_oracle():
    probe, q, k = _probe([0.5, 0.9, 1.0], 16, 200)
    causal = probe.causal
    assert causal == 4 * 200 * 201 / 2
    for t in (0.5, 0.9):
        assert probe.kept[(t, True)][0] <= probe.kept[(t, False)][0]  # a shared count keeps at least as much
        assert probe.recall[(t, True)][0] <= probe.recall[(t, False)][0] + 1e-9
    assert probe.kept[(0.5, True)][0] < probe.kept[(0.9, True)][0] < causal
    assert probe.kept[(1.0, True)][0] == causal and abs(probe.recall[(1.0, True)][0] - 1) < 1e-9  # all kept
    o = oracle_pairs(q, k, 16 ** -0.5, 16, 0.9)
    assert probe.oracle[0.9][0] == o["per_head"]  # the chunked mass = the study's oracle


def _doc(source, length, density, delta=None, **kw):
    d = {"source": source, "length": length, "density": density, "compression_ratio": 0.3,
         "densities": {"0.9": {"per_head": density, "per_block": 2 * density}},
         "by_layer": {"per_head": [density], "per_block": [2 * density]}}
    if delta is not None:
        d.update(loss_delta=delta, density_topk=0.3, loss_delta_threshold=delta / 2,
                 loss_delta_threshold_per_block=delta / 2, density_in_loop_threshold=density,
                 density_in_loop_threshold_per_block=2 * density)
    return {**d, **kw}


def test_summary_spreads_ratios_and_sensitivity():
    docs = [_doc(s, L, 0.2 + 0.01 * i, 0.1 * (i + 1) if L == 4096 else None)
            for i, (s, L) in enumerate([(s, L) for L in (2048, 4096) for s in "abcd"])]
    args = argparse.Namespace(taus=[0.9], tau=0.9, microbatch_tokens=8192)
    rep = sr.summarize(sr.fit_first(docs), args)
    assert rep["per_head_over_per_block"] == pytest.approx(0.5)
    assert rep["density_mean"] == pytest.approx(np.mean([d["density"] for d in docs]))
    assert rep["cv_equal_length"] > 0 and set(rep["by_source"]) == set("abcd")
    s = rep["sensitivity"]
    assert s["documents"] == 4 and s["lengths"] == [4096]
    v = [0.5, 0.6, 0.7, 0.8]
    assert s["cv_equal_length"] == pytest.approx(np.std(v) / np.mean(v))
    assert s["corr_with_density"]["spearman"] == pytest.approx(1.0)
    assert s["per_head_minus_per_block"]["mean"] == 0 and s["per_head_over_per_block_in_loop"] == pytest.approx(0.5)
    assert isinstance(rep["estimator_mape"], float) and isinstance(rep["estimator_mape_length_only"], float)
    assert rep["by_layer"]["per_block"] == [pytest.approx(2 * rep["by_layer"]["per_head"][0])]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, world):
    """A tiny GGUF (tests/checkpoint/_gguf_models.py) converted in the warm world, and a corpus in its tokens."""
    import make_real_corpus as mrc
    from _gguf_models import converted_tiny_model

    d = tmp_path_factory.mktemp("real")
    converted_tiny_model(world, str(d))
    assert mrc.main(["--tokenizer-model", str(d / "ckpt" / "hf"), "--output-prefix", str(d / "corpus"),
                     "--num-docs", "24", "--min-length", "128", "--max-length", "512", "--quantiles", "0.05,0.5",
                     "--sources", "code,csv,json,repeat"]) == 0
    return d


def test_study_end_to_end(tiny_model, tmp_path, world):
    out = tmp_path / "real.json"
    p = world.launch(os.path.join(REPO, "benchmarks", "sparsity_study.py"),
                     ["--real", "--load", str(tiny_model / "ckpt"), "--data-path", str(tiny_model / "corpus"),
                      "--lengths", "256,512", "--docs-per-source", "2,1", "--block-size", "32", "--taus", "0.8",
                      "--sens-lengths", "256", "--sens-topk", "2", "--oracle-max-length", "256", "--backend",
                      "reference", "--json", "--output", str(out)], timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == rep
    for key in ("cv_equal_length", "density_mean", "per_head_over_per_block", "estimator_mape",
                "estimator_mape_length_only"):
        assert isinstance(rep[key], float), key
    assert set(rep["by_source"]) == {"code", "csv", "json", "repeat"} and set(rep["taus"]) == {"0.8", "0.9"}
    docs = rep["documents"]
    assert len(docs) == 12 and rep["measured"] == {**rep["measured"], "documents": 12, "stopped_early": False}
    assert all({"source", "length", "density", "compression_ratio"} <= set(d) for d in docs)
    assert all(("loss_delta" in d) == (d["length"] == 256) for d in docs)
    assert all(0 < d["density"] <= d["density_per_block"] <= 1 for d in docs)
    assert all(d["density_topk"] < 1 for d in docs if d["length"] == 256)  # 8 blocks, top-2: sparse
    s = rep["sensitivity"]
    assert s["documents"] == 8 and set(s["by_source"]) == set(rep["by_source"])
    assert isinstance(s["cv_equal_length"], float) and "per_head_minus_per_block" in s
    assert rep["oracle"]["0.9"]["documents"] == 8 and 0 < rep["oracle"]["0.9"]["gate_recall_per_head"] <= 1
    assert len(rep["by_layer"]["per_head"]) == 2  # one per layer


def test_dump_qk_packs_whole_documents_for_the_bench(tiny_model, tmp_path, world):
    """--dump-qk: one layer's q/k/v of corpus documents packed to --dump-tokens (sources
    interleaved, the last document cut), readable by bench_attention.py --qk; a shorter dump is
    the longer one's prefix, and another layer gives other q."""
    import bench_attention

    def dump(name, tokens, layer):
        p = world.launch(os.path.join(REPO, "benchmarks", "sparsity_study.py"),
                         ["--real", "--load", str(tiny_model / "ckpt"), "--data-path", str(tiny_model / "corpus"),
                          "--lengths", "512", "--dump-qk", str(tmp_path / name), "--dump-tokens", str(tokens),
                          "--dump-layer", str(layer)], timeout=180)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1]), torch.load(tmp_path / name)

    info, big = dump("a.pt", 1500, 1)
    assert info["tokens"] == 1500 and info["layer"] == 1 and len(info["sources"]) >= 3
    cu = big["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 1500 and all(b > a for a, b in zip(cu, cu[1:]))
    assert [d["tokens"] for d in big["docs"]] == [b - a for a, b in zip(cu, cu[1:])]
    assert big["q"].shape[0] == big["k"].shape[0] == big["v"].shape[0] == 1500
    _, small = dump("b.pt", 700, 1)
    assert torch.equal(small["q"], big["q"][:700]) and torch.equal(small["k"], big["k"][:700])
    _, other = dump("c.pt", 700, 0)
    assert not torch.equal(other["q"], small["q"])
    got = bench_attention._read_qk(str(tmp_path / "a.pt"), argparse.ArgumentParser())
    assert got["q"].shape == big["q"].shape and bench_attention.qk_lengths(got["cu_seqlens"], 1500) == [
        b - a for a, b in zip(cu, cu[1:])]
