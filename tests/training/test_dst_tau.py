"""DST's TAU levels under threshold routing reach the kernels through megatron-core's real 1F1B
schedule (PP=2 over gloo, ``--sparse-balance --sb-routing threshold``, the analytic cost model):
every step plans a TAU per (micro-batch, stage) from the ladder, every attention call routes at
its micro-batch's TAU for its stage (the cap staying ``--sb-topk``), and the step's recorded
table and timeline show the TAU levels. Flag errors of the ladder are one line."""

import json
import os

import numpy as np
import pytest
from conftest import ROOT, TINY

from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

WORKER = os.path.join(ROOT, "tests", "training", "_sb_worker.py")
LAYERS, PP, M, STEPS = 4, 2, 4, 3
TAUS = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97)  # the default ladder at TAU 0.9
FLAGS = [*PROJECT_RUN_FLAGS, "--num-layers", str(LAYERS), "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "512", "--global-batch-size", str(M),
         "--lr", "1e-3", "--no-progress-bar", "--seed", "3", "--train-iters", str(STEPS),
         "--pipeline-model-parallel-size", str(PP),
         # block 16, cap 32: a 512-token item has at most 32 blocks, so the cap never binds and
         # every routed block's count is the TAU's
         "--sparse-balance", "--sb-routing", "threshold", "--sb-threshold", "0.9", "--sb-block-size", "16",
         "--sb-topk", "32", "--sb-topk-min", "0", "--sb-cost-model", "h100-analytic"]


@pytest.fixture(scope="module")
def run(long_corpus, tmp_path_factory, world):
    root = tmp_path_factory.mktemp("tau")
    dump, tl = str(root / "dump"), str(root / "tl")
    proc = world.launch(WORKER, [*FLAGS, "--data-path", long_corpus, "--sb-timeline", tl], nproc=2,
                        extra_env={"SB_TEST_DUMP": dump})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"ranks": [json.load(open(os.path.join(dump, f"rank{r}.json"))) for r in range(2)], "timeline": tl}


def test_attention_routed_at_the_planned_tau(run):
    per_stage = LAYERS // PP
    tables = []
    for rank in run["ranks"]:
        assert len(rank["steps"]) == STEPS
        for step in rank["steps"]:
            assert step["budget"] is None  # the cap is the static --sb-topk
            tau = np.array(step["tau"])
            assert tau.shape == (1, M, PP) and set(np.unique(tau)) <= set(TAUS)
            tables.append(tau)
            assert all(topk == 32 for _, _, topk in step["records"])
            seen, kept_all, causal_all = 0, 0, 0
            for layer, mb, used, kept, causal in step["record_taus"]:
                assert used == tau[rank["dp_rank"], mb, (layer - 1) // per_stage], (step["iteration"], layer, mb)
                assert 0 < kept <= causal
                seen, kept_all, causal_all = seen + 1, kept_all + kept, causal_all + causal
            assert seen == per_stage * M and kept_all < causal_all  # routed, not dense
    for a, b in zip(run["ranks"][0]["steps"], run["ranks"][1]["steps"]):
        assert a["tau"] == b["tau"]  # every rank planned the same table
    # not vacuous: DST moved some TAU off the run's
    assert any((t != 0.9).any() for t in tables)


def test_timeline_records_the_tau_levels(run):
    for it in range(1, STEPS + 1):
        doc = json.load(open(os.path.join(run["timeline"], f"step_{it:07d}.predicted.json")))
        assert "budget" not in doc and np.array(doc["tau"]).shape == (1, M, PP)
        assert set(np.unique(doc["tau"])) <= set(TAUS)


def _parse(argv, data="unused"):
    from megatron.training.arguments import parse_args

    return parse_args([*TINY, "--data-path", data, "--train-iters", "2", *argv])


THRESHOLD = ["--sparse-balance", "--sb-routing", "threshold", "--sb-cost-model", "h100-analytic"]


@pytest.mark.parametrize("argv, said", [
    ([*THRESHOLD, "--sb-dst-taus", "0.8,1.3"], "--sb-dst-taus 0.8,1.3: every TAU level must be in (0, 1], got 1.3"),
    ([*THRESHOLD, "--sb-dst-taus", "0.95,0.85"], "strictly increasing"),
    ([*THRESHOLD, "--sb-dst-taus", "0.8,0.85"], "the run's TAU 0.9 must lie within the levels [0.8, 0.85]"),
    ([*THRESHOLD, "--sb-dst-taus", "0.8,high"], "expected a comma list of TAUs"),
    (["--sparse-balance", "--sb-cost-model", "h100-analytic", "--sb-dst-taus", "0.8,0.9"],
     "--sb-dst-taus prices DST's TAU levels: it needs --sb-routing threshold"),
    ([*THRESHOLD, "--sb-dst-tau-study", "/nonexistent/study.json"], "--sb-dst-tau-study /nonexistent/study.json"),
])
def test_bad_ladder_is_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


def test_ladder_reaches_the_config(corpus):
    from megatron.training.sb_config import sparsebalance_config

    args = _parse([*THRESHOLD, "--sb-dst-taus", "0.85,0.9,0.95"], corpus)
    assert args.sb_dst_taus == (0.85, 0.9, 0.95)
    sb = sparsebalance_config(args, 1024)
    assert sb.dst.taus == (0.85, 0.9, 0.95) and sb.dst_taus == (0.85, 0.9, 0.95)
    assert sparsebalance_config(_parse(THRESHOLD, corpus), 1024).dst_taus == TAUS
    topk = _parse(THRESHOLD[:1] + THRESHOLD[3:], corpus)  # top-k routing: DST plans top-k
    assert sparsebalance_config(topk, 1024).dst_taus is None
