"""A GPT with --sparse-attention trains under PP=2 on CPU (gloo, 1F1B) and its loss goes down."""

import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS  # noqa: E402


def test_sparse_gpt_trains_under_pp2(tmp_path, world):
    prefix = str(tmp_path / "corpus")
    # quantile 0.9 -> many documents longer than (topk + 2) blocks of 8 tokens: routing is sparse
    r = world.launch(os.path.join(REPO, "tools", "make_corpus.py"),
                     ["--output-prefix", prefix, "--num-docs", "1500", "--max-length", "256", "--quantile", "0.9"],
                     timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    flags = [*PROJECT_RUN_FLAGS, "--data-path", prefix, "--pipeline-model-parallel-size", "2", "--num-layers", "2",
             "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
             "--global-batch-size", "4", "--train-iters", "10", "--lr", "3e-3",
             "--sparse-attention", "--sb-block-size", "8", "--sb-topk", "1",
             "--sb-attention-backend", "cpu"]
    r = world.launch(os.path.join(REPO, "pretrain_gpt.py"), flags, nproc=2, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+)", log)]
    assert len(losses) == 10, log[-3000:]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2, losses
