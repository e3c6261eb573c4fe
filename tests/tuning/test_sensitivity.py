"""Sensitivity-aware DST: same step time, at least the same kept pairs, more weighted pairs;
equal weights change nothing."""

import dataclasses

import numpy as np
import pytest
from tuning_cases import SEEDS, SMALL, make

from benchmarks.harness.synthetic_instances import random_instance
from sparsebalance.pairs import causal_pairs, kept_pairs
from sparsebalance.predictor import get_predictor
from sparsebalance.tuning import anchor_indices, critical_path_indices, instance_from_json, instance_to_json
from sparsebalance.tuning.critical_path import objective
from sparsebalance.tuning.from_predictor import build_instance
from sparsebalance.tuning.plan import make_plan
from sparsebalance.tuning.sensitivity import (
    budget_tables,
    loss_proxy,
    microbatch_weights,
    sensitivity_indices,
    sensitivity_plan,
    weighted_attention,
)


def _weights(inst, seed):
    return np.exp(np.random.default_rng(seed).normal(0.0, 1.2, (inst.dp, inst.microbatches)))


def _check(inst, base, w):
    out = sensitivity_indices(inst, base, w)
    t0, a0 = objective(inst, base)
    t, a = objective(inst, out)
    assert t <= t0 * (1 + 1e-9)
    assert a >= a0 * (1 - 1e-12)
    assert weighted_attention(inst, out, w) >= weighted_attention(inst, base, w)
    return out


def test_invariants(small):
    """Equal weights leave the plan exactly; any weights: never slower, never fewer kept
    pairs, never less weighted pairs (critical-path and anchor plans)."""
    for base in (critical_path_indices(small), anchor_indices(small)):
        for c in (1.0, 0.37):
            w = np.full((small.dp, small.microbatches), c)
            assert np.array_equal(sensitivity_indices(small, base, w), base)
        for seed in (0, 1):
            _check(small, base, _weights(small, seed))


@pytest.mark.parametrize("pp,dp,M", [(4, 2, 8), (4, 1, 16)])
def test_moves_budget_toward_sensitive_microbatches(pp, dp, M):
    """Not vacuous: on larger instances it changes budgets, gains weighted pairs and the
    budget it moves goes up where the weight is high."""
    gained = moved = 0
    for seed in SEEDS:
        inst = random_instance(seed, pp=pp, dp=dp, microbatches=M, k0=20,
                               levels=list(range(10, 41, 2)), seq_length=32768, mean_len=5000)
        w = _weights(inst, seed)
        base = critical_path_indices(inst)
        out = _check(inst, base, w)
        if weighted_attention(inst, out, w) > weighted_attention(inst, base, w) * (1 + 1e-6):
            gained += 1
            delta = (inst.budgets(out) - inst.budgets(base)).sum(axis=2)
            moved += float((delta * (np.log(w) - np.log(w).mean())).sum()) > 0
    assert gained >= 2 and moved == gained


def test_a_sensitive_microbatch_gains_and_never_loses():
    """Equal micro-batches but the first (longer documents: the straggler), one of them far
    more sensitive: its budget never drops, and the straggler's goes up when it is the
    sensitive one (budget moves off its equals at the same step time)."""
    pred = get_predictor("h100-analytic", num_layers=8, block_size=256)
    lengths = [[[30000, 2000]] + [[16000] for _ in range(7)]]
    inst = build_instance(pred, lengths, pp=4, k0=16, levels=list(range(8, 33)))
    base = critical_path_indices(inst)
    gains = []
    for hot in range(8):
        w = np.ones((1, 8))
        w[0, hot] = 10.0
        out = _check(inst, base, w)
        gains.append(int(inst.budgets(out)[0, hot].sum() - inst.budgets(base)[0, hot].sum()))
    assert min(gains) >= 0 and gains[0] > 0


def test_microbatch_weights_by_hand():
    lengths = [[[4096, 100], [4096]], [[512], [300, 4096]]]
    sens = [[[0.155, 0.5], [0.037]], [[0.1], [0.0, 0.073]]]
    w = microbatch_weights(lengths, sens, ref_topk=8, block_size=64)

    def per_pair(L, s):
        d = (causal_pairs(np.array(L)) - kept_pairs(np.array(L), 8, 64)).astype(float)
        return float((np.array(s) * np.array(L) * (d > 0)).sum() / d.sum())

    assert w[0, 0] == pytest.approx(per_pair([4096, 100], [0.155, 0.5]))  # the short one drops nothing
    assert w[0, 1] == pytest.approx(per_pair([4096], [0.037]))
    assert w[1, 1] == pytest.approx(per_pair([300, 4096], [0.0, 0.073]))
    # 512 tokens = 8 blocks: top-8 keeps it whole; it gets the others' mean
    assert w[1, 0] == pytest.approx(np.mean([w[0, 0], w[0, 1], w[1, 1]]))
    with pytest.raises(ValueError, match="sensitivities"):
        microbatch_weights([[[10, 20]]], [[[0.1]]], 8, 64)


