"""ThresholdDensity: SAB's cost model under threshold routing, its lagged online learning,
and exact resume of the packing (in line and planned ahead)."""

import numpy as np
import pytest
from conftest import SEQ

from sparsebalance.balancer import StepPlanner
from sparsebalance.batching import PackingSampler
from sparsebalance.batching.density_feedback import ThresholdDensity
from sparsebalance.batching.sparsity_estimator import SparsityEstimator
from sparsebalance.pairs import causal_pairs, kept_pairs, threshold_kept_pairs

B, K = 64, 4
SOURCES = ("code", "prose", "repeated")


def test_threshold_kept_pairs_is_bounded_by_floor_and_cap():
    L = np.array([10, 1000, 5000, 5000])
    got = threshold_kept_pairs(L, [0.5, 0.5, 0.001, 0.99], K, B, topk_min=1)
    assert got[0] == kept_pairs([10], K, B)[0]  # one block: dense whatever the density
    assert got[1] == pytest.approx(0.5 * causal_pairs([1000])[0])
    assert got[2] == kept_pairs([5000], 1, B)[0]  # the floor
    assert got[3] == kept_pairs([5000], K, B)[0]  # the cap
    assert np.array_equal(threshold_kept_pairs(L, 0.1, None, B), causal_pairs(L))


def content(lengths, seed=0):
    """Per-document truth: a source tag, its density (depends on the source) and a ratio."""
    rng = np.random.default_rng(seed)
    src = np.array(SOURCES, dtype=object)[rng.integers(0, 3, lengths.size)]
    base = {"code": 0.15, "prose": 0.3, "repeated": 0.6}
    dens = np.array([base[s] for s in src]) * np.exp(0.1 * rng.standard_normal(lengths.size))
    return src, np.clip(dens, 0.01, 1.0), rng.uniform(0.1, 0.4, lengths.size)


def test_ratio_scales_top_k_pairs_to_the_prediction():
    td = ThresholdDensity(SparsityEstimator(prior=0.5), block_size=B, sources=["a", "b"])
    L = np.array([3000, 3000])
    assert np.array_equal(td.ratio(L, None, [0, 1]), [1.0, 1.0])  # dense costs stay dense
    want = threshold_kept_pairs(L, 0.5, K, B) / kept_pairs(L, K, B)
    np.testing.assert_allclose(td.ratio(L, K, [0, 1]), want)
    td.estimator.update("a", 3000, 0.05)
    td.estimator.update("b", 3000, 0.9)
    r = td.ratio(L, K, [0, 1])
    assert r[0] < r[1]  # the source learnt sparser costs less


def test_observations_wait_for_the_lag():
    td = ThresholdDensity(block_size=B, sources=["a"], lag=2)
    td.observe(0, [0], [2000], [0.2 * causal_pairs([2000])[0]], causal_pairs([2000]))
    td.advance(1)
    assert td.densities([2000], [0])[0] == 1.0  # the prior: step 0 not used for step 1
    td.advance(2)
    assert td.densities([2000], [0])[0] == pytest.approx(0.2)
    with pytest.raises(ValueError):
        td.observe(3, [0], [10], [60.0], [55.0])  # kept > causal


def _threshold_sampler(lengths, predictor, src, comp, strategy="sab"):
    td = ThresholdDensity(block_size=predictor.block_size, sources=src, compression=comp)
    return PackingSampler(lengths, dp=2, micro_batches=3, seq_length=SEQ, strategy=strategy, seed=3,
                          predictor=predictor, pp=2, density=td), td


def _observe(td, packed, truth):
    """What the driver hands over after a step: every segment's kept and causal pairs."""
    seg = np.array([(d, n) for r in packed.ranks for mb in r for d, _, n in mb], dtype=np.int64)
    kept = threshold_kept_pairs(seg[:, 1], truth[seg[:, 0]], K, B)
    td.observe(packed.step, seg[:, 0], seg[:, 1], kept, causal_pairs(seg[:, 1]))


def _key(packed):
    return [[list(map(tuple, mb)) for mb in r] for r in packed.ranks]


class _AheadBalancer:
    """Stands in for a Balancer that plans ahead: the planner packs step N+1 at step N."""

    ahead = True

    def forecast(self, step, lengths, then=None):
        return None


@pytest.mark.parametrize("ahead", [False, True])
def test_resume_packs_alike_with_online_learning(lengths, predictor, ahead):
    src, dens, comp = content(lengths)

    def planner():
        s, td = _threshold_sampler(lengths, predictor, src, comp)
        return StepPlanner(s, _AheadBalancer() if ahead else None), td

    full, td = planner()
    keys, saved = [], None
    for t in range(8):
        p = full.next_step().packing
        keys.append(_key(p))
        _observe(td, p, dens)
        if t == 3:
            saved = full.state_dict()
    resumed, td2 = planner()
    resumed.load_state_dict(saved)
    for t in range(4, 8):
        p = resumed.next_step().packing
        assert p.step == t and _key(p) == keys[t], f"step {t} differs after resume"
        _observe(td2, p, dens)
    # not vacuous: what was learnt changes the packing
    blind, _ = planner()
    assert any(_key(blind.next_step().packing) != keys[t] for t in range(8))


def test_state_dict_round_trip_predicts_the_same():
    est = SparsityEstimator(min_slope_docs=2)
    rng = np.random.default_rng(0)
    for i in range(40):
        est.update(SOURCES[i % 3], int(rng.integers(500, 5000)), float(rng.uniform(0.1, 0.5)),
                   compression=float(rng.uniform(0.1, 0.4)))
    fresh = SparsityEstimator(min_slope_docs=2)
    fresh.load_state_dict(est.state_dict())
    L, s, c = [700, 9000, 3000], ["code", "new", None], [0.2, 0.3, None]
    np.testing.assert_array_equal(fresh.predict_many(s, L, c), est.predict_many(s, L, c))
    with pytest.raises(ValueError):
        SparsityEstimator(min_slope_docs=3).load_state_dict(est.state_dict())
