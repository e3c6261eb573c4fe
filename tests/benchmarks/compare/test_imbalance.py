"""WLB-LLM's imbalance degree: hand-computed cases, its invariants, and that the simulator
reports it per step beside tokens/s for every arm."""

import numpy as np
import pytest

from benchmarks.harness.compare.cluster_sim import SimConfig, simulate_cell
from benchmarks.harness.compare.imbalance import imbalance_degree, step_imbalance_degree


def test_hand_computed_cases():
    # Balanced: max x M / sum = 3 x 4 / 12.
    assert imbalance_degree([[3, 3, 3, 3]]).tolist() == [1.0]
    # One straggler: 6 x 4 / (6 + 2 + 2 + 2) = 2.
    assert imbalance_degree([[6, 2, 2, 2]]).tolist() == [2.0]
    # Per replica: 5 x 2 / 8 = 1.25 and 1 x 2 / 1 = 2 (an empty micro-batch counts as 0 ms).
    assert imbalance_degree([[5, 3], [1, 0]]).tolist() == [1.25, 2.0]
    # WLB-LLM's 1.44: at M = PP = 4, one micro-batch 1.44x the mean.
    np.testing.assert_allclose(imbalance_degree([[1.44, 0.852, 0.852, 0.856]]), [1.44])


def test_step_degree_averages_stages_then_replicas():
    # Replica 0: stage means (2+4)/2 = 3 and (1+1)/2 = 1 -> 3 x 2 / 4 = 1.5;
    # replica 1: equal micro-batches -> 1; the step: (1.5 + 1) / 2.
    f = np.array([[[1.0, 3.0], [0.5, 0.5]], [[1.0, 1.0], [1.0, 1.0]]])
    b = np.array([[[1.0, 1.0], [0.5, 0.5]], [[2.0, 2.0], [2.0, 2.0]]])
    assert step_imbalance_degree(f, b) == pytest.approx(1.25)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_bounds_and_scale_invariance(m):
    t = np.random.default_rng(m).uniform(0.1, 5.0, size=(4, m))
    d = imbalance_degree(t)
    assert ((d >= 1 - 1e-12) & (d <= m + 1e-12)).all()  # 1 = balanced, M = one busy micro-batch
    np.testing.assert_allclose(imbalance_degree(7.5 * t), d)
    np.testing.assert_allclose(imbalance_degree(t[:, ::-1]), d)  # order does not matter


@pytest.mark.parametrize("bad", [np.ones(4), np.ones((2, 0)), [[1.0, -1.0]], [[0.0, 0.0]]])
def test_bad_input_is_refused(bad):
    with pytest.raises(ValueError):
        imbalance_degree(bad)


def test_every_sim_arm_reports_it_per_step():
    rng = np.random.default_rng(0)
    L = np.clip(rng.lognormal(6.5, 1.0, size=2000), 16, 4000).astype(np.int64)
    small = (("num_layers", 2), ("hidden_size", 128), ("num_attention_heads", 2),
             ("num_query_groups", 2), ("ffn_hidden_size", 256), ("vocab_size", 500))
    cfg = SimConfig(pp=2, dp=2, micro_batches=2, steps=2, block_size=64, topk=8, model=small)
    t = simulate_cell(L, 4096, cfg, arms=("megatron", "wlb", "sab"), frontier=False).table
    for name, r in t["arms"].items():
        steps = r["imbalance_degree_steps"]
        assert len(steps) == 2 and min(steps) >= 1.0, name
        assert r["imbalance_degree"] == pytest.approx(np.mean(steps))
        assert r["imbalance_degree_max"] == max(steps)
        assert r["tokens_per_s_step_mean"] <= r["tokens_per_s_step_max"]
        # The pooled throughput lies between the per-step extremes.
        assert r["tokens_per_s_step_max"] >= 1e3 * r["tokens_per_ms"] * (1 - 1e-12)
