"""benchmarks/fault_trials.py, 2 seeded trials: a rank SIGKILLed at a random point of a PP=2
``--sparse-balance`` run; the survivor exits on its own with one error line, the
resume loads the newest intact checkpoint, and the resumed steps equal the
uninterrupted run's (losses, packing, DST budgets, sampler state).

Seed 0's first two trials kill rank 1 in the optimizer step of step 4 and rank 0 in the
save after step 6 (two phases, both resumed from a checkpoint: what the last assertions
ask); with ``--jobs 2`` they run side by side, one round after the reference run.

(The 30-trial run is results/fault_trials.json; see the tool's docstring.)
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRIALS, SEED = 2, 0


def test_two_fault_trials_resume_exactly():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "fault_trials.py"),
                           "--trials", str(TRIALS), "--seed", str(SEED), "--jobs", "2", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    shown = json.dumps(summary["per_trial"], indent=1)[-4000:]
    assert summary["trials"] == TRIALS
    assert summary["faults_hit"] == TRIALS, shown  # every injected kill happened
    assert summary["hangs"] == 0, shown
    assert summary["damaged_loaded"] == 0, shown
    assert summary["exact_resumes"] == TRIALS, shown
    assert summary["passed"] == TRIALS and proc.returncode == 0, shown
    for t in summary["per_trial"]:
        # the survivor said why in one line, without a traceback
        assert isinstance(t["survivor_error"], str) and not t["survivor_traceback"], t
        assert t["loaded"] == max(t["checkpoints"]["intact"], default=None), t
    # non-vacuous: the seed's trials hit more than one phase, and at least one resume
    # started from a checkpoint (not from scratch)
    assert len({t["fault"]["phase"] for t in summary["per_trial"]}) >= 2, shown
    assert any(t["loaded"] for t in summary["per_trial"]), shown
