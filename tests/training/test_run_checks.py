"""Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval`` (replicas' weights
hashed and compared at the start and every N iterations) and ``--save-retain-interval``
(after each save the previous checkpoint goes unless its iteration is a multiple of N);
``--test-mode`` runs along (its check is counted in ``test_architecture_flags.py``), and
``--eval-global-batch-size`` sizes the evaluation steps."""

import json
import os
import re

from conftest import TINY, summary_of

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_arch_worker.py")


def test_hash_check_and_retained_checkpoints(world, corpus, tmp_path):
    save, dump = tmp_path / "ckpt", tmp_path / "dump.json"
    proc = world.launch(WORKER, [*TINY, "--data-path", corpus, "--train-iters", "5", "--save", str(save),
                                 "--save-interval", "1", "--save-retain-interval", "2",
                                 "--check-weight-hash-across-dp-replicas-interval", "2", "--qk-layernorm",
                                 "--test-mode", "--eval-interval", "5", "--eval-iters", "2",
                                 "--eval-global-batch-size", "12"], nproc=2, extra_env={"SB_TEST_DUMP": str(dump)})
    summary_of(proc)  # DP=2: the replicas agree at the start, after iterations 2 and 4, in each forward
    # 12 samples / (micro-batch 1 x DP 2) = 6 micro-batches per evaluation step (training: 4 / 2)
    assert json.load(open(dump))["eval_microbatches"] == [6, 6]
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == \
        ["iter_0000002", "iter_0000004", "iter_0000005"]
    assert len(re.findall(r"removed iter_000000[13] \(--save-retain-interval 2\)", proc.stdout)) == 2


def test_replicas_that_differ_stop_the_run_in_one_line(world, corpus):
    proc = world.launch(WORKER, [*TINY, "--data-path", corpus, "--train-iters", "2",
                                 "--check-weight-hash-across-dp-replicas-interval", "1"],
                        nproc=2, extra_env={"SB_TEST_PERTURB": "output_layer"})
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if "differs between" in ln]
    assert len(lines) == 2 and "--check-weight-hash-across-dp-replicas-interval: after iteration 0 " \
        "output_layer.weight differs between this rank and DP rank" in lines[0], proc.stderr[-2000:]

