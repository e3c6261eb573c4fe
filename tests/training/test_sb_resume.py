"""Resuming a run packed by SAB (``--sb-batching sab``) continues the same data order.

PP=2 over gloo with the analytic cost model: an uninterrupted 4-step run saves at
step 2; a second run resumes from that checkpoint. The sampler state saved after
every step (position, epoch, carried documents) and the losses of steps 3-4 must
equal the uninterrupted run's. SAB plans from a predictor instance whose online
correction never moves, so the order depends on (seed, step) only; DST is off here
because its budgets adapt to measured times and would change the losses.
"""

import json
import os
import shutil

import numpy as np
from conftest import ROOT, TINY

WORKER = os.path.join(ROOT, "tests", "training", "_sb_worker.py")
FLAGS = [*TINY, "--pipeline-model-parallel-size", "2", "--lr-decay-style", "constant",
         "--global-batch-size", "6", "--sparse-attention", "--sb-batching", "sab",
         "--sb-block-size", "32", "--sb-topk", "2", "--sb-cost-model", "h100-analytic"]
TOTAL, AT = 4, 2


def _rank0(dump):
    return json.load(open(os.path.join(dump, "rank0.json")))


def test_sab_sampler_state_round_trips(corpus, tmp_path, world):
    save = str(tmp_path / "full")
    proc = world.launch(WORKER, [*FLAGS, "--data-path", corpus, "--train-iters", str(TOTAL), "--save", save,
                                 "--save-interval", str(AT)], nproc=2,
                        extra_env={"SB_TEST_DUMP": str(tmp_path / "d_full")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = _rank0(str(tmp_path / "d_full"))
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copytree(os.path.join(save, f"iter_{AT:07d}"), ck / f"iter_{AT:07d}")
    (ck / "latest_checkpointed_iteration.txt").write_text(f"{AT}\n")
    proc = world.launch(WORKER, [*FLAGS, "--data-path", corpus, "--train-iters", str(TOTAL), "--load", str(ck)],
                        nproc=2, extra_env={"SB_TEST_DUMP": str(tmp_path / "d_res")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _rank0(str(tmp_path / "d_res"))
    states = [s["sampler"] for s in full["steps"]]
    assert states[AT - 1]["strategy"] == "sab"
    # non-vacuous: the state moves every step and the checkpoint is mid-epoch (a restart
    # from the epoch start would replay other documents)
    assert len({json.dumps(s, sort_keys=True) for s in states}) == TOTAL
    assert states[AT - 1]["epoch"] == 0 and states[AT - 1]["pos"] > 0
    assert [s["sampler"] for s in res["steps"]] == states[AT:]
    np.testing.assert_allclose(res["summary"]["losses"], full["summary"]["losses"][AT:], rtol=1e-6)
