"""Fitting recovers known coefficients; metrics are the textbook ones."""

import numpy as np
import pytest

from sparsebalance.pairs import kept_pairs
from sparsebalance.predictor.fitted import LAYER_FEATURES, fit_coefficients, layer_features
from sparsebalance.predictor.fitting import mape, nnls, relative_nnls, spearman


def _compositions(rng, n, capacity=4096):
    out = []
    for _ in range(n):
        lengths = []
        while sum(lengths) < capacity // 2:
            lengths.append(int(rng.integers(1, capacity // 2)))
        out.append((lengths, [None, 1, 4, 16][int(rng.integers(4))]))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("true", [
    {"pairs": 2e-6, "dense_pairs": 3e-6, "tokens": 3e-3, "docs": 0.05, "dense_docs": 0.3,
     "const": 1.5},
    {"pairs": 5e-7, "dense_pairs": 5e-7, "tokens": 1e-2, "docs": 0.0, "dense_docs": 0.0,
     "const": 0.0},  # zeros stay zero
    {"pairs": 1e-5, "dense_pairs": 2e-6, "tokens": 0.0, "docs": 0.2, "dense_docs": 0.1,
     "const": 4.0},
])
def test_fit_recovers_known_coefficients(seed, true):
    rng = np.random.default_rng(seed)
    block = 64
    comps = _compositions(rng, 40)
    samples = []
    for phase, scale in (("fwd", 1.0), ("bwd", 2.5)):
        for lengths, topk in comps:
            x = layer_features(lengths, topk, block)
            ms = scale * float(x @ np.array([true[f] for f in LAYER_FEATURES]))
            samples.append({"kind": "layer", "phase": phase, "lengths": lengths,
                            "topk": topk, "ms": ms})
    coef = fit_coefficients(samples, block)["layer"]
    for phase, scale in (("fwd", 1.0), ("bwd", 2.5)):
        for f in LAYER_FEATURES:
            assert coef[phase][f] == pytest.approx(scale * true[f], rel=1e-6, abs=1e-9), (phase, f)


def test_fit_with_noise_is_close():
    rng = np.random.default_rng(7)
    true = np.array([2e-6, 3e-6, 3e-3, 0.05, 0.2, 1.5])
    comps = _compositions(rng, 200)
    X = np.stack([layer_features(L, k, 64) for L, k in comps])
    y = X @ true * rng.lognormal(0.0, 0.02, size=len(comps))  # 2% multiplicative noise
    c = relative_nnls(X, y)
    pred = X @ c
    assert mape(pred, X @ true) < 0.01
    assert c[0] == pytest.approx(true[0], rel=0.05)  # the pair term is well identified


def test_features_count_exact_pairs():
    lengths = [1, 63, 64, 65, 1000, 0]
    x = layer_features(lengths, 3, 64)
    assert x[0] == kept_pairs([1, 63, 64, 65, 1000], 3, 64).sum() and x[1] == 0
    assert x[2] == 1193 and x[3] == 5 and x[4] == 0 and x[5] == 1.0  # empty docs do not count
    d = layer_features(lengths, None, 64)
    assert d[0] == 0 and d[1] == sum(L * (L + 1) // 2 for L in lengths)
    assert d[2] == 1193 and d[3] == 0 and d[4] == 5 and d[5] == 1.0


def test_nnls_matches_unconstrained_when_feasible_and_clips_otherwise():
    rng = np.random.default_rng(0)
    X = rng.random((30, 3))
    c_true = np.array([1.0, 2.0, 0.5])
    assert np.allclose(nnls(X, X @ c_true), c_true)
    y = X @ np.array([1.0, -2.0, 0.5])  # best unconstrained has a negative entry
    c = nnls(X, y)
    assert (c >= 0).all() and c[1] == 0.0
    # Optimality (KKT): the residual does not correlate positively with a zero column.
    r = y - X @ c
    assert X[:, 1] @ r <= 1e-9


def test_nnls_rejects_bad_input():
    with pytest.raises(ValueError, match="X must be"):
        nnls(np.ones((3, 2)), np.ones(4))
    with pytest.raises(ValueError, match="positive targets"):
        relative_nnls(np.ones((3, 2)), np.array([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="kind"):
        fit_coefficients([{"kind": "oops", "phase": "fwd", "lengths": [1], "topk": None,
                           "ms": 1.0}], 64)


def test_metrics():
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(0.1)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Monotone but non-linear: rank correlation is still 1.
    assert spearman([1, 2, 3, 4], [1, 8, 27, 64]) == pytest.approx(1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 2, 3]) == pytest.approx(1.0)  # ties