def test_loss_proxy_and_policy_tables():
    inst = random_instance(2, pp=4, dp=1, microbatches=16, k0=20, levels=list(range(10, 41, 2)),
                           seq_length=32768, mean_len=5000)
    w = _weights(inst, 2)
    static = np.full((1, 16, 4), inst.k0_index)
    assert loss_proxy(inst, static, w, num_layers=8) == 0.0
    tabs = budget_tables(inst, w)
    assert set(tabs) == {"static", "slack-only", "sensitivity"}
    idx = {k: inst.indices(v) for k, v in tabs.items()}
    assert loss_proxy(inst, idx["sensitivity"], w, 8) <= loss_proxy(inst, idx["slack-only"], w, 8)
    plan = sensitivity_plan(inst, make_plan(inst, idx["slack-only"], "critical-path"), w)
    assert np.array_equal(plan.budget, tabs["sensitivity"])
    assert plan.policy in ("critical-path", "critical-path+sensitivity")


def test_instance_weight_json_and_checks():
    inst = make(SMALL[0], 0)
    w = _weights(inst, 0)
    back = instance_from_json(instance_to_json(dataclasses.replace(inst, weight=w)))
    assert np.allclose(back.weight, w)
    for bad in (np.ones((inst.dp, inst.microbatches + 1)), -np.ones((inst.dp, inst.microbatches))):
        with pytest.raises(ValueError, match="weight"):
            dataclasses.replace(inst, weight=bad)


def test_simulation_tool_on_the_fixture(tmp_path, capsys):
    import json

    from benchmarks.sensitivity_sim import main

    path = str(tmp_path / "study.json")
    assert main(["fixture", "--out", path, "--seed", "3"]) == 0
    study = json.load(open(path))
    assert study["fixture"].startswith("FIXTURE") and len({d["source"] for d in study["documents"]}) == 6
    assert main(["run", "--study", path, "--pp", "2", "--microbatches", "4", "--steps", "2"]) == 0
    res = json.loads(capsys.readouterr().out)["pp"]["2"]
    arms = res["arms"]
    assert arms["static"]["loss_vs_static_nats_per_token"] == 0.0
    for ref in ("slack-only", "slack-only+raise"):
        d = res[f"sensitivity_minus_{ref}"]
        assert d["step_ms_max_diff"] <= 1e-9 and d["kept_pairs_ratio"][0] >= 1 - 1e-12
    assert arms["sensitivity"]["step_ms"] <= arms["slack-only"]["step_ms"] * (1 + 1e-12)


def test_cli_sensitivity(tmp_path, capsys):
    import json

    from sparsebalance.tuning.__main__ import main

    inst = random_instance(2, pp=4, dp=1, microbatches=16, k0=20, levels=list(range(10, 41, 2)),
                           seq_length=32768, mean_len=5000)
    w = _weights(inst, 2)
    path = tmp_path / "inst.json"
    path.write_text(json.dumps(instance_to_json(dataclasses.replace(inst, weight=w))))
    assert main(["plan", "--instance", str(path), "--sensitivity", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = budget_tables(inst, w)["sensitivity"]
    assert np.array_equal(np.array(got["budget"]), want)
    path.write_text(json.dumps(instance_to_json(inst)))
    assert main(["plan", "--instance", str(path), "--sensitivity"]) == 2
    assert "weight" in capsys.readouterr().err


@pytest.mark.parametrize("tol", [0.0, 0.005, 0.02])
def test_at_equal_pairs_only_moves_pairs(tol):
    """``raise_first=False, pairs_tol``: never slower, kept pairs within ``tol`` of the
    plan's both ways, weighted pairs never fewer; and not vacuous at a usable tolerance."""
    moved = 0
    for seed in SEEDS:
        inst = random_instance(seed, pp=4, dp=2, microbatches=8, k0=20, levels=list(range(10, 41, 2)),
                               seq_length=32768, mean_len=5000)
        w = _weights(inst, seed)
        base = critical_path_indices(inst)
        out = sensitivity_indices(inst, base, w, raise_first=False, pairs_tol=tol)
        (t0, a0), (t, a) = objective(inst, base), objective(inst, out)
        assert t <= t0 * (1 + 1e-9)
        assert a0 * (1 - tol - 1e-9) <= a <= a0 * (1 + tol + 1e-9)
        assert weighted_attention(inst, out, w) >= weighted_attention(inst, base, w)
        moved += not np.array_equal(out, base)
    assert tol == 0.0 or moved >= 1
