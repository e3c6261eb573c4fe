"""Real-run plumbing that needs no launch: arm flags, run order, pooling of summaries."""

import numpy as np
import pytest

from benchmarks.harness.compare.arms import ABLATIONS, ARMS, FRONTIER, SIM_ONLY, get_arm
from benchmarks.harness.compare.real import RealConfig, RunResult, measured_steps, pool, run_order
from benchmarks.harness.compare.summary import build_summary, check_summary


@pytest.mark.parametrize("name", list(ARMS) + list(FRONTIER) + list(ABLATIONS))
def test_driver_flags_select_the_arm(name):
    """Every arm's flags parse with pretrain_gpt.py's own parser and mean what the arm says."""
    from megatron.training.arguments import build_parser

    arm = get_arm(name)
    a = build_parser().parse_args(["--sb-topk", "12", *arm.driver_flags(12)])
    assert a.sparse_attention == arm.sparse
    assert a.sb_batching == arm.batching
    if arm.sparse:
        assert a.sb_dst == arm.dst
    if arm.dst == "anchor":
        assert a.sb_anchor == "mean" and a.sb_p == pytest.approx(arm.param)
    if arm.dst == "critical-path":
        assert a.sb_attn_slack == pytest.approx(arm.param)
    assert a.sb_plan_ahead == arm.plan_ahead
    assert a.sb_topk_min == (12 if arm.no_cut else None)


def test_no_cut_arm_needs_the_run_s_topk():
    with pytest.raises(ValueError, match="sparsebalance-nocut"):
        get_arm("sparsebalance-nocut").driver_flags()


def test_main_arms_are_the_issue_s():
    assert list(ARMS) == ["dense", "megatron", "sab", "dst", "sparsebalance",
                          "sparsebalance-anchor", "wlb", "dp-balanced"]
    flags = ARMS["dp-balanced"].driver_flags()
    assert flags[flags.index("--sb-batching") + 1] == "dp-balanced"
    # Dynamic CP exists only in the simulation: the real runs cannot select it.
    for name in SIM_ONLY:
        with pytest.raises(ValueError, match="arm"):
            get_arm(name)
    assert (ARMS["sparsebalance"].batching, ARMS["sparsebalance"].dst,
            ARMS["sparsebalance"].param) == ("sab", "critical-path", 0.0)
    assert (ARMS["sparsebalance-anchor"].dst, ARMS["sparsebalance-anchor"].param) == ("anchor", 0.1)
    with pytest.raises(ValueError, match="arm"):
        get_arm("nope")


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_run_order(rounds):
    arms = ["megatron", "sab", "sparsebalance", "wlb"]
    order = run_order(arms, rounds)
    if rounds == 1:
        assert order[0] == ("megatron", 0) and order[-1] == ("megatron", 1)
        assert sorted(a for a, _ in order[1:-1]) == sorted(arms[1:])
    else:
        for a in arms:
            assert [k for b, k in order if b == a] == list(range(rounds))
        # Alternating order: mean launch position is the same for every arm (ABBA) when even.
        if rounds % 2 == 0:
            pos = {a: np.mean([i for i, (b, _) in enumerate(order) if b == a]) for a in arms}
            assert len(set(np.round(list(pos.values()), 9))) == 1


def _summary(steps, tps, pred, skip=2, loss=3.0):
    return {"step_ms_all": steps, "warmup_steps_skipped": skip, "tokens_per_s": tps,
            "loss_first": 5.0, "loss_last": loss, "density_mean": 0.5, "imbalance_mean": 1.2,
            "bubble_fraction": [0.1, 0.2], "predicted_step_ms_median": pred,
            "plan_ms_median": 1.0, "pack_ms_median": 2.0}


def test_pool_pools_counted_steps_and_weights_throughput():
    r1 = RunResult("x", 0, "cmd", 0, 1.0, _summary([999, 999, 100, 100, 100], 1000.0, 110.0))
    r2 = RunResult("x", 1, "cmd", 0, 1.0, _summary([999, 999, 300, 300, 300], 3000.0, 110.0))
    bad = RunResult("x", 2, "cmd", 1, 1.0, None, "boom")
    p = pool([r1, r2, bad])
    assert p["measured_steps"] == 6 and p["runs"] == 2
    assert p["step_ms"] == pytest.approx(200.0)  # median of 100 x3, 300 x3
    # tokens: 1000/s * 0.3 s + 3000/s * 0.9 s over 1.2 s
    assert p["tokens_per_s"] == pytest.approx((300 + 2700) / 1.2)
    assert p["validation"] == pytest.approx((110.0 - 200.0) / 200.0)
    assert pool([bad]) is None


def test_real_summary_shape():
    p = pool([RunResult("m", 0, "c", 0, 1.0, _summary([9, 9] + [100] * 20, 1000.0, 105.0))])
    q = pool([RunResult("s", 0, "c", 0, 1.0, _summary([9, 9] + [80] * 20, 1300.0, None))])
    s = build_summary({"arms": {"megatron": p, "sparsebalance": q}}, None)
    check_summary(s)
    assert s["speedup_vs_megatron"] == {"megatron": 1.0, "sparsebalance": pytest.approx(1.3)}
    assert set(s["validation"]) == {"megatron"}


def test_real_config_checks():
    assert measured_steps(RealConfig(iters=23)) == 21
    assert measured_steps(RealConfig(iters=33)) == 30
    with pytest.raises(ValueError):
        RealConfig(ranks=1)
    with pytest.raises(ValueError):
        RealConfig(ranks=4, micro_batches=2)
    assert "--sb-topk" in RealConfig().model_flags()


def test_pairs_recomputed_from_saved_runs():
    """``--mode report`` recomputes the PAIRS ratios from real.json's run summaries."""
    from benchmarks.harness.compare.campaign import pairs_of_real

    def run(arm, repeat, ms, tokens):
        return {"arm": arm, "repeat": repeat, "summary": {
            "warmup_steps_skipped": 1, "step_ms_all": [999.0] + [ms] * 4,
            "step_tokens_all": [1] + [tokens] * 4}}

    # per round: sparsebalance trains 1.2x anchor's tokens per ms, then 1.1x, then 1.0x
    runs = [run("sparsebalance-anchor", k, 100.0, 1000) for k in range(3)]
    runs += [run("sparsebalance", k, 100.0, t) for k, t in enumerate((1200, 1100, 1000))]
    runs.append({"arm": "sab", "repeat": 0, "summary": None})  # a failed run is skipped
    pairs = pairs_of_real({"config": {"rounds": 3}, "runs": runs})
    assert set(pairs) == {"sparsebalance/sparsebalance-anchor"}
    p = pairs["sparsebalance/sparsebalance-anchor"]
    assert p["median"] == pytest.approx(1.1) and p["per_round"] == pytest.approx([1.2, 1.1, 1.0])
    assert p["ci95"][0] >= 1.0 - 1e-12 and p["ci95"][1] <= 1.2 + 1e-12
    assert "anchor" in p["isolates"]
