"""Equal-step-time planning: never slower than the deadline, never less attention than the
static plan or than the static plan raised into its own float, close to the exhaustive
optimum, and more attention than static where the step has a straggler to cut."""

import numpy as np
import pytest
from bruteforce import frontier

from sparsebalance.predictor import get_predictor
from sparsebalance.tuning import raise_indices
from sparsebalance.tuning.critical_path import objective
from sparsebalance.tuning.equal_time import equal_time_indices, equal_time_plan
from sparsebalance.tuning.from_predictor import build_instance


def static(inst):
    return np.full((inst.dp, inst.microbatches, inst.stages), inst.k0_index)


def test_fits_the_static_step_and_is_near_the_optimum(small):
    t0, a0 = objective(small, static(small))
    idx = equal_time_indices(small)
    t, a = objective(small, idx)
    assert t <= t0 * (1 + 1e-9)
    assert a >= objective(small, raise_indices(small, static(small), deadline=t0))[1] * (1 - 1e-12) >= a0 * (1 - 1e-12)
    fr = frontier(small)  # the most attention any table holds within t0, per replica summed
    best = sum(float(b[np.searchsorted(ts, t0 * (1 + 1e-9), side="right") - 1])
               for ts, b in zip(fr.times, fr.best_attn))
    assert a <= best * (1 + 1e-9), "more attention than the exhaustive optimum: the model disagrees"
    assert a >= 0.97 * best, f"equal-time {a:.4g} vs optimum {best:.4g}"


def test_a_straggler_is_cut_and_the_idle_stages_raised():
    """One long document among short ones (the real-model shape): at the static step time the
    plan keeps more pairs than static, cutting the straggler's ops and raising others'."""
    pred = get_predictor("h100-analytic", num_layers=8, block_size=256)
    lengths = [[[30000], [8000, 6000], [9000], [7000, 5000], [10000], [6000, 6000], [11000], [9000]]]
    inst = build_instance(pred, lengths, pp=4, k0=16, levels=list(range(8, 33)))
    plan = equal_time_plan(inst)
    assert plan.policy == "equal-time"
    assert plan.step_ms <= plan.baseline_step_ms * (1 + 1e-9)
    assert plan.attn >= 1.02 * plan.baseline_attn, (plan.attn, plan.baseline_attn)
    assert (plan.budget[0, 0] < 16).any() and (plan.budget[0, 1:] > 16).any()
    assert np.array_equal(plan.budget, equal_time_plan(inst).budget)  # deterministic


def test_a_later_deadline_keeps_at_least_as_much():
    pred = get_predictor("h100-analytic", num_layers=8, block_size=256)
    inst = build_instance(pred, [[[20000], [9000], [12000, 4000], [15000]]], pp=2, k0=16, levels=list(range(8, 33)))
    t0 = objective(inst, static(inst))[0]
    a_eq = objective(inst, equal_time_indices(inst))[1]
    t1, a1 = objective(inst, equal_time_indices(inst, deadline=1.1 * t0))
    assert t1 <= 1.1 * t0 * (1 + 1e-9) and a1 >= a_eq * (1 - 1e-12)


def test_bad_arguments(small):
    t0 = objective(small, static(small))[0]
    with pytest.raises(ValueError, match="below the static"):
        equal_time_indices(small, deadline=0.5 * t0)
    with pytest.raises(ValueError, match="floor"):
        equal_time_indices(small, floors=("both",))
