"""Simulation mode: shape of the results, internal consistency of the ratios, guarantees
the planners give (DST with attention slack 0 never loses attention nor time)."""

import numpy as np
import pytest

from benchmarks.harness.compare.cluster_sim import SIM_ARMS, SimConfig, dominance, simulate_cell
from benchmarks.harness.compare.summary import build_summary, check_summary

SMALL = (("num_layers", 4), ("hidden_size", 256), ("num_attention_heads", 4),
         ("num_query_groups", 4), ("ffn_hidden_size", 1024), ("vocab_size", 1000))


def _lengths(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, 1.0, size=3000), 16, 6000).astype(np.int64)


@pytest.fixture(scope="module", params=[0, 1])
def cell(request):
    cfg = SimConfig(pp=2, dp=2, micro_batches=4, steps=3, block_size=64, topk=8, model=SMALL)
    return simulate_cell(_lengths(request.param), 4096, cfg).table


def test_every_arm_and_frontier_point_present(cell):
    assert list(cell["arms"]) == list(SIM_ARMS)
    fams = [p["family"] for p in cell["frontier"].values()]
    assert fams.count("anchor") == 4 and fams.count("critical-path") == 4
    assert set(cell["anchor_dominated_by"]) == {n for n, p in cell["frontier"].items()
                                                 if p["family"] == "anchor"}


def test_packer_and_planner_agree_on_static_step(cell):
    assert cell["packer_vs_instance_max_rel_err"] < 1e-9


def test_ratios_are_consistent(cell):
    base = cell["arms"]["megatron"]
    assert base["speedup_vs_megatron"] == pytest.approx(1.0)
    for name, r in list(cell["arms"].items()) + list(cell["frontier"].items()):
        assert r["tokens"] > 0, name
        assert r["speedup_vs_megatron"] == pytest.approx(r["tokens_per_ms"] / base["tokens_per_ms"])
        assert r["ms_per_ktok"] * r["tokens_per_ms"] == pytest.approx(1e3)
        assert r["vs_lower_bound"] == pytest.approx(r["ms_per_ktok"] / r["lower_bound_ms_per_ktok"])
        assert 0 < r["density"] <= 1.0
        assert len(r["bubble_fraction"]) == 2
        assert all(0 <= b < 1 for b in r["bubble_fraction"])


def test_static_arms_keep_attention_and_dst_slack0_never_loses(cell):
    a = cell["arms"]
    for name in ("megatron", "sab", "wlb"):
        assert a[name]["retained_vs_static"] == pytest.approx(1.0)
    # eps = 0: never below the static plan's attention, never slower than it (same packing).
    assert a["sparsebalance"]["retained_vs_static"] >= 1.0 - 1e-9
    assert a["dst"]["retained_vs_static"] >= 1.0 - 1e-9
    assert a["dst"]["step_ms"] <= a["megatron"]["step_ms"] * (1 + 1e-9)
    assert a["sparsebalance"]["step_ms"] <= a["sab"]["step_ms"] * (1 + 1e-9)
    # Same packing -> same tokens and the same lower bound.
    assert a["dst"]["tokens"] == a["megatron"]["tokens"]
    assert a["sparsebalance"]["lower_bound_ms_per_ktok"] == pytest.approx(
        a["sab"]["lower_bound_ms_per_ktok"])
    # The frontier's eps=0 and p=0.1 points are the main arms.
    assert cell["frontier"]["critical-path-eps0"]["step_ms"] == pytest.approx(
        a["sparsebalance"]["step_ms"])
    assert cell["frontier"]["anchor-p0.1"]["step_ms"] == pytest.approx(
        a["sparsebalance-anchor"]["step_ms"])


def test_critical_path_slack_is_respected(cell):
    for n, p in cell["frontier"].items():
        if p["family"] == "critical-path":
            assert p["retained_vs_static"] >= 1.0 - p["param"] - 1e-9, n


