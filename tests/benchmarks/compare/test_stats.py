"""Per-round throughput ratios with a two-level bootstrap interval; the demo's table."""

import numpy as np
import pytest

from benchmarks.harness.compare.report_md import real_table
from benchmarks.harness.compare.stats import RunSteps, ratio_estimate, run_steps


def _runs(rate_by_round, steps=12, noise=0.03, seed=0):
    """One run per round; step ``i`` trains 1000 tokens in 1000 / rate * (1 + noise) s."""
    rng = np.random.default_rng(seed)
    out = []
    for r, rate in enumerate(rate_by_round):
        ms = 1e6 / rate * (1 + noise * rng.standard_normal(steps))
        out.append(RunSteps(r, ms, np.full(steps, 1000.0)))
    return out


def test_a_real_speedup_is_beyond_noise():
    drift = [1.0, 0.8, 1.1, 0.9]  # the machine drifts; both arms see the same round
    base = _runs([1000 * d for d in drift], seed=1)
    fast = _runs([1200 * d for d in drift], seed=2)
    est = ratio_estimate(fast, base)
    assert est.median == pytest.approx(1.2, rel=0.03)
    assert est.low < 1.2 < est.high and est.high - est.low < 0.1
    assert est.beyond_noise and len(est.per_round) == 4
    # Drift between rounds cancels: the pooled throughput ratio without rounds would not.
    assert est.per_round == pytest.approx([1.2] * 4, rel=0.05)


def test_no_difference_is_within_noise():
    base = _runs([1000, 1000, 1000], noise=0.05, seed=3)
    same = _runs([1000, 1000, 1000], noise=0.05, seed=4)
    est = ratio_estimate(same, base)
    assert est.low < 1.0 < est.high and not est.beyond_noise
    assert est.as_dict()["ci95"] == [est.low, est.high]


def test_only_shared_rounds_count():
    base = _runs([1000, 1000])
    other = [RunSteps(5, np.full(4, 500.0), np.full(4, 1000.0))]
    with pytest.raises(ValueError, match="no round"):
        ratio_estimate(other, base)


def test_run_steps_skips_warmup_and_reads_tokens():
    s = {"warmup_steps_skipped": 2, "step_ms_all": [9.0, 9.0, 100.0, 200.0],
         "step_tokens_all": [1, 1, 50, 150], "tokens_per_s": 0.0}
    r = run_steps(s, 3)
    assert r.round == 3 and list(r.step_ms) == [100.0, 200.0] and list(r.tokens) == [50, 150]
    assert r.tokens_per_s == pytest.approx(200 / 0.3)
    # Older summaries: the mean rate spread over the steps.
    old = {"warmup_steps_skipped": 1, "step_ms_all": [5.0, 100.0, 300.0], "tokens_per_s": 10.0}
    assert list(run_steps(old, 0).tokens) == pytest.approx([1.0, 3.0])


def test_real_table_rows_and_verdicts():
    arm = {"tokens_per_s": 1000.0, "imbalance": 1.5, "bubble_fraction": [0.2, 0.1],
           "plan_ms": None, "retained_vs_static": 1.0}
    sb = dict(arm, tokens_per_s=1200.0, plan_ms=30.0, plan_wait_ms=0.1, retained_vs_static=1.02)
    pair = {"median": 1.02, "ci95": [0.99, 1.05], "per_round": [1.02], "beyond_noise": False,
            "isolates": "DST on top of SAB"}
    real = {"config": {"rounds": 3}, "arms": {"megatron": arm, "sparsebalance": sb},
            "ratios_vs_megatron": {"sparsebalance": {"median": 1.2, "ci95": [1.1, 1.3]}},
            "pairs": {"sparsebalance/sab": pair}}
    text = "\n".join(real_table(real))
    assert "| megatron | 1000 | 1 (reference) | 1.000 | 1.50 | 0.20 / 0.10 | - |" in text
    assert "| sparsebalance | 1200 | 1.200x [1.100, 1.300] | 1.020 |" in text
    assert "30.0 (0.1)" in text
    assert "DST on top of SAB (sparsebalance/sab): 1.020x [0.990, 1.050], within noise." in text
