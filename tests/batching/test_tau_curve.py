"""Density as a function of TAU (DST's TAU levels): the measured relation, its monotonicity,
its held-out error, and the estimator's densities at other TAUs."""

import json
import os

import numpy as np
import pytest

from sparsebalance.batching.density_feedback import ThresholdDensity
from sparsebalance.batching.sparsity_estimator import SparsityEstimator
from sparsebalance.batching.tau_curve import MEASURED, TauCurve
from sparsebalance.config import check_ladder, default_ladder
from sparsebalance.pairs import causal_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDY = os.path.join(ROOT, "results", "real_study.json")
STUDY_097 = os.path.join(ROOT, "results", "real_study_perhead_tau097.json")
GRID = np.round(np.arange(0.5, 0.995, 0.01), 3)


def test_measured_constants_are_the_fit_of_the_committed_study():
    got = TauCurve.from_study(STUDY)
    assert got.taus == MEASURED.taus and got.ref == MEASURED.ref == 0.9
    np.testing.assert_allclose(got.intercept, MEASURED.intercept, atol=1e-10)
    np.testing.assert_allclose(got.slope, MEASURED.slope, atol=1e-10)


def test_measured_curve_predicts_held_out_tau_097():
    """20 documents measured again at TAU 0.97 (outside the fit's 0.8-0.95): the curve moves
    each one's measured 0.9 density there within a few percent (3.9% mean, over-predicting)."""
    at_09 = {d["doc"]: d for d in json.load(open(STUDY))["documents"]}
    held = json.load(open(STUDY_097))["documents"]
    rel = []
    for d in held:
        base = at_09[d["doc"]]
        assert base["length"] == d["length"]
        pred = MEASURED.scale([base["densities"]["0.9"]["per_head"]], [d["length"]], 0.9, 0.97)[0]
        rel.append(pred / d["densities"]["0.97"]["per_head"] - 1)
    assert len(rel) == 20
    assert np.mean(np.abs(rel)) < 0.06 and np.max(np.abs(rel)) < 0.12


@pytest.mark.parametrize("length", [300, 2048, 8192, 131072, 10**7])
def test_curve_is_monotone_in_tau_at_every_length(length):
    lr = np.array([MEASURED.log_ratio(t, [length])[0] for t in GRID])
    assert np.all(np.diff(lr) >= 0)
    assert MEASURED.log_ratio(0.9, [length])[0] == 0.0
    assert MEASURED.log_ratio(1.0, [length])[0] == np.inf


def test_a_fit_whose_data_fall_with_tau_is_held_flat():
    """Noise can make a measured density fall as TAU rises: the curve holds it flat instead."""
    c = TauCurve.fit([1000, 1000], [0.8, 0.9, 0.95], [[0.5, 0.4, 0.45], [0.5, 0.4, 0.45]], 0.9)
    lr = np.array([c.log_ratio(t, [1000])[0] for t in GRID])
    assert np.all(np.diff(lr) >= -1e-12) and c.slope == (0.0, 0.0, 0.0)  # one length: no length term


def test_estimator_density_is_monotone_in_tau():
    """SAB's estimator's prediction of a document's density (what prices a TAU level) never
    falls as TAU rises, for every source and length, and is its measured value at TAU0."""
    est = SparsityEstimator()
    rng = np.random.default_rng(0)
    L = rng.integers(500, 200_000, 300)
    src = rng.choice(["code", "prose", "csv"], 300)
    est.update_many(src, L, np.clip(rng.uniform(0.05, 0.9, 300), 0, 1))
    td = ThresholdDensity(est, block_size=64, sources=src, tau0=0.9)
    ids = np.arange(300)
    d = np.stack([td.densities(L, ids, t) for t in GRID])
    assert np.all(np.diff(d, axis=0) >= 0) and np.all((d > 0) & (d <= 1))
    np.testing.assert_array_equal(td.densities(L, ids, 0.9), td.densities(L, ids))
    kept = np.stack([td.kept(L, 32, ids, t) for t in GRID])  # within the cap too
    assert np.all(np.diff(kept, axis=0) >= 0)
    assert (d[0] < d[-1]).mean() > 0.9  # not a flat (vacuous) relation


def test_pairs_at_a_level_go_back_to_tau0():
    td = ThresholdDensity(SparsityEstimator(prior=0.2), block_size=64, tau0=0.9)
    L = np.array([4096, 65536])
    at_08 = td.densities(L, None, 0.8) * causal_pairs(L)
    np.testing.assert_allclose(td.at_tau0(at_08, L, 0.8), 0.2 * causal_pairs(L))
    np.testing.assert_array_equal(td.at_tau0([5.0, 6.0], L, None), [5.0, 6.0])
    with pytest.raises(ValueError, match="tau0"):
        ThresholdDensity(block_size=64).densities(L, None, 0.8)


def test_default_ladder_and_its_checks():
    assert default_ladder(0.9) == (0.8, 0.85, 0.9, 0.93, 0.95, 0.97)
    assert check_ladder(default_ladder(0.9), 0.9) is None
    assert "at least two" in check_ladder([0.9], 0.9)
    assert "(0, 1]" in check_ladder([0.8, 1.3], 0.9)
    assert "strictly increasing" in check_ladder([0.95, 0.8, 0.9], 0.9)
    assert "must lie within" in check_ladder([0.8, 0.85], 0.9)