def test_summary_shape(cell):
    s = build_summary(None, {"synthetic": {"4096": cell}})
    check_summary(s)
    assert s["arms"] == {} and s["validation"] == {} and s["speedup_vs_megatron"] == {}
    assert s["sim"]["synthetic"]["4096"] == {n: r["step_ms"] for n, r in cell["arms"].items()}


def test_dominance():
    pts = {"a1": {"family": "anchor", "tokens_per_ms": 1.0, "retained_vs_static": 0.9},
           "a2": {"family": "anchor", "tokens_per_ms": 1.3, "retained_vs_static": 0.8},
           "c1": {"family": "critical-path", "tokens_per_ms": 1.1, "retained_vs_static": 1.0},
           "c2": {"family": "critical-path", "tokens_per_ms": 1.2, "retained_vs_static": 0.95}}
    assert dominance(pts) == {"a1": "c2", "a2": None}


def test_context_parallel_cell():
    """CP=2 (the paper's SP2): the same packers and planners on the CP-aware predictor.
    Packer and planner still agree, every op is cheaper than at CP=1 but more than half
    (exchange, per-layer constants), and the planners' guarantees hold."""
    from dataclasses import replace

    # the predictor's default layer (Qwen2.5-0.5B-like), 4 layers, documents up to 30K
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7.5, 1.0, size=3000), 16, 30000).astype(np.int64)
    base = SimConfig(pp=2, dp=2, micro_batches=4, steps=2, block_size=256, topk=8,
                     model=(("num_layers", 4),))
    one = simulate_cell(lengths, 16384, base).table
    two = simulate_cell(lengths, 16384, replace(base, cp=2)).table
    assert two["packer_vs_instance_max_rel_err"] < 1e-9
    assert list(two["arms"]) == list(SIM_ARMS)
    m1, m2 = one["arms"]["megatron"], two["arms"]["megatron"]
    assert m1["tokens"] == m2["tokens"]  # megatron's packing does not depend on costs
    assert 0.5 < m2["step_ms"] / m1["step_ms"] < 0.6
    # a tiny layer at 4K tokens: the per-layer overheads dominate, CP=2 does not pay
    tiny = SimConfig(pp=2, dp=2, micro_batches=4, steps=1, block_size=64, topk=8, model=SMALL)
    assert (simulate_cell(_lengths(0), 4096, replace(tiny, cp=2)).table["arms"]["megatron"]["step_ms"]
            > simulate_cell(_lengths(0), 4096, tiny).table["arms"]["megatron"]["step_ms"])
    a = two["arms"]
    assert a["sparsebalance"]["retained_vs_static"] >= 1.0 - 1e-9
    assert a["sparsebalance"]["step_ms"] <= a["sab"]["step_ms"] * (1 + 1e-9)
    # attention retained is the whole model's, not one rank's
    assert a["megatron"]["density"] == pytest.approx(m1["density"])
    with pytest.raises(ValueError, match="cp"):
        SimConfig(cp=0)


@pytest.mark.parametrize("kw", [dict(pp=0), dict(steps=0), dict(micro_batches=2, pp=4)])
def test_bad_config(kw):
    with pytest.raises(ValueError):
        SimConfig(**kw)


def test_too_few_steps_in_file():
    cfg = SimConfig(pp=2, dp=2, micro_batches=4, steps=50, block_size=64, topk=8, model=SMALL)
    with pytest.raises(ValueError, match="steps"):
        simulate_cell(_lengths(0)[:200], 4096, cfg)


def test_gantt_is_per_thousand_tokens():
    """The Gantt steps are the table's ms per 1,000 tokens (one step: the same step)."""
    cfg = SimConfig(pp=2, dp=2, micro_batches=4, steps=1, block_size=64, topk=8, model=SMALL)
    res = simulate_cell(_lengths(0), 4096, cfg, frontier=False)
    for arm in ("megatron", "sparsebalance"):
        assert res.gantt[arm].step_ms == pytest.approx(res.table["arms"][arm]["ms_per_ktok"])
    assert res.table["arms"]["megatron"]["tokens"] != res.table["arms"]["sparsebalance"]["tokens"]
