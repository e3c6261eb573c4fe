"""Checkpoint/resume and preemption through pretrain_gpt.py (PP=2, torchrun, gloo).

* save at N, resume, the losses of N+1.. equal the uninterrupted run;
* SIGUSR1 to ONE rank: every rank finishes its step, all agree, a checkpoint is
  written atomically, exit 0; resuming from it continues the same loss curve.
Constant LR so that runs of different --train-iters share the schedule.
"""

import json
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest
from conftest import PRETRAIN, ROOT, TINY, env, summary_of, torchrun

PP2 = ["--pipeline-model-parallel-size", "2", "--lr-decay-style", "constant"]
TOTAL = 6


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory, world):
    save = str(tmp_path_factory.mktemp("full"))
    summary = summary_of(world.launch(PRETRAIN, [*TINY, *PP2, "--data-path", corpus, "--train-iters", str(TOTAL),
                                                 "--save", save, "--save-interval", "3"], nproc=2))
    return summary, save


def test_save_resume_reproduces_losses(corpus, full_run, tmp_path, world):
    full, save = full_run
    assert sorted(os.listdir(save)) == ["iter_0000003", f"iter_{TOTAL:07d}", "latest_checkpointed_iteration.txt"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(TOTAL)
    # resume from the checkpoint written at iteration 3 of the uninterrupted run
    ck = tmp_path / "ck3"
    ck.mkdir()
    shutil.copytree(os.path.join(save, "iter_0000003"), ck / "iter_0000003")
    (ck / "latest_checkpointed_iteration.txt").write_text("3\n")
    resumed = summary_of(world.launch(PRETRAIN, [*TINY, *PP2, "--data-path", corpus, "--train-iters", str(TOTAL),
                                                 "--load", str(ck)], nproc=2))
    assert resumed["iterations"] == TOTAL - 3 and resumed["last_iteration"] == TOTAL
    np.testing.assert_allclose(resumed["losses"], full["losses"][3:], rtol=1e-6)
    assert len(set(np.round(full["losses"], 4))) == TOTAL  # the curve really moves


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_signal_saves_and_resumes(corpus, full_run, tmp_path, world):
    save = str(tmp_path / "ck")
    args = [*TINY, *PP2, "--data-path", corpus, "--train-iters", "200", "--save", save,
            "--exit-signal-handler"]
    proc = subprocess.Popen(torchrun(PRETRAIN, args), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:  # wait until training is under way
            lines.append(line)
            if "iter      2/" in line:
                break
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGUSR1)  # only one rank gets the signal
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    stdout = "".join(lines) + out
    summary = [ln for ln in stdout.splitlines() if "SUMMARY_JSON" in ln]
    s = json.loads(summary[0].split("SUMMARY_JSON ", 1)[1])
    stop = s["last_iteration"]
    # the flag is agreed on by an all-reduce after every step: it stops after the step the
    # signal landed in (usually 2 or 3; at ~40 ms per step on a fast machine a few later), and
    # before TOTAL so that the resumed run below has steps left to compare
    assert s["preempted"] and 2 <= stop < TOTAL
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == str(stop)
    assert not [d for d in os.listdir(save) if ".tmp" in d]
    full, _ = full_run
    resumed = summary_of(world.launch(PRETRAIN, [*TINY, *PP2, "--data-path", corpus, "--train-iters",
                                                 str(TOTAL), "--load", save, "--override-opt_param-scheduler"],
                                       nproc=2))
    np.testing.assert_allclose(s["losses"], full["losses"][:stop], rtol=1e-6)
    np.testing.assert_allclose(resumed["losses"], full["losses"][stop:], rtol=1e-6)
