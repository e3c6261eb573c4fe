"""DST budgets reach the attention modules through megatron-core's real schedules.

PP=2 over gloo, 1F1B and interleaved (VPP=2), ``--sparse-balance`` with the analytic
cost model (pure arithmetic, so it plans on CPU): every step each rank plans the
budget table ``[dp][microbatch][virtual stage]``; each SparseAttention call records
the top-k it used and the micro-batch it ran. The recorded top-k of every (step,
micro-batch, layer) must equal the plan's entry for that layer's virtual stage, and
the plan must really vary across micro-batches and stages (else the check is vacuous).
The same runs also check the ``--summary-json`` metrics and ``--sb-timeline`` files.
"""

import json
import os

import numpy as np
import pytest
from conftest import ROOT

from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

WORKER = os.path.join(ROOT, "tests", "training", "_sb_worker.py")
LAYERS, PP, M, STEPS = 4, 2, 4, 2
FLAGS = [*PROJECT_RUN_FLAGS, "--num-layers", str(LAYERS), "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "512", "--global-batch-size", str(M),
         "--lr", "1e-3", "--no-progress-bar", "--seed", "3", "--train-iters", str(STEPS),
         "--pipeline-model-parallel-size", str(PP),
         # block 32, top-4: documents longer than (4 + 2) x 32 tokens are sparse, so the
         # budget changes the work of most micro-batches of this corpus.
         "--sparse-balance", "--sb-block-size", "32", "--sb-topk", "4",
         "--sb-cost-model", "h100-analytic"]
LAYOUTS = {"pp2": [], "pp2_vpp2": ["--num-layers-per-virtual-pipeline-stage", "1"]}
SUMMARY_FIELDS = ("iterations", "tokens", "step_ms_median", "step_ms_all", "tokens_per_s",
                  "loss_first", "loss_last", "density_mean", "imbalance_mean", "bubble_fraction",
                  "predicted_step_ms_median", "args")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, long_corpus, tmp_path_factory, world):
    root = tmp_path_factory.mktemp(request.param)
    dump, summary, tl = str(root / "dump"), str(root / "summary.json"), str(root / "tl")
    proc = world.launch(WORKER, [*FLAGS, *LAYOUTS[request.param], "--data-path", long_corpus,
                                 "--summary-json", summary, "--sb-timeline", tl], nproc=2,
                        extra_env={"SB_TEST_DUMP": dump})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.load(open(os.path.join(dump, f"rank{r}.json"))) for r in range(2)]
    vpp = 2 if request.param == "pp2_vpp2" else 1
    return {"ranks": ranks, "vpp": vpp, "summary": summary, "timeline": tl, "proc": proc}


def test_attention_used_the_planned_budget(run):
    vpp = run["vpp"]
    per_stage = LAYERS // (PP * vpp)
    plans = []
    for rank in run["ranks"]:
        assert len(rank["steps"]) == STEPS
        my_layers = [layer for layer in range(1, LAYERS + 1)
                     if ((layer - 1) // per_stage) % PP == rank["pp_rank"]]
        for step in rank["steps"]:
            budget = np.array(step["budget"])
            assert budget.shape == (1, M, PP * vpp)
            plans.append(budget)
            seen = {}
            for layer, mb, topk in step["records"]:
                stage = (layer - 1) // per_stage
                assert stage % PP == rank["pp_rank"], (layer, rank["pp_rank"])
                assert topk == budget[rank["dp_rank"], mb, stage], (step["iteration"], layer, mb)
                seen[(layer, mb)] = seen.get((layer, mb), 0) + 1
            # every layer of this rank ran every micro-batch exactly once
            assert seen == {(layer, m): 1 for layer in my_layers for m in range(M)}
    # both ranks planned the same table without communicating
    for a, b in zip(run["ranks"][0]["steps"], run["ranks"][1]["steps"]):
        assert a["budget"] == b["budget"]
    # guard against a vacuous pass: budgets differ across micro-batches and across stages
    allp = np.stack(plans)
    assert any(len(np.unique(p[0, :, s])) > 1 for p in plans for s in range(p.shape[2]))
    assert any((p[0, m, :] != p[0, m, 0]).any() for p in plans for m in range(M))
    assert len(np.unique(allp)) >= 3


def test_summary_json_has_the_metrics(run):
    s = json.load(open(run["summary"]))
    assert [f for f in SUMMARY_FIELDS if f not in s] == []
    assert s["iterations"] == STEPS and len(s["step_ms_all"]) == STEPS
    assert s["tokens"] > 0 and s["tokens_per_s"] > 0 and s["step_ms_median"] > 0
    assert 0.0 < s["density_mean"] < 1.0  # sparse attention kept a fraction of the pairs
    assert s["imbalance_mean"] >= 1.0
    assert len(s["bubble_fraction"]) == PP and all(0.0 <= b < 1.0 for b in s["bubble_fraction"])
    assert s["predicted_step_ms_median"] > 0
    assert s["args"]["sb_batching"] == "sab" and s["args"]["sb_dst"] == "critical-path"
    assert s["args"]["sparse_attention"] is True
    assert np.isfinite([s["loss_first"], s["loss_last"]]).all()
    log = [ln for ln in run["proc"].stdout.splitlines() if ln.startswith("iter ")]
    assert len(log) == STEPS and all("plan" in ln and "pack" in ln and "imbalance" in ln for ln in log)


def test_timeline_files_replay(run):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from timeline import load_timeline

    names = sorted(os.listdir(run["timeline"]))
    assert f"step_{STEPS:07d}.png" in names
    for it in range(1, STEPS + 1):
        for kind in ("measured", "predicted"):
            res = load_timeline(os.path.join(run["timeline"], f"step_{it:07d}.{kind}.json"))
            assert res.pp == PP and res.vpp == run["vpp"] and res.num_microbatches == M
            assert res.step_ms > 0
