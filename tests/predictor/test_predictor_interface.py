"""The shared predictor interface: composition, vectorisation, validation."""

import dataclasses

import numpy as np
import pytest

from sparsebalance.config import ModelShape
from sparsebalance.predictor import LatencyPredictor, get_predictor
from sparsebalance.predictor.fitted import FittedPredictor

COEF = {"layer": {"fwd": {"pairs": 1e-6, "dense_pairs": 6e-7, "tokens": 1e-3, "docs": 0.02,
                          "dense_docs": 0.05, "const": 0.3},
                  "bwd": {"pairs": 2.5e-6, "dense_pairs": 1.5e-6, "tokens": 2e-3, "docs": 0.04,
                          "dense_docs": 0.1, "const": 0.6}},
        "embedding": {"fwd": {"tokens": 1e-4, "const": 0.05}, "bwd": {"tokens": 2e-4, "const": 0.1}},
        "output": {"fwd": {"tokens": 5e-3, "const": 0.5}, "bwd": {"tokens": 1e-2, "const": 1.0}}}


def _predictors():
    return [get_predictor("h100-analytic", num_layers=24),
            FittedPredictor(ModelShape(num_layers=24, hidden_size=128, num_attention_heads=4,
                                       num_query_groups=4, block_size=64), COEF)]


@pytest.mark.parametrize("pred", _predictors(), ids=["analytic", "fitted"])
@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_stage_is_layers_times_layer_plus_extras(pred, pp, phase):
    assert isinstance(pred, LatencyPredictor)
    lengths = np.array([5000, 120, 64, 1])
    per_stage = []
    for s in range(pp):
        expect = (24 // pp) * pred.layer_ms(lengths, 16, phase)
        extras = pred.extras_ms(lengths, s, pp, phase)
        assert pred.stage_ms(lengths, 16, s, pp, phase) == pytest.approx(expect + extras)
        if 0 < s < pp - 1:
            assert extras == 0.0
        else:
            assert extras > 0.0
        per_stage.append(pred.stage_ms(lengths, 16, s, pp, phase))
    # The stages of a pipeline add up to the whole model on one stage.
    assert sum(per_stage) == pytest.approx(pred.stage_ms(lengths, 16, 0, 1, phase))


@pytest.mark.parametrize("first,last,pp,want", [(1, 3, 4, [1, 10, 10, 3]), (None, 4, 3, [10, 10, 4]),
                                                  (6, None, 2, [6, 18]), (2, 2, 1, [24])])
def test_uneven_first_and_last_stages(first, last, pp, want):
    """Megatron-LM's --decoder-first/last-pipeline-num-layers: the other stages split the rest
    evenly, and a stage's time counts its own layers."""
    shape = ModelShape(num_layers=24, hidden_size=128, num_attention_heads=4, num_query_groups=4, block_size=64,
                       first_stage_layers=first, last_stage_layers=last)
    assert [shape.layers_of(s, pp) for s in range(pp)] == want
    pred = FittedPredictor(shape, COEF)
    lengths = np.array([700, 64])
    for s in range(pp):
        assert pred.stage_ms(lengths, 8, s, pp, "fwd") == pytest.approx(
            want[s] * pred.layer_ms(lengths, 8, "fwd") + pred.extras_ms(lengths, s, pp, "fwd"))
    with pytest.raises(ValueError, match="not divisible by the other 2 stage"):
        dataclasses.replace(shape, first_stage_layers=3, last_stage_layers=None).layers_of(1, 3)


@pytest.mark.parametrize("pred", _predictors(), ids=["analytic", "fitted"])
def test_layer_ms_is_sum_of_docs_plus_const_and_vectorised(pred):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 20000, size=50)
    lengths[3] = 0
    for topk in (None, 0, 8, 32):
        for phase in ("fwd", "bwd"):
            v = pred.layer_doc_ms(lengths, topk, phase)
            one = np.array([pred.layer_doc_ms([L], topk, phase)[0] for L in lengths])
            assert v.shape == (50,) and np.allclose(v, one, rtol=1e-12)
            assert v[3] == 0.0 and (v[lengths > 0] > 0).all()
            assert pred.layer_ms(lengths, topk, phase) == pytest.approx(
                v.sum() + pred.layer_const_ms(phase))
    # A larger budget never makes a micro-batch cheaper (dense, None, runs another
    # kernel and need not be the most expensive).
    t = [pred.layer_ms(lengths, k, "fwd") for k in (0, 4, 16, 64, 1000)]
    assert all(a <= b for a, b in zip(t, t[1:])) and t[0] < t[-1]


def test_dense_only_profile_ignores_budgets():
    shape = ModelShape(hidden_size=128, num_attention_heads=4, num_query_groups=4, block_size=64)
    dense = FittedPredictor(shape, COEF, dense_only=True)
    sparse = FittedPredictor(shape, COEF)
    L = np.array([8000, 300])
    assert dense.layer_ms(L, 4, "fwd") == dense.layer_ms(L, None, "fwd") == sparse.layer_ms(L, None, "fwd")
    assert sparse.layer_ms(L, 4, "fwd") != sparse.layer_ms(L, None, "fwd")


@pytest.mark.parametrize("pred", _predictors(), ids=["analytic", "fitted"])
@pytest.mark.parametrize("topk", [None, 0, 4, 32])
def test_pair_ms_is_the_slope_in_kept_pairs(pred, topk):
    from sparsebalance.pairs import kept_pairs

    B = pred.block_size
    L1, L2 = np.array([40 * B]), np.array([90 * B + 7])
    for phase in ("fwd", "bwd"):
        # Same tokens-and-docs part: compare two lengths with the token term removed.
        d = np.diff([pred.layer_doc_ms(L, topk, phase)[0] for L in (L1, L2)])[0]
        dp = float(kept_pairs(L2, topk, B)[0] - kept_pairs(L1, topk, B)[0])
        tok = (pred.layer_doc_ms(L2, 10**9, phase)[0] - pred.layer_doc_ms(L1, 10**9, phase)[0]
               - pred.pair_ms(10**9, phase) * float(kept_pairs(L2, 10**9, B)[0]
                                                     - kept_pairs(L1, 10**9, B)[0]))
        assert pred.pair_ms(topk, phase) == pytest.approx((d - tok) / dp, rel=1e-9)


@pytest.mark.parametrize("pred", _predictors(), ids=["analytic", "fitted"])
def test_bad_arguments_raise_value_error_naming_them(pred):
    with pytest.raises(ValueError, match="phase"):
        pred.layer_ms([10], None, "forward")
    with pytest.raises(ValueError, match="lengths"):
        pred.layer_doc_ms([-1], None, "fwd")
    with pytest.raises(ValueError, match="stage"):
        pred.stage_ms([10], None, 4, 4, "fwd")
    with pytest.raises(ValueError, match="pp"):
        pred.stage_ms([10], None, 0, 5, "fwd")  # 24 layers do not split over 5 stages
    with pytest.raises(ValueError, match="topk"):
        pred.layer_ms([10], -1, "fwd")


def test_model_shape_validation_and_attributes():
    p = get_predictor("h100-analytic", block_size=128, topk=16, num_layers=12)
    assert (p.num_layers, p.block_size, p.topk) == (12, 128, 16)
    with pytest.raises(ValueError, match="num_query_groups"):
        get_predictor("h100-analytic", num_attention_heads=14, num_query_groups=4)
    with pytest.raises(ValueError, match="block_size"):
        get_predictor("h100-analytic", block_size=0)
