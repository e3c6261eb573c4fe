"""DST under threshold routing: budget levels are TAUs, each priced by SAB's density estimator at
that TAU (``build_tau_instance``); the planners pick a TAU per (micro-batch, stage) as they pick
a top-k, the cap staying a guard."""

import numpy as np
import pytest

from sparsebalance.batching.density_feedback import ThresholdDensity
from sparsebalance.batching.sparsity_estimator import SparsityEstimator
from sparsebalance.config import default_ladder
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning import critical_path_plan, instance_from_json, instance_to_json
from sparsebalance.tuning.critical_path import objective
from sparsebalance.tuning.from_predictor import build_instance, build_tau_instance
from sparsebalance.tuning.plan import static_plan

TAU0, CAP, B = 0.9, 32, 256
TAUS = default_ladder(TAU0)


def _step(lengths, prior=0.08):
    """(predictor, TAU level -> densities nested like ``lengths``) of a step whose documents the
    estimator has seen at TAU0 (density ``prior``), moved to each level by the measured curve."""
    pred = get_predictor("h100-analytic", num_layers=8, block_size=B, topk=CAP)
    td = ThresholdDensity(SparsityEstimator(prior=prior), block_size=B, tau0=TAU0)
    dens = {t: [[list(td.densities(mb, None, t)) for mb in rank] for rank in lengths] for t in TAUS}
    return pred, dens


def test_static_level_is_the_cap_instance_and_levels_are_monotone():
    lengths = [[[60000, 3000], [20000], [9000, 9000, 4000], [30000]]]
    pred, dens = _step(lengths)
    inst = build_tau_instance(pred, lengths, pp=2, cap=CAP, tau0=TAU0, densities=dens)
    cap = build_instance(pred, lengths, pp=2, k0=CAP, levels=[CAP], densities=dens[TAU0])
    assert inst.unit == "tau" and tuple(inst.levels) == TAUS and inst.k0 == TAU0
    for name in ("fwd", "bwd", "attn"):
        np.testing.assert_allclose(getattr(inst, name)[inst.k0_index], getattr(cap, name)[0])
        assert np.all(np.diff(getattr(inst, name), axis=0) >= 0)
    # the lever is real: the long documents cost less at the lowest TAU, more at the highest
    assert (inst.fwd[0] < inst.fwd[inst.k0_index]).any() and (inst.attn[-1] > inst.attn[inst.k0_index]).any()


def test_planner_cuts_tau_on_the_straggler_and_never_slows_the_step():
    # micro-batch 0 holds the longest document: the pipeline waits for it; the others hold
    # long ones too, so a stage can give them back the pairs it takes from it (attention slack 0)
    lengths = [[[100000], [60000, 8000], [50000, 9000], [65000]]]
    pred, dens = _step(lengths)
    inst = build_tau_instance(pred, lengths, pp=2, cap=CAP, tau0=TAU0, densities=dens)
    plan = critical_path_plan(inst)
    assert plan.budget.dtype == np.float64 and set(np.unique(plan.budget)) <= set(TAUS)
    assert plan.budget[0, 0].min() < TAU0  # the straggler's TAU was cut
    assert plan.budget[0, 1:].max() > TAU0  # others raised theirs
    assert plan.step_ms < plan.baseline_step_ms * (1 - 1e-3)
    assert plan.attn >= plan.baseline_attn * (1 - 1e-9)  # attention slack 0: no pair given up overall
    base = static_plan(inst)
    assert base.step_ms == plan.baseline_step_ms and np.all(base.budget == TAU0)


@pytest.mark.parametrize("seed", range(6))
def test_planned_tau_never_raises_predicted_step_time(seed):
    rng = np.random.default_rng(seed)
    lengths = [[list(rng.integers(500, 120000, rng.integers(1, 4))) for _ in range(4)] for _ in range(2)]
    pred, dens = _step(lengths, prior=float(rng.uniform(0.03, 0.3)))
    inst = build_tau_instance(pred, lengths, pp=2, cap=CAP, tau0=TAU0, densities=dens)
    t0, a0 = objective(inst, np.full((2, 4, 2), inst.k0_index))
    for eps in (0.0, 0.05):
        plan = critical_path_plan(inst, eps=eps)
        idx = inst.indices(plan.budget)
        t, a = objective(inst, idx)
        assert t <= t0 * (1 + 1e-12) and a >= (1 - eps) * a0 * (1 - 1e-9)


def test_tau_instance_json_round_trip_and_bad_levels():
    lengths = [[[40000], [5000, 5000]]]
    pred, dens = _step(lengths)
    inst = build_tau_instance(pred, lengths, pp=2, cap=CAP, tau0=TAU0, densities=dens)
    back = instance_from_json(instance_to_json(inst))
    assert back.unit == "tau" and np.array_equal(back.levels, inst.levels) and back.k0 == TAU0
    np.testing.assert_allclose(back.fwd, inst.fwd)
    doc = instance_to_json(inst)
    doc["levels"] = [0.8, 1.2]
    with pytest.raises(ValueError, match="TAUs in"):
        instance_from_json(doc)
    with pytest.raises(ValueError, match="include the run's TAU"):
        build_tau_instance(pred, lengths, pp=2, cap=CAP, tau0=0.91, densities=dens)
