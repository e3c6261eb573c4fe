"""benchmarks/real_accuracy.py's threshold arm of ``equal_step_time`` (issue 59 item 3): DST's TAU levels,
priced by SAB's density estimator, at static threshold routing's planned step time. The arm's per-layer
TAU, the plan on SmolLM2-135M's shape (planning only), the density study's checks, and the harness end
to end on a tiny GGUF converted by convert.py gguf-to-megatron (no download)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from test_real_accuracy_sens import LENGTHS, VOCAB

from benchmarks import real_accuracy as R
from benchmarks.harness.compare.real_arms import Arm, arm_pairs
from sparsebalance.batching.density_feedback import ThresholdDensity
from sparsebalance.batching.sparsity_estimator import SparsityEstimator
from sparsebalance.config import default_ladder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tests", "checkpoint")]


def test_arm_takes_its_stage_tau_per_layer_and_routing_tells_equal_forwards():
    taus = np.array([[0.8, 0.97], [0.9, 0.9]])
    arm = Arm("t", topk=16, stage_taus=taus, topk_min=4)
    static = Arm("threshold", topk=16, threshold=0.9, topk_min=4)
    # 5 layers over 2 stages: the first stage takes the extra layer
    assert [arm.tau(0, layer, 5) for layer in range(1, 6)] == [0.8, 0.8, 0.8, 0.97, 0.97]
    assert arm.budget(0, 1, 5) == 16 and static.tau(1, 3, 5) == 0.9
    assert arm.routing(1, 5) == static.routing(1, 5) and arm.routing(0, 5) != static.routing(0, 5)
    assert Arm("k8", topk=8).routing(0, 5) != static.routing(0, 5)  # top-k 8 is not a cap of 8 under TAU
    with pytest.raises(ValueError, match="content"):
        arm_pairs(arm, [[512]], 64, 5, 9)
    cores = [SimpleNamespace(layer_number=n, topk=None, rule=None) for n in range(1, 6)]
    R.set_arm(cores, arm, 0)
    assert [c.rule.threshold for c in cores] == [0.8, 0.8, 0.8, 0.97, 0.97]
    assert all(c.topk == 16 and c.rule.topk_min == 4 for c in cores)
    R.set_arm(cores, Arm("k8", topk=8), 0)
    assert all(c.topk == 8 and c.rule is None for c in cores)


def _packing(lengths):
    return SimpleNamespace(ranks=[[[(100 * m + j, 0, n) for j, n in enumerate(mb)] for m, mb in enumerate(lengths)]])


@pytest.mark.parametrize("pp", [4, 8])
def test_tau_plan_fits_static_step_and_keeps_more(args, pp):
    density = ThresholdDensity(SparsityEstimator(prior=0.45), block_size=args.block_size, topk_min=args.topk // 2,
                               tau0=args.threshold)
    p = R.equal_time_tau_plan(args, VOCAB, LENGTHS, pp, density, _packing(LENGTHS))
    assert p["step_ms"] <= p["static_step_ms"] * (1 + 1e-9)
    t = np.asarray(p["tau"])
    assert t.shape == (len(LENGTHS), pp) and set(np.unique(t)) <= set(p["taus"])
    assert tuple(p["taus"]) == default_ladder(0.9) and p["cap"] == 16 and p["topk_min"] == 4
    # the output layer makes the last stage critical: the others have float, TAU rises there
    assert p["planned_attn"] > p["static_planned_attn"] * 1.01 and t[:, :-1].max() > 0.9
    assert p["predicted_density_tau0"] == pytest.approx([0.45] * sum(map(len, LENGTHS)))


def test_tau_plan_is_static_when_every_level_keeps_the_same(args):
    # every document at density 1 is clipped at the cap at every TAU: no level adds a pair
    density = ThresholdDensity(SparsityEstimator(prior=1.0), block_size=args.block_size, tau0=args.threshold)
    p = R.equal_time_tau_plan(args, VOCAB, LENGTHS, 4, density, _packing(LENGTHS))
    assert p["planned_attn"] == pytest.approx(p["static_planned_attn"]) and p["step_ms"] <= p["static_step_ms"]


def test_density_study_needs_documents_at_tau0_with_the_run_blocks(tmp_path, capsys):
    path = tmp_path / "s.json"
    doc = {"source": "code", "length": 512, "densities": {"0.8": {"per_head": 0.3}, "0.9": {"per_head": 0.4}}}
    path.write_text(json.dumps({"config": {"block_size": 64}, "documents": [doc]}))
    assert R.read_density_study(str(path), 0.9, 64)[0]["_density"] == 0.4
    for tau, block, why in ((0.95, 64, "no documents with a length and a per-head density at TAU 0.95"),
                            (0.9, 32, "blocks of 64 tokens, not --block-size 32")):
        with pytest.raises(SystemExit) as e:
            R.read_density_study(str(path), tau, block)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1
    path.write_text("{")
    with pytest.raises(SystemExit):
        R.read_density_study(str(path), 0.9, 64)
    assert "is not JSON" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, world):
    """A tiny GGUF converted in the warm world, a corpus in its tokens (made there too: megatron-core is
    loaded already) and a density study at TAU 0.9."""
    from _gguf_models import converted_tiny_model

    d = tmp_path_factory.mktemp("tau")
    converted_tiny_model(world, str(d))
    p = world.launch(os.path.join(REPO, "benchmarks", "make_real_corpus.py"),
                     ["--tokenizer-model", str(d / "ckpt" / "hf"), "--output-prefix", str(d / "corpus"),
                      "--num-docs", "12", "--min-length", "160", "--max-length", "512", "--quantiles", "0.05,0.5",
                      "--sources", "code,csv,json,repeat"], timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    docs = [{"source": s, "length": n, "compression_ratio": 0.3,
             "densities": {"0.9": {"per_head": dn}, "0.95": {"per_head": dn + 0.1}}}
            for s, n, dn in (("code", 256, 0.3), ("csv", 512, 0.25), ("json", 256, 0.35), ("repeat", 512, 0.2))]
    (d / "study.json").write_text(json.dumps({"tau": 0.9, "config": {"block_size": 32}, "documents": docs}))
    return d


def test_equal_step_time_threshold_cell_end_to_end(tiny, tmp_path, world):
    out = tmp_path / "acc.json"
    p = world.launch(os.path.join(REPO, "benchmarks", "real_accuracy.py"),
                     ["--load", str(tiny / "ckpt"), "--data-path", str(tiny / "corpus"), "--seq-length", "512",
                      "--num-microbatches", "4", "--pp", "2", "--block-size", "32", "--topk", "2",
                      "--threshold-cap", "16", "--num-samples", "0", "--density-study", str(tiny / "study.json"),
                      "--threads", "1", "--out", str(out)], timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    short = json.loads(p.stdout.strip().splitlines()[-1])
    rep = json.loads(out.read_text())
    # the shape, nothing more in the short report
    assert short["equal_step_time"] == rep["equal_step_time"] and set(rep["equal_step_time"]) == {"pp2"}
    for routing in ("topk", "threshold"):
        cell = rep["equal_step_time"]["pp2"][routing]
        assert set(cell) == {"loss_minus_static", "pairs_over_static"}
        lo, med, hi = cell["loss_minus_static"]
        assert lo <= med <= hi and cell["pairs_over_static"] > 0
    loss = rep["loss"]
    arms, full = loss["arms"], loss["equal_step_time"]["pp2"]["threshold"]
    tau_arm = arms["sparsebalance-pp2-tau-eqtime"]
    assert full["pairs_over_static"] == pytest.approx(tau_arm["kept_pairs"] / arms["threshold"]["kept_pairs"])
    plan = loss["plans"]["sparsebalance-pp2-tau-eqtime"]
    assert plan["step_ms"] <= plan["static_step_ms"] * (1 + 1e-9)
    assert plan["planned_attn"] >= plan["static_planned_attn"]
    t = np.asarray(plan["tau"])
    assert t.shape == (4, 2) and set(np.unique(t)) <= set(plan["taus"]) and plan["tau0"] == 0.9
    d = np.asarray(tau_arm["loss"]) - np.asarray(arms["threshold"]["loss"])
    np.testing.assert_allclose(full["per_microbatch"], d)
    # a micro-batch planned at TAU0 in every stage is the static forward; one planned at other TAUs is
    # another forward (the TAU reaches the kernels: with a cap of every block, the random model's counts move)
    moved = ~np.all(t == 0.9, axis=1)
    assert moved.any() and np.all(d[~moved] == 0) and np.all(d[moved] != 0)
    assert plan["cap"] == 16 and plan["topk_min"] == 1
    assert rep["loss"]["threshold_density"]["documents"] == 4 and rep["config"]["density_study"].endswith("study.json")
