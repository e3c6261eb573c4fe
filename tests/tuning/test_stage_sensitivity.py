"""Stage-aware DST: a stage profile steers which stage a refinement cuts and which it raises, at
the plan's step time and (within the tolerance) its kept pairs; the profile file's checks."""

import json

import numpy as np
import pytest

from sparsebalance.predictor import get_predictor
from sparsebalance.tuning import critical_path_indices, instance_from_json, instance_to_json
from sparsebalance.tuning.critical_path import objective
from sparsebalance.tuning.from_predictor import build_instance
from sparsebalance.tuning.sensitivity import loss_proxy, sensitivity_indices, weighted_attention
from sparsebalance.tuning.stage_sensitivity import op_weights, parse_stage_profile, read_stage_profile

TOL = 0.005  # benchmarks/real_accuracy.py's SENS_PAIRS_TOL
# One PP=4 step whose critical-path plan cuts the last stage (it holds the output layer and loss)
# to the least budget and raises the others: the shape of the real SmolLM2 plans.
LENGTHS = [[[26000], [9000, 14000], [29000], [20000], [7000, 7000], [25000, 3000], [12000], [28000]]]


@pytest.fixture(scope="module")
def case():
    pred = get_predictor("h100-analytic", num_layers=8, block_size=256)
    inst = build_instance(pred, LENGTHS, pp=4, k0=16, levels=list(range(8, 33)))
    return inst, critical_path_indices(inst)


def _refine(inst, base, stage_w, **kw):
    return sensitivity_indices(inst, base, op_weights(np.asarray(stage_w, dtype=float), 1, 8), **kw)


@pytest.mark.parametrize("hot", [0, 3])
def test_budget_moves_to_the_sensitive_stage_at_equal_step_time_and_pairs(case, hot):
    """At equal planned step time and kept pairs (within TOL), a profile that says stage ``hot``
    pays 4x per dropped pair moves levels into ``hot`` from the other stages; with the last stage
    hot that is the opposite of slack-only DST, which cuts it (fails when the per-stage weight is
    ignored or rejected)."""
    inst, base = case
    w = np.ones(4)
    w[hot] = 4.0
    out = _refine(inst, base, w, raise_first=False, pairs_tol=TOL)
    (t0, a0), (t, a) = objective(inst, base), objective(inst, out)
    assert t <= t0 * (1 + 1e-9)  # never a slower step
    assert abs(a / a0 - 1) <= TOL + 1e-9  # equal kept pairs
    ow = op_weights(w, 1, 8)
    assert weighted_attention(inst, out, ow) > weighted_attention(inst, base, ow)
    assert loss_proxy(inst, out, ow, 8) < loss_proxy(inst, base, ow, 8)
    per_stage = (inst.budgets(out) - inst.budgets(base))[0].sum(axis=0)
    assert per_stage[hot] > 0 and all(per_stage[s] <= 0 for s in range(4) if s != hot), per_stage
    if hot == 3:  # the slack-only plan cut the last stage: the profile raises it back
        assert inst.budgets(base)[0, :, 3].mean() < inst.budgets(base)[0, :, :3].mean()


def test_equal_stage_weights_change_nothing(case):
    inst, base = case
    for c in (1.0, 0.25):
        assert np.array_equal(_refine(inst, base, [c] * 4), base)
        assert np.array_equal(_refine(inst, base, [c] * 4, raise_first=False, pairs_tol=TOL), base)


def test_driver_refinement_never_slower_never_fewer_pairs(case):
    """The driver's refinement (raise into the float first, pairs floor): the same guarantees
    with a per-op weight as with a per-micro-batch one."""
    inst, base = case
    for w in ([1, 1, 1, 4.0], [4.0, 1, 1, 1], [0.0, 1, 2, 3]):
        out = _refine(inst, base, w)
        (t0, a0), (t, a) = objective(inst, base), objective(inst, out)
        assert t <= t0 * (1 + 1e-9) and a >= a0 * (1 - 1e-12)


