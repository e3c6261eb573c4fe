"""Instances built from a latency predictor agree with the predictor and the routing counts."""

import numpy as np
import pytest

from sparsebalance.pairs import kept_pairs
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning import critical_path_indices
from sparsebalance.tuning.critical_path import objective
from sparsebalance.tuning.from_predictor import build_instance


@pytest.mark.parametrize("pp,vpp", [(2, 1), (2, 2)])
def test_matches_predictor(pp, vpp):
    pred = get_predictor("h100-analytic", num_layers=8, block_size=256)
    rng = np.random.default_rng(1)
    lengths = [[rng.integers(300, 30000, size=rng.integers(1, 5)) for _ in range(4)]
               for _ in range(2)]
    inst = build_instance(pred, lengths, pp=pp, vpp=vpp, k0=16, levels=[8, 12, 16, 24],
                          schedule="interleaved" if vpp > 1 else "1f1b")
    S = pp * vpp
    assert inst.fwd.shape == (4, 2, 4, S)
    for li, k in enumerate(inst.levels):
        for d in range(2):
            for m in range(4):
                for j in range(S):
                    for phase in ("fwd", "bwd"):
                        want = pred.stage_ms(lengths[d][m], int(k), j, S, phase)
                        assert getattr(inst, phase)[li, d, m, j] == pytest.approx(want)
                    assert inst.attn[li, d, m, j] == pytest.approx(
                        pred.shape.layers_of(j, S) * kept_pairs(lengths[d][m], int(k), 256).sum())
    # Long documents make the budget matter: the planner finds something to do.
    t0, a0 = objective(inst, np.full((2, 4, S), inst.k0_index))
    t, a = objective(inst, critical_path_indices(inst))
    assert t <= t0 and a >= a0 * (1 - 1e-12)


def test_ragged_lengths_raise():
    pred = get_predictor("h100-analytic", num_layers=4, block_size=256)
    with pytest.raises(ValueError, match="lengths"):
        build_instance(pred, [[[100]], [[100], [200]]], pp=2, k0=8)
