"""h100-analytic reproduces the published per-layer timings it was derived from."""

import numpy as np
import pytest

from sparsebalance.pairs import causal_pairs, kept_pairs
from sparsebalance.predictor import ModelShape, get_predictor
from sparsebalance.predictor.analytic import (
    BYTESCALE_ATTN_MS,
    BYTESCALE_LENGTHS,
    BYTESCALE_MLP_MS,
    REFERENCE_SHAPE,
    reference_coefficients,
)

REF_CFG = {k: getattr(REFERENCE_SHAPE, k) for k in ModelShape.__dataclass_fields__}


@pytest.mark.parametrize("i", range(len(BYTESCALE_LENGTHS)))
def test_reference_fit_within_stated_tolerance(i):
    """Stated tolerance: attention 2%, MLP 4%, whole layer 3% (module docstring)."""
    c = reference_coefficients()
    L = float(BYTESCALE_LENGTHS[i])
    attn = c["a"] * float(causal_pairs([BYTESCALE_LENGTHS[i]])[0]) + c["b_att"] * L + c["c_att"]
    assert attn == pytest.approx(BYTESCALE_ATTN_MS[i], rel=0.02)
    assert c["b_mlp"] * L == pytest.approx(BYTESCALE_MLP_MS[i], rel=0.04)
    p = get_predictor("h100-analytic", **REF_CFG)
    total = BYTESCALE_ATTN_MS[i] + BYTESCALE_MLP_MS[i]
    assert p.layer_ms([BYTESCALE_LENGTHS[i]], None, "fwd") == pytest.approx(total, rel=0.03)


def test_attention_share_grows_with_length_as_published():
    p = get_predictor("h100-analytic", **REF_CFG)
    t = [p.layer_ms([L], None, "fwd") for L in BYTESCALE_LENGTHS]
    assert all(b / a > 1.9 for a, b in zip(t, t[1:]))  # superlinear in length
    assert t[-1] / t[0] > 100  # 128K vs 4K: 204 ms vs 1.7 ms published


def test_backward_between_linear_and_attention_ratios():
    p = get_predictor("h100-analytic")
    for L in (1024, 32768, 131072):
        r = p.layer_ms([L], None, "bwd") / p.layer_ms([L], None, "fwd")
        assert 2.0 <= r <= 2.5


def test_scaling_to_a_smaller_model_and_budget():
    big = get_predictor("h100-analytic", **REF_CFG)
    small = get_predictor("h100-analytic")  # Qwen2.5-0.5B-like default
    L = np.array([32768])
    assert small.layer_ms(L, None, "fwd") < big.layer_ms(L, None, "fwd")
    # Pair term scales with heads x head_dim: 14 x 64 vs 32 x 128.
    assert small.fwd_pair_ms / big.fwd_pair_ms == pytest.approx(14 * 64 / (32 * 128))
    # The MoBA budget (block 256, top-32) cuts the attention of a 128K document to
    # its kept pairs; a 4K document (16 blocks) is dense and unaffected.
    long_ = np.array([131072])
    dense, sparse = small.layer_ms(long_, None, "fwd"), small.layer_ms(long_, 32, "fwd")
    d = kept_pairs(long_, 32, 256)[0] / causal_pairs(long_)[0]
    lin = small.fwd_token_ms * long_[0] + small.fwd_const_ms
    assert (sparse - lin) / (dense - lin) == pytest.approx(d, rel=1e-9)
    assert small.layer_ms([4096], 32, "fwd") == small.layer_ms([4096], None, "fwd")
