"""Critical-path DST planned per replica under threshold routing (issue 59): the joint search's
polish cuts one op of the slowest replica per move, so on replicas of equal time no single move
shortens the step; planned alone, each replica gets the whole search."""

import numpy as np
import pytest

from sparsebalance.batching.density_feedback import ThresholdDensity
from sparsebalance.batching.sparsity_estimator import SparsityEstimator
from sparsebalance.config import DSTConfig, default_ladder
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning import critical_path_indices, critical_path_plan
from sparsebalance.tuning.critical_path import objective, policy, replica_instance
from sparsebalance.tuning.from_predictor import build_instance, build_tau_instance

TAU0, CAP, B = 0.9, 32, 256
TAUS = default_ladder(TAU0)


def _tau_instance(lengths, pp=4, prior=0.08):
    pred = get_predictor("h100-analytic", num_layers=8, block_size=B, topk=CAP)
    td = ThresholdDensity(SparsityEstimator(prior=prior), block_size=B, tau0=TAU0)
    dens = {t: [[list(td.densities(mb, None, t)) for mb in rank] for rank in lengths] for t in TAUS}
    return build_tau_instance(pred, lengths, pp=pp, cap=CAP, tau0=TAU0, densities=dens)


def _stage_attn(inst, idx):
    return inst.at(idx)[2].sum(axis=(0, 1))


# M = PP = 4: a small first micro-batch (SAB's shape), long documents elsewhere
REPLICA = [[20000, 9000], [100000, 12000], [90000, 30000], [60000, 2000]]


def test_equal_replicas_the_joint_polish_stalls_the_per_replica_plan_does_not():
    inst = _tau_instance([REPLICA] * 4)
    k0 = np.full((4, 4, 4), inst.k0_index)
    t0, _ = objective(inst, k0)
    joint = critical_path_indices(inst, 0.0)
    split = critical_path_indices(inst, 0.0, per_replica=True)
    alone = critical_path_indices(replica_instance(inst, 0), 0.0)
    tj, ts, ta = objective(inst, joint)[0], objective(inst, split)[0], objective(replica_instance(inst, 0), alone)[0]
    assert ts < tj * (1 - 1e-4)  # fails with the joint search alone
    assert ts == pytest.approx(ta, rel=1e-12)  # each replica as fast as planned alone
    assert ts < t0
    # attention slack 0 with the per-stage floor: every stage keeps its static pairs
    assert np.all(_stage_attn(inst, split) >= _stage_attn(inst, k0) * (1 - 1e-9))


@pytest.mark.parametrize("seed", range(5))
def test_per_replica_never_slower_than_joint_nor_below_the_floor(seed):
    rng = np.random.default_rng(seed)
    D, M, S = 3, 4, 4
    lengths = [[list(rng.integers(500, 120000, rng.integers(1, 4))) for _ in range(M)] for _ in range(D)]
    inst = _tau_instance(lengths, pp=S, prior=float(rng.uniform(0.03, 0.3)))
    k0 = np.full((D, M, S), inst.k0_index)
    t0, a0 = objective(inst, k0)
    for floor in ("stage", "total"):
        joint = critical_path_indices(inst, 0.0, floor=floor)
        split = critical_path_indices(inst, 0.0, floor=floor, per_replica=True)
        (tj, aj), (ts, as_) = objective(inst, joint), objective(inst, split)
        assert ts <= tj * (1 + 1e-9) and ts <= t0 * (1 + 1e-12)
        if ts >= tj * (1 - 1e-9):
            assert as_ >= aj * (1 - 1e-12)
        if floor == "stage":
            assert np.all(_stage_attn(inst, split) >= _stage_attn(inst, k0) * (1 - 1e-9))
        assert as_ >= a0 * (1 - 1e-9)


def test_policy_keeps_the_joint_search_per_replica_is_opt_in():
    inst = _tau_instance([REPLICA] * 3)
    plan = policy(inst, DSTConfig(policy="critical-path", attn_slack=0.0))
    np.testing.assert_array_equal(plan.budget, inst.budgets(critical_path_indices(inst, 0.0)))
    pred = get_predictor("h100-analytic", num_layers=8, block_size=B, topk=CAP)
    topk = build_instance(pred, [REPLICA] * 3, pp=4, k0=CAP)
    np.testing.assert_array_equal(critical_path_plan(topk).budget,
                                  topk.budgets(critical_path_indices(topk, 0.0)))


def test_a_slow_replica_cuts_below_its_own_floor_and_the_fast_ones_pay(monkeypatch):
    from sparsebalance.tuning import critical_path as cp

    slow = [[20000, 9000], [110000, 12000], [100000, 20000], [60000, 2000]]
    inst = _tau_instance([slow, REPLICA, REPLICA])
    k0 = np.full((3, 4, 4), inst.k0_index)
    t0 = objective(inst, k0)[0]
    cross = critical_path_indices(inst, 0.0, per_replica=True)
    monkeypatch.setattr(cp, "CROSS_SLACKS", ())
    own = critical_path_indices(inst, 0.0, per_replica=True)
    tc, to = objective(inst, cross)[0], objective(inst, own)[0]
    assert tc < to * (1 - 1e-4) and to < t0  # fails without the cross-replica move
    # on some stage replica 0 keeps less than its static pairs (below its own floor), the
    # others pay for it there; every stage keeps its static pairs over the replicas
    a, a0 = inst.at(cross)[2], inst.at(k0)[2]
    below = a[0].sum(axis=0) < a0[0].sum(axis=0) * (1 - 1e-9)
    assert below.any() and np.all(a[1:].sum(axis=(0, 1))[below] > a0[1:].sum(axis=(0, 1))[below])
    assert np.all(a.sum(axis=(0, 1)) >= a0.sum(axis=(0, 1)) * (1 - 1e-9))
