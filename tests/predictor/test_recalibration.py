"""Online recalibration converges to an injected constant slowdown."""

import numpy as np
import pytest

from sparsebalance.predictor import Recalibrator, get_predictor


@pytest.mark.parametrize("slowdown", [0.6, 1.0, 1.37, 2.5])
@pytest.mark.parametrize("alpha", [0.1, 0.3])
def test_converges_to_constant_slowdown_with_noise(slowdown, alpha):
    rng = np.random.default_rng(0)
    p = get_predictor("h100-analytic", num_layers=8, recalibration_alpha=alpha)
    pp, stage = 4, 3
    for _ in range(200):
        lengths = rng.integers(100, 8000, size=int(rng.integers(1, 8)))
        topk = int(rng.integers(4, 40))
        model = p.stage_ms(lengths, topk, stage, pp, "bwd", calibrated=False)
        measured = slowdown * model * rng.lognormal(0.0, 0.03)
        p.observe_microbatch(lengths, topk, stage, pp, "bwd", measured)
    assert p.correction(stage, "bwd") == pytest.approx(slowdown, rel=0.03)
    # Other (stage, phase) keys are untouched.
    assert p.correction(stage, "fwd") == 1.0 and p.correction(0, "bwd") == 1.0
    lengths = np.array([3000, 500])
    assert p.stage_ms(lengths, 16, stage, pp, "bwd") == pytest.approx(
        p.correction(stage, "bwd") * p.stage_ms(lengths, 16, stage, pp, "bwd", calibrated=False))


def test_feedback_with_stale_plans_does_not_overshoot():
    """Many micro-batches planned with the same old factor must not push past the target."""
    r = Recalibrator(alpha=0.5)
    for _ in range(50):
        r.observe(0, "fwd", model_ms=10.0, measured_ms=20.0)
        assert r.factor(0, "fwd") <= 2.0 + 1e-12
    assert r.factor(0, "fwd") == pytest.approx(2.0, rel=1e-9)


def test_outliers_are_clipped_and_bad_input_rejected():
    r = Recalibrator(alpha=1.0, clip=4.0)
    assert r.observe(1, "bwd", 1.0, 1000.0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="phase"):
        r.observe(0, "both", 1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        r.observe(0, "fwd", 0.0, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        Recalibrator(alpha=0.0)
    r.reset()
    assert r.factor(1, "bwd") == 1.0 and r.count(1, "bwd") == 0
