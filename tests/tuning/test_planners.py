"""Planner targets: brute-force gap, anchor dominance, raise and constraint properties."""

import dataclasses

import numpy as np
import pytest
from bruteforce import frontier
from tuning_cases import SEEDS, SMALL, make

from benchmarks.harness.synthetic_instances import random_instance
from sparsebalance.tuning import anchor_indices, critical_path_indices, raise_indices
from sparsebalance.tuning.critical_path import objective

ANCHORS = [(agg, p) for agg in ("mean", "max", "min") for p in (0.05, 0.1, 0.2, 0.3)]


def static(inst):
    return np.full((inst.dp, inst.microbatches, inst.stages), inst.k0_index)


@pytest.mark.parametrize("eps", [0.0, 0.05])
def test_within_3_percent_of_brute_force(small, eps):
    fr = frontier(small)
    opt = fr.optimum(eps)
    t_static, a_static = objective(small, static(small))
    assert opt <= t_static + 1e-9
    idx = critical_path_indices(small, eps, floor="total")  # the objective brute force solves
    t, a = objective(small, idx)
    assert t >= opt * (1 - 1e-9), "faster than the exhaustive optimum: the model disagrees"
    assert t <= 1.03 * opt, f"critical-path {t:.4f} vs optimum {opt:.4f}"
    assert a >= (1 - eps) * a_static * (1 - 1e-12)


def test_brute_force_instances_are_not_trivial():
    """Guard against a vacuous gap test: budgets must be able to shorten most steps."""
    gains = []
    for case in SMALL:
        for seed in SEEDS[:1]:
            inst = make(case, seed)
            gains.append(objective(inst, static(inst))[0] / frontier(inst).optimum(0.0))
    assert np.mean(np.array(gains) > 1.003) >= 0.5, gains


def test_at_least_as_fast_as_every_anchor_setting(small):
    t0, a0 = objective(small, static(small))
    for agg, p in ANCHORS:
        ta, aa = objective(small, anchor_indices(small, agg, p))
        eps = min(max(0.0, 1.0 - aa / a0), 1.0)
        tc, ac = objective(small, critical_path_indices(small, eps, floor="total"))
        assert tc <= ta * (1 + 1e-9), (agg, p, tc, ta)
        assert ac >= (1 - eps) * a0 * (1 - 1e-12)


def test_raise_never_lengthens_the_step(small):
    rng = np.random.default_rng(0)
    L = len(small.levels)
    for _ in range(8):
        idx = rng.integers(0, L, size=(small.dp, small.microbatches, small.stages))
        t, a = objective(small, idx)
        up = raise_indices(small, idx)
        t2, a2 = objective(small, up)
        assert t2 <= t * (1 + 1e-12)
        assert a2 >= a


def test_raise_is_not_vacuous():
    """From the fastest plan, most small instances have bubbles worth raising into."""
    gained = []
    for case in SMALL:
        inst = make(case, 0)
        low = np.zeros((inst.dp, inst.microbatches, inst.stages), dtype=np.int64)
        gained.append(objective(inst, raise_indices(inst, low))[1] > objective(inst, low)[1])
    assert np.mean(gained) >= 0.5, gained


MEDIUM = [dict(pp=4, dp=2, microbatches=8), dict(pp=8, dp=4, microbatches=16),
          dict(pp=4, dp=2, microbatches=8, schedule="interleaved", vpp=2)]


@pytest.mark.parametrize("cfg", MEDIUM, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("eps", [0.0, 0.02, 0.1])
@pytest.mark.parametrize("floor", ["stage", "total"])
def test_attention_floor_holds_and_never_slower_than_static(cfg, eps, floor):
    inst = random_instance(3, levels=[16, 20, 24, 28, 32, 40, 48], k0=32, **cfg)
    t0, a0 = objective(inst, static(inst))
    idx = critical_path_indices(inst, eps, floor=floor)
    assert idx.shape == (inst.dp, inst.microbatches, inst.stages)
    t, a = objective(inst, idx)
    assert a >= (1 - eps) * a0 * (1 - 1e-12)
    if floor == "stage":  # each stage keeps its own static attention
        assert np.all(inst.at(idx)[2].sum(axis=(0, 1)) >= (1 - eps) * inst.at(static(inst))[2].sum(axis=(0, 1))
                      * (1 - 1e-12))
    assert t <= t0 * (1 + 1e-12)
    assert np.array_equal(idx, critical_path_indices(inst, eps, floor=floor))  # deterministic


def test_a_uniformly_slower_stage_is_not_cut_in_every_microbatch():
    """The last stage twice as slow in every micro-batch (a layout's imbalance): the whole-step
    floor cuts it in every micro-batch and pays on the others; the per-stage floor (the default)
    cuts it in none or some only, and still gains where micro-batches differ."""
    inst = random_instance(5, pp=8, dp=1, microbatches=8, levels=[16, 20, 24, 28, 32, 40, 48], k0=32)
    fwd = inst.fwd.copy()
    fwd[..., -1] *= 2.0
    inst = dataclasses.replace(inst, fwd=fwd, bwd=2.2 * fwd)
    cut = {floor: critical_path_indices(inst, 0.0, floor=floor) < inst.k0_index for floor in ("total", "stage")}
    assert cut["total"][..., -1].all(), "fixture: the whole-step floor should cut the slow stage everywhere"
    assert not cut["stage"][..., -1].all()
    assert cut["stage"].any(), "fixture: the per-stage plan should still cut somewhere"
    assert objective(inst, critical_path_indices(inst))[0] <= objective(inst, static(inst))[0] * (1 + 1e-12)
    # the driver's policy takes --sb-dst-floor (DSTConfig.floor)
    from sparsebalance.config import DSTConfig
    from sparsebalance.tuning.policies import DST_POLICIES

    for floor in ("total", "stage"):
        plan = DST_POLICIES["critical-path"](inst, DSTConfig(policy="critical-path", topk_min=16, topk_max=48,
                                                            floor=floor))
        assert np.array_equal(plan.budget < inst.k0, cut[floor])


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3])
def test_anchor_directions(small, p):
    k0 = small.k0
    lo, hi = (1 - p) * k0, (1 + p) * k0
    b = {agg: small.budgets(anchor_indices(small, agg, p)) for agg in ("mean", "max", "min")}
    assert np.all(b["max"] >= k0), "MAX must never cut"
    assert np.all(b["min"] <= k0), "MIN must never raise"
    for v in b.values():
        assert np.all((v == k0) | ((v >= lo - 1e-9) & (v <= hi + 1e-9)))


def test_anchor_moves_toward_the_anchor():
    inst = random_instance(5, pp=2, dp=2, microbatches=6, levels=list(range(12, 29)), k0=20)
    idx = anchor_indices(inst, "mean", 0.3)
    lat = inst.fwd + inst.bwd
    lat0 = lat[inst.k0_index]
    chosen = np.take_along_axis(lat, idx[None], 0)[0]
    anchor = lat0.mean(axis=(0, 1))
    # Every op ends at least as close to its stage anchor as it was at k0, and some move.
    assert np.all(np.abs(chosen - anchor) <= np.abs(lat0 - anchor) + 1e-12)
    assert np.any(idx != inst.k0_index) and np.any(idx < inst.k0_index)


def test_bad_arguments():
    inst = make(SMALL[0], 0)
    with pytest.raises(ValueError, match="agg"):
        anchor_indices(inst, "median")
    with pytest.raises(ValueError, match="p must"):
        anchor_indices(inst, "mean", 1.5)
    with pytest.raises(ValueError, match="eps"):
        critical_path_indices(inst, -0.1)
