"""SparsityEstimator: the fallback ladder, online updates, and the spread statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparsebalance.batching.sparsity_estimator import (
    LengthOnlyEstimator,
    SparsityEstimator,
    attention_cost,
    causal_pairs,
    cv,
    cv_within_buckets,
    length_bucket,
    mape,
)


def test_length_bucket_edges():
    assert [length_bucket(L) for L in (0, 1, 2, 3, 4, 1023, 1024)] == [0, 0, 1, 1, 2, 9, 10]
    assert length_bucket(1024, buckets_per_octave=4) == 40
    # 2^10.25 = 1217.7
    assert length_bucket(1217, buckets_per_octave=4) == 40 and length_bucket(1218, buckets_per_octave=4) == 41


def test_prior_until_something_is_measured():
    est = SparsityEstimator(prior=0.8)
    assert est.predict("code", 500) == 0.8


def test_fallback_ladder_source_bucket_then_bucket_then_source_then_all():
    est = SparsityEstimator()
    est.update("code", 300, 0.2)  # bucket 8
    est.update("code", 310, 0.4)
    est.update("prose", 260, 0.9)  # bucket 8
    est.update("prose", 5000, 0.5)  # bucket 12
    assert est.predict("code", 400) == pytest.approx(0.3)  # (code, 8)
    assert est.predict("retrieval", 400) == pytest.approx(0.5)  # bucket 8, all sources
    assert est.predict("code", 70000) == pytest.approx(0.3)  # no bucket 16: code's mean
    assert est.predict("copy", 70000) == pytest.approx(0.5)  # nothing: everything's mean


def test_min_count_skips_thin_cells():
    est = SparsityEstimator(min_count=2)
    est.update("code", 300, 0.1)
    est.update("prose", 300, 0.5)
    assert est.predict("code", 300) == pytest.approx(0.3)  # (code, 8) has 1 < 2: bucket mean


def test_online_update_is_the_running_mean():
    est = SparsityEstimator()
    rng = np.random.default_rng(0)
    xs = rng.uniform(0.1, 0.9, size=50)
    for x in xs:
        est.update("docs", 700, float(x))
    assert est.predict("docs", 600) == pytest.approx(xs.mean())


def test_length_only_ignores_sources():
    est = LengthOnlyEstimator()
    est.update("code", 300, 0.2)
    est.update("prose", 300, 0.6)
    assert est.predict("code", 300) == est.predict("prose", 300) == pytest.approx(0.4)


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        SparsityEstimator(prior=0.0)
    with pytest.raises(ValueError):
        SparsityEstimator(buckets_per_octave=0)
    with pytest.raises(ValueError):
        SparsityEstimator().update("x", 10, 1.5)
    with pytest.raises(ValueError):
        mape([1.0], [0.0])


def test_cost_and_mape():
    assert causal_pairs(4) == 10
    assert attention_cost([0.5, 1.0], [4, 3]) == pytest.approx(5 + 6)
    est = SparsityEstimator()
    est.update("a", 100, 0.5)
    assert est.predict_cost(["a", "b"], [100, 120]) == pytest.approx(0.5 * (5050 + 7260))
    assert mape([110.0, 90.0], [100.0, 100.0]) == pytest.approx(0.1)


def test_cv_and_within_buckets():
    assert cv([1.0]) is None and cv([2.0, 2.0]) == 0.0
    assert cv([1.0, 3.0]) == pytest.approx(0.5)
    # bucket 8 (256..511): values 1, 3 -> CV 0.5; bucket 10: 2, 2 -> 0; bucket 12: one doc, skipped
    r = cv_within_buckets([300, 400, 1100, 1500, 5000], [1.0, 3.0, 2.0, 2.0, 9.0])
    assert r["docs"] == 4 and r["cv"] == pytest.approx(0.25)
    assert r["buckets"][256] == {"docs": 2, "mean": 2.0, "cv": pytest.approx(0.5)}
    assert r["buckets"][4096]["cv"] is None
    fine = cv_within_buckets([300, 400], [1.0, 3.0], buckets_per_octave=4)
    assert fine["cv"] is None  # 300 and 400 fall in different quarter-octaves
    assert min(fine["buckets"]) == math.ceil(2 ** (32 / 4))


def test_update_microbatch_one_document_is_exact_and_several_keep_the_total():
    est = SparsityEstimator()
    est.update_microbatch(["code"], [300], kept=0.25 * causal_pairs(300), causal=causal_pairs(300))
    assert est.predict("code", 300) == pytest.approx(0.25)
    est = SparsityEstimator()
    est.update("a", 300, 0.8)
    est.update("b", 300, 0.4)
    lengths, sources = [300, 300, 600], ["a", "b", "a"]
    pairs = [causal_pairs(L) for L in lengths]
    pred = [est.predict(s, L) for s, L in zip(sources, lengths)]  # 0.8, 0.4, 0.8 (a's mean)
    measured = 0.5 * sum(p * c for p, c in zip(pred, pairs)) / sum(pairs)  # half the predicted
    fresh = SparsityEstimator()
    for s, L in zip(sources, lengths):
        fresh.update(s, L, est.predict(s, L))  # the same predictions, one count each
    fresh.update_microbatch(sources, lengths, kept=measured * sum(pairs), causal=sum(pairs))
    # the scaled documents were 0.4, 0.2, 0.4: the a/300 cell now averages 0.8 (weight 1) and 0.4
    w = pairs[0] / sum(pairs)
    assert fresh.predict("a", 300) == pytest.approx((0.8 + 0.4 * w) / (1 + w))
    with pytest.raises(ValueError):
        fresh.update_microbatch(["a"], [10], kept=5.0, causal=1.0)