def test_op_weights_and_instance_check():
    w = op_weights(np.array([1.0, 3.0]), 2, 3, np.array([[1.0, 2.0, 0.5], [1.0, 1.0, 4.0]]))
    assert w.shape == (2, 3, 2)
    assert np.allclose(w[1, 2], [4.0, 12.0]) and np.allclose(w[0, 1], [2.0, 6.0])
    assert np.allclose(op_weights(np.array([1.0, 3.0]), 1, 2), [[[1, 3], [1, 3]]])
    pred = get_predictor("h100-analytic", num_layers=8, block_size=256)
    with pytest.raises(ValueError, match=r"\[dp, microbatch, stage\]"):
        build_instance(pred, [[[9000], [4000]]], pp=2, k0=16, weight=np.ones((1, 2, 3)))


def test_per_op_weight_survives_the_instance_json(case):
    inst, base = case
    w = op_weights(np.array([1.0, 1.0, 1.0, 4.0]), 1, 8)
    back = instance_from_json(instance_to_json(instance_from_json({**instance_to_json(inst), "weight": w.tolist()})))
    assert back.weight.shape == (1, 8, 4) and np.array_equal(back.weight, w)
    assert np.array_equal(sensitivity_indices(back, base, raise_first=False, pairs_tol=TOL),
                          _refine(inst, base, w[0, 0], raise_first=False, pairs_tol=TOL))


def _profile(**over):
    d = {"format": "sb-stage-sensitivity", "version": 1, "num_layers": 30,
         "profiles": [{"stages": 4, "nats_per_pair": [1e-8, 2e-8, -1e-9, 5e-8],
                       "layer_ranges": [[1, 8], [9, 16], [17, 23], [24, 30]]},
                      {"stages": 2, "nats_per_pair": [1.0, 3.0]}]}
    d.update(over)
    return d


def test_profile_weights():
    p = parse_stage_profile(_profile())
    w = p.weights(4, 30, [8, 8, 7, 7])
    assert w.mean() == pytest.approx(1.0) and w[2] == 0.0  # a negative measurement counts as 0
    assert np.allclose(w / w[0], [1, 2, 0, 5])
    assert np.allclose(p.weights(2), [0.5, 1.5])
    with pytest.raises(ValueError, match="30-layer model, this one has 32"):
        p.weights(4, 32)
    with pytest.raises(ValueError, match="no 8-stage split"):
        p.weights(8, 30)
    with pytest.raises(ValueError, match=r"split the layers \[8, 8, 7, 7\], this run \[8, 7, 8, 7\]"):
        p.weights(4, 30, [8, 7, 8, 7])


@pytest.mark.parametrize("over,match", [
    ({"format": "other"}, "not a stage profile"),
    ({"num_layers": "30"}, "num_layers"),
    ({"profiles": []}, "non-empty"),
    ({"profiles": [{"stages": 2, "nats_per_pair": [1.0]}]}, "2-stage profile must have 2"),
    ({"profiles": [{"stages": 2, "nats_per_pair": [-1.0, 0.0]}]}, "no stage with a positive"),
    ({"profiles": [{"stages": 2, "nats_per_pair": ["a", 1]}]}, "list of numbers"),
    ({"profiles": [{"stages": 0, "nats_per_pair": []}]}, "'stages' must be an integer >= 1"),
    ({"profiles": [{"stages": 1, "nats_per_pair": [1.0]}] * 2}, "a second 1-stage profile"),
    ({"profiles": [{"stages": 2, "nats_per_pair": [1.0, 1.0], "layer_ranges": [[1, 2]]}]}, "layer_ranges"),
])
def test_profile_bad_input(over, match):
    with pytest.raises(ValueError, match=match):
        parse_stage_profile(_profile(**over))


def test_read_profile_file(tmp_path):
    good = tmp_path / "p.json"
    good.write_text(json.dumps(_profile()))
    assert read_stage_profile(str(good)).num_layers == 30
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not JSON"):
        read_stage_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"none\.json: cannot read it"):
        read_stage_profile(str(tmp_path / "none.json"))
