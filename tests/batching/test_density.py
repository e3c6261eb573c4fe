"""Density estimator: exact for length-determined routing, learns data-dependent ratios."""

import numpy as np
import pytest
from density_estimator import DensityEstimator

from sparsebalance.attention.packed import AttentionRecord
from sparsebalance.pairs import causal_pairs, kept_pairs

B, K = 64, 4


def test_block_routing_is_exact_from_length():
    rng = np.random.default_rng(0)
    est = DensityEstimator(block_size=B)
    for _ in range(50):
        L = rng.integers(1, 5000, size=6)
        est.observe(L, K, kept_pairs(L, K, B), doc_ids=rng.integers(0, 100, size=6))
    rep = est.report()
    assert rep["observations"] == 300 and rep["max_abs_rel_err"] < 1e-12
    assert np.allclose(est.ratio(np.array([10, 900, 4000]), K), 1.0)


def _synthetic(n_docs=400, seed=1):
    rng = np.random.default_rng(seed)
    L = rng.integers(B * 4, B * 80, size=n_docs)
    trend = 0.6 + 0.3 * np.log2(L / B) / np.log2(80)  # depends on length
    noise = rng.lognormal(0.0, 0.25, size=n_docs)  # depends on the document
    achieved = kept_pairs(L, K, B) * np.minimum(trend * noise, 1.0)
    oracle = kept_pairs(L, K, B) * np.minimum(trend, 1.0)  # knows the length trend exactly
    return rng, L, achieved, oracle


def test_learns_length_trend_then_documents():
    rng, L, achieved, oracle = _synthetic()
    est = DensityEstimator(block_size=B, alpha=0.2)
    naive, epochs = [], []
    for epoch in range(2):
        errs = []
        for mb in np.array_split(rng.permutation(L.size), 100):
            guess = est.kept(L[mb], K, mb)
            errs.append(np.abs(guess - achieved[mb]) / achieved[mb])
            if epoch == 0:
                naive.append(np.abs(kept_pairs(L[mb], K, B) - achieved[mb]) / achieved[mb])
            est.observe(L[mb], K, achieved[mb], doc_ids=mb)
        epochs.append(np.concatenate(errs[len(errs) // 2:]).mean())
    naive_err = np.concatenate(naive).mean()
    oracle_err = (np.abs(oracle - achieved) / achieved).mean()
    assert naive_err > 1.2 * oracle_err  # the fixture has a trend worth learning
    assert epochs[0] < 1.1 * oracle_err  # buckets capture the length trend
    assert epochs[1] < 0.05  # every document seen once: per-document refinement
    assert est.report()["observations"] == 2 * L.size


def test_record_feedback_and_density_bounds():
    L = (300, 2000)
    kp = int(kept_pairs(np.array(L), K, B).sum())
    heads = 8
    rec = AttentionRecord(layer_number=1, microbatch=0, topk=K, kept_pairs=heads * kp // 2,
                          causal_pairs=heads * int(causal_pairs(np.array(L)).sum()), doc_lengths=L)
    est = DensityEstimator(block_size=B)
    est.observe_record(rec)
    r = est.ratio(np.array(L), K)
    assert r == pytest.approx([0.5, 0.5], rel=1e-6)
    assert est.ratio(np.array(L), None) == pytest.approx([1.0, 1.0])  # other budget untouched


def test_bad_config():
    with pytest.raises(ValueError, match="alpha"):
        DensityEstimator(alpha=0)
    with pytest.raises(ValueError, match="block_size"):
        DensityEstimator(block_size=0)


def test_cost_model_uses_density(predictor):
    from sparsebalance.batching.cost import CostModel

    L = np.array([B * 10, B * 40])
    est = DensityEstimator(block_size=predictor.block_size)
    plain = CostModel(predictor, topk=K, pp=2).doc_ms(L)
    same = CostModel(predictor, topk=K, pp=2, density=est).doc_ms(L)
    assert np.allclose(plain, same)
    est.observe(L, K, 0.5 * kept_pairs(L, K, predictor.block_size))
    half = CostModel(predictor, topk=K, pp=2, density=est).doc_ms(L)
    assert np.all(half < plain)
    # halving the pairs removes half of the attention-pair time (model: a*pairs + ...)
    dense_gap = (CostModel(predictor, topk=None, pp=2).doc_ms(L)
                 - CostModel(predictor, topk=0, pp=2).doc_ms(L))
    pairs_gap = kept_pairs(L, None, predictor.block_size) - kept_pairs(L, 0, predictor.block_size)
    a = dense_gap / pairs_gap
    assert np.allclose(plain - half, 0.5 * a * kept_pairs(L, K, predictor.block_size))
