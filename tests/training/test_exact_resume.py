"""A resumed ``--sparse-balance`` run continues exactly: same losses, packing and DST
budgets as the uninterrupted run (PP=2 over gloo, planning ahead, analytic cost model),
whether it resumes a periodic checkpoint or the one a SIGTERM preemption wrote.

Measured op times are noisy, so the worker (``_fault_worker.py``, ``SB_TEST_DET_TIMES``)
replaces them with a deterministic function of (iteration, stage, micro-batch): the
online correction then evolves identically in every run and budgets are comparable.
The control resumes the same checkpoint as if it had been written before the
predictor state was saved: it must load (with one warning) and its budgets must
differ, so the comparison can fail. Both tests compare with one uninterrupted run
(module fixture; its periodic saves are the first test's checkpoints).
"""

import json
import os
import shutil

import pytest
from conftest import ROOT, TINY

WORKER = os.path.join(ROOT, "tests", "training", "_fault_worker.py")
FLAGS = [*TINY, "--pipeline-model-parallel-size", "2", "--lr-decay-style", "constant",
         "--global-batch-size", "6", "--sparse-balance", "--sb-block-size", "32", "--sb-topk", "4",
         "--sb-cost-model", "h100-analytic"]
TOTAL, AT = 5, 2
DET = {"SB_TEST_DET_TIMES": "1"}


def read_dump(dump):
    """{rank: [step dicts]} and {rank: loaded iteration or None} of a worker dump."""
    steps, loaded = {}, {}
    for name in sorted(os.listdir(dump)):
        rank = int(name[len("rank"):-len(".jsonl")])
        rows = [json.loads(ln) for ln in open(os.path.join(dump, name))]
        steps[rank] = [r for r in rows if "iteration" in r]
        loaded[rank] = next((r["loaded"] for r in rows if "loaded" in r), None)
    return steps, loaded


def keep_only(save, iteration, dest):
    """A checkpoint directory holding just ``iteration`` of ``save``."""
    os.makedirs(dest)
    shutil.copytree(os.path.join(save, f"iter_{iteration:07d}"), os.path.join(dest, f"iter_{iteration:07d}"))
    with open(os.path.join(dest, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{iteration}\n")
    return dest


def run(world, corpus, tmp_path, name, more, extra_env):
    dump = str(tmp_path / f"d_{name}")
    proc = world.launch(WORKER, [*FLAGS, "--data-path", corpus, "--train-iters", str(TOTAL), *more], nproc=2,
                        extra_env={**DET, "SB_TEST_DUMP": dump, **extra_env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_dump(dump), proc


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory, world):
    """The uninterrupted TOTAL-step run, saving every AT steps: ({rank: steps}, save dir)."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    save = str(tmp_path / "full")
    (full, _), _ = run(world, corpus, tmp_path, "full", ["--save", save, "--save-interval", str(AT)], {})
    return full, save


def test_resume_reproduces_losses_packing_and_budgets(corpus, uninterrupted, tmp_path, world):
    full, save = uninterrupted
    ck = keep_only(save, AT, str(tmp_path / "ck"))
    (res, loaded), proc = run(world, corpus, tmp_path, "res", ["--load", ck], {})
    (ctl, _), proc_ctl = run(world, corpus, tmp_path, "ctl", ["--load", ck], {"SB_TEST_DROP_SB_STATE": "1"})
    assert loaded == {0: AT, 1: AT}
    assert "predictor state" not in proc.stderr

    for rank in (0, 1):
        want = full[rank][AT:]
        got = res[rank]
        assert [s["iteration"] for s in got] == list(range(AT + 1, TOTAL + 1))
        for key in ("packing", "sampler", "budget", "records", "loss_sum", "loss_tokens"):
            assert [s[key] for s in got] == [s[key] for s in want], (rank, key)

    # non-vacuous: DST budgets move from step to step in the uninterrupted run, the
    # last stage trains a loss, and without the saved correction the budgets differ
    budgets = [json.dumps(s["budget"]) for s in full[0]]
    assert len(set(budgets)) >= 3, budgets
    assert all(s["loss_tokens"] > 0 for s in full[1])
    assert [s["budget"] for s in ctl[0]] != [s["budget"] for s in full[0][AT:]]
    assert [s["packing"] for s in ctl[0]] == [s["packing"] for s in full[0][AT:]]  # SAB order is not
    # a checkpoint without the state (older format) still loads, with one warning
    warned = [ln for ln in proc_ctl.stderr.splitlines() if "no SparseBalance predictor state" in ln]
    assert len(warned) == 1 and warned[0].startswith("pretrain_gpt.py: warning:"), proc_ctl.stderr[-2000:]


def test_sigterm_preemption_resumes_exactly(corpus, uninterrupted, tmp_path, world):
    """SIGTERM on rank 0 as step 3 starts (``--exit-signal-handler``): the run finishes
    step 3, saves, exits 0; the resumed steps 4-5 equal the uninterrupted run's."""
    full, _ = uninterrupted
    save = str(tmp_path / "pre")
    (pre, _), proc_pre = run(world, corpus, tmp_path, "pre", ["--save", save, "--exit-signal-handler"],
                             {"SB_TEST_TERM": "0:3"})
    assert [s["iteration"] for s in pre[0]] == [1, 2, 3], proc_pre.stdout[-2000:]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    (res, loaded), _ = run(world, corpus, tmp_path, "res", ["--load", save], {})
    assert loaded == {0: 3, 1: 3}
    for rank in (0, 1):
        assert [s["iteration"] for s in res[rank]] == [4, 5]
        for key in ("packing", "sampler", "budget", "records", "loss_sum", "loss_tokens"):
            assert [s[key] for s in res[rank]] == [s[key] for s in full[rank][3:]], (rank, key)
