"""benchmarks/real_accuracy.py's equal-step-time arm (``equal_step_time``): DST's plan at static top-k's
planned step time keeps at least static's pairs and never plans a slower step; the report cell's
interval and ratio; retrieval's Wilson interval and paired gap. Planning only (no model): a
``model_flags.txt`` of SmolLM2-135M's shape is all the planner reads."""

import numpy as np
import pytest
from test_real_accuracy_sens import LENGTHS, VOCAB

from benchmarks import real_accuracy as R
from benchmarks.harness.compare.real_arms import Arm, arm_pairs, equal_time_entry, paired_gap, wilson_interval

# `make real-accuracy`'s 4,096-token packing: one 3,949-token document is the straggler.
LENGTHS_4K = [[3949], [1200, 1800, 1000], [2500, 1500], [4096], [900, 1100, 1300, 700], [3000, 1000],
              [2000, 2000], [1024, 1024, 1024, 1024]]


@pytest.mark.parametrize("lengths", [LENGTHS, LENGTHS_4K], ids=["2k", "4k"])
@pytest.mark.parametrize("pp", [4, 8])
def test_equal_time_plan_fits_static_step_and_keeps_more(args, lengths, pp):
    eq = R.equal_time_dst_plan(args, VOCAB, lengths, pp)
    assert eq["step_ms"] <= eq["static_step_ms"] * (1 + 1e-9)
    assert eq["planned_attn"] >= eq["static_planned_attn"]
    b = np.asarray(eq["budget"])
    assert b.shape == (len(lengths), pp) and b.min() >= args.topk // 2 and b.max() <= 2 * args.topk
    # the planner's pairs are the forwards' pairs: top-k routing's count over the real 30 layers
    # moves with the planned one (same direction, not vacuous)
    sb = arm_pairs(Arm("eq", stage_budgets=b), lengths, args.block_size, 30, 9)
    st = arm_pairs(Arm("s", topk=args.topk), lengths, args.block_size, 30, 9)
    assert (sb > st) == (eq["planned_attn"] > eq["static_planned_attn"] * (1 + 1e-9))


def test_equal_time_entry_is_paired_and_reports_the_ratio():
    rng = np.random.default_rng(0)
    static = 2 + rng.normal(0, 0.2, 16)
    cell = equal_time_entry(static - 0.003, static, np.arange(100, 116), 1.08e9, 1.0e9)
    lo, med, hi = cell["loss_minus_static"]
    assert lo == pytest.approx(-0.003) and med == pytest.approx(-0.003) and hi == pytest.approx(-0.003)
    assert cell["pairs_over_static"] == pytest.approx(1.08) and cell["n"] == 16


def test_wilson_and_paired_gap():
    lo, hi = wilson_interval(27, 30)
    assert lo == pytest.approx(0.7438, abs=1e-4) and hi == pytest.approx(0.9654, abs=1e-4)
    assert wilson_interval(30, 30)[1] == 1.0 and wilson_interval(0, 30)[0] == 0.0
    g = paired_gap([True] * 28 + [False] * 2, [True] * 30)
    assert g["gap"] == pytest.approx(-2 / 30) and g["b_only"] == 2 and g["a_only"] == 0
    assert g["interval"][0] < g["gap"] <= g["interval"][2] <= 0
    with pytest.raises(ValueError):
        paired_gap([True], [True, False])
