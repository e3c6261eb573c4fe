"""SensitivityEstimator: density's ladder on a loss delta, its floor and the probe update."""

import numpy as np
import pytest

from sparsebalance.batching.sparsity_estimator import SensitivityEstimator, SparsityEstimator


def test_ladder_and_floor():
    e = SensitivityEstimator(prior=0.05)
    assert e.predict("code", 4096) == 0.05  # nothing measured: the prior
    e.update_many(["code", "code", "csv", "filler"], [4096, 4096, 4096, 2048], [0.15, 0.16, 0.037, -0.001])
    assert e.predict("code", 4096) == pytest.approx(0.155)  # source + bucket
    assert e.predict("filler", 2048) == SensitivityEstimator.floor  # a negative delta is noise
    assert e.predict("prose", 4096) == pytest.approx((0.15 + 0.16 + 0.037) / 3)  # bucket
    assert e.predict("csv", 16384) == pytest.approx(0.037)  # source
    assert e.predict("prose", 100) == pytest.approx((0.15 + 0.16 + 0.037 + 1e-4) / 4)  # everything
    with pytest.raises(ValueError, match="finite"):
        e.update("code", 4096, float("nan"))
    with pytest.raises(ValueError, match="prior"):
        SensitivityEstimator(prior=0.0)
    # above 1 is a valid loss delta (it is no density)
    e.update("noise", 64, 1.5)
    assert e.predict("noise", 64) == pytest.approx(1.5)


def test_probe_update_and_state():
    e = SensitivityEstimator()
    e.update_probe(["code"], [4096], 0.2)  # one document: an exact update
    assert e.predict("code", 4096) == pytest.approx(0.2)
    e2 = SensitivityEstimator()
    e2.update_many(["code", "csv"], [4096, 4096], [0.16, 0.04])
    e2.update_probe(["code", "csv"], [4096, 4096], 0.2)  # measured twice the predicted 0.1
    assert e2.predict_many(["code", "csv"], [4096, 4096]) == pytest.approx([(0.16 + 0.16) / 1.5, (0.04 + 0.04) / 1.5])
    with pytest.raises(TypeError, match="update_probe"):
        e2.update_microbatch(["code"], [4096], 1.0, 2.0)
    back = SensitivityEstimator()
    back.load_state_dict(e2.state_dict())
    assert np.allclose(back.predict_many(["code", "csv", "x"], [4096, 4096, 10]),
                       e2.predict_many(["code", "csv", "x"], [4096, 4096, 10]))
    with pytest.raises(ValueError, match="saved as"):
        SparsityEstimator().load_state_dict(e2.state_dict())


def test_density_estimator_keeps_its_range():
    with pytest.raises(ValueError, match="density"):
        SparsityEstimator().update("a", 100, 1.5)
    assert SparsityEstimator(prior=1.0).predict("a", 10) == 1.0
