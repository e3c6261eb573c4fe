"""The Slurm launch scripts, run by a real one-node Slurm cluster on localhost.

benchmarks/ci/slurm_cluster.sh installs (apt-get, as root) or finds Debian's slurm-wlm and
munge, and starts munged + slurmctld + slurmd in a temporary directory. Then:

* examples/slurm/pretrain_cpu.sbatch is submitted as is (2 tasks = 2 ranks, PP=2, the
  real pretrain_gpt.py on a tiny model); the job must end COMPLETED with exit 0 and
  its log must show both pipeline stages training.
* examples/slurm/pretrain_sparsebalance.sbatch (the multi-node GPU script) is
  submitted with its GPU request overridden (no GPUs here) and SB_ROOT pointing at a
  stand-in pretrain_gpt.py that only does what the launcher relies on (gloo
  rendezvous, a step loop, USR1 -> save -> exit 0). This checks the launcher itself:
  torchrun rendezvous from the allocation, per-node logs, USR1 forwarding (torchrun
  must survive it), exit 0, self-requeue and the resume from the same checkpoint dir.

Skips, with the reason, only when the packages are missing and cannot be installed
(not root, no apt, or apt failed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(REPO, "benchmarks", "ci", "slurm_cluster.sh")
CPU_SBATCH = os.path.join(REPO, "examples", "slurm", "pretrain_cpu.sbatch")
GPU_SBATCH = os.path.join(REPO, "examples", "slurm", "pretrain_sparsebalance.sbatch")
JOB_TIMEOUT_S = 240


def _run(cmd, env=None, timeout=60, **kw):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Environment whose SLURM_CONF points at a running one-node cluster."""
    if os.geteuid() != 0:
        pytest.skip("the one-node Slurm cluster runs slurmd as root; not root here")
    t0 = time.perf_counter()
    r = _run(["bash", CLUSTER, "install"], timeout=600)
    if r.returncode == 3:
        pytest.skip(f"Slurm unavailable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    print(f"\nslurm packages ready in {time.perf_counter() - t0:.1f} s")
    d = str(tmp_path_factory.mktemp("slurm"))
    r = _run(["bash", CLUSTER, "up", d], timeout=180)
    try:
        assert r.returncode == 0, f"cluster did not start:\n{r.stderr}"
        env = dict(os.environ, SLURM_CONF=os.path.join(d, "etc", "slurm.conf"))
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
            del env[k]  # never inherit an outer allocation
        print(f"cluster up in {time.perf_counter() - t0:.1f} s total")
        yield env
    finally:
        _run(["bash", CLUSTER, "down", d], timeout=120)


def job_field(env, job, name):
    r = _run(["scontrol", "show", "job", str(job)], env=env)
    m = re.search(rf"\b{name}=(\S+)", r.stdout)
    return m.group(1) if m else None


def wait_state(env, job, states, timeout=JOB_TIMEOUT_S, log=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(env, job, "JobState")
        if state in states:
            return state
        time.sleep(0.5)
    _run(["scancel", str(job)], env=env)
    tail = open(log).read()[-3000:] if log and os.path.exists(log) else ""
    pytest.fail(f"job {job} not in {states} after {timeout} s (last {state})\n{tail}")


def wait_for_text(path, pattern, timeout=JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and re.search(pattern, open(path, errors="replace").read()):
            return
        time.sleep(0.3)
    pytest.fail(f"{pattern!r} never appeared in {path}")


def sbatch(env, args, cwd):
    r = _run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    return int(r.stdout.strip().split(";")[0])


def test_cpu_sbatch_trains_two_pipeline_stages(slurm, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(slurm, RUN_DIR=str(run_dir), PYTHON=sys.executable)
    t0 = time.perf_counter()
    job = sbatch(env, [f"--output={tmp_path}/%x-%j.out", CPU_SBATCH, "--train-iters", "6",
                       "--save-interval", "3"], cwd=REPO)
    log = f"{tmp_path}/sb-cpu-{job}.out"
    state = wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"},
                       log=log)
    text = open(log).read()
    print(f"CPU sbatch job {job}: {state} in {time.perf_counter() - t0:.1f} s")
    assert state == "COMPLETED", text[-3000:]
    assert job_field(slurm, job, "ExitCode") == "0:0", text[-3000:]
    # Slurm started 2 tasks, and rank 0 (srun --label prefix "0: ") logged every step
    # with the forward/backward time of exactly two pipeline stages (one per task).
    assert "2 tasks" in text, text[-3000:]
    steps = re.findall(r"^0: iter\s+(\d+)/6 \| loss ([0-9.]+) .*fwd ms/stage \[(\d+) (\d+)\] "
                       r"\| bwd ms/stage \[(\d+) (\d+)\]", text, re.M)
    assert [int(s[0]) for s in steps] == list(range(1, 7)), f"steps logged: {steps}\n{text[-3000:]}"
    assert all(float(s[1]) > 0 for s in steps)
    assert os.path.isdir(run_dir / "checkpoints") and os.listdir(run_dir / "checkpoints"), \
        "no checkpoint written"


STAND_IN = textwrap.dedent('''\
    """Stand-in for pretrain_gpt.py: only what the Slurm launcher relies on."""
    import os, signal, sys, time
    import torch, torch.distributed as dist

    argv = sys.argv[1:]
    save = argv[argv.index("--save") + 1]
    assert argv[argv.index("--load") + 1] == save and "--exit-signal-handler" in argv
    iters = int(argv[len(argv) - 1 - argv[::-1].index("--train-iters") + 1])
    stop = []
    signal.signal(signal.SIGUSR1, lambda *a: stop.append(1))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = os.path.join(save, "iteration.txt")
    start = int(open(state).read()) if os.path.exists(state) else 0
    print(f"rank {rank}/{world} local {os.environ['LOCAL_RANK']} run_id {os.environ['TORCHELASTIC_RUN_ID']} "
          f"resume {start}", flush=True)
    for it in range(start + 1, iters + 1):
        time.sleep(0.5)
        flag = torch.tensor([float(bool(stop))])
        dist.all_reduce(flag)
        print(f"rank {rank} iteration {it}/{iters}", flush=True)
        if flag.item() > 0 or it == iters:
            if rank == 0:
                with open(state + ".tmp", "w") as f:
                    f.write(str(it))
                os.replace(state + ".tmp", state)
            dist.barrier()
            print(f"rank {rank} saved {it}" + (" on signal" if flag.item() > 0 else ""), flush=True)
            break
    dist.destroy_process_group()
''')


def test_gpu_sbatch_rendezvous_preemption_and_requeue(slurm, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "pretrain_gpt.py").write_text(STAND_IN)
    run_dir = tmp_path / "run"
    env = dict(slurm, SB_ROOT=str(root), RUN_DIR=str(run_dir), PYTHON=sys.executable,
               DATA_PATH=str(tmp_path / "unused"), TOKENIZER_MODEL=str(tmp_path / "unused-tokenizer"),
               GPUS_PER_NODE="2")
    t0 = time.perf_counter()
    job = sbatch(env, ["--gpus-per-node=0", "--cpus-per-task=2", "--nodes=1", "--exclusive",
                       f"--output={tmp_path}/%x-%j.out", GPU_SBATCH, "--train-iters", "12"], cwd=str(tmp_path))
    batch_log = f"{tmp_path}/sparsebalance-{job}.out"
    node_log = f"{run_dir}/logs/{job}/{os.uname().nodename.split('.')[0]}.log"
    wait_for_text(node_log, r"iteration 2/12")
    # What Slurm does 180 s before the time limit (--signal=B:USR1@180).
    r = _run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm)
    assert r.returncode == 0, r.stderr
    wait_state(slurm, job, {"PENDING"}, timeout=120, log=batch_log)
    assert job_field(slurm, job, "Restarts") == "1"
    first = open(node_log).read()
    m = re.findall(r"rank (\d) saved (\d+) on signal", first)
    assert sorted(r for r, _ in m) == ["0", "1"], first
    saved = int(m[0][1])
    assert saved < 12, first
    # Slurm holds a requeued job back (BeginTime ~2 min) so that it does not restart in
    # the second its old credential was revoked (slurmd would refuse it: "Job credential
    # revoked"). Wait until the node is idle and that second has passed, then release it.
    deadline = time.monotonic() + 60
    while _run(["sinfo", "-h", "-N", "-o", "%T"], env=slurm).stdout.strip() != "idle":
        assert time.monotonic() < deadline, "node never went idle after the requeue"
        time.sleep(0.3)
    time.sleep(2.5)
    _run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm)
    state = wait_state(slurm, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, log=batch_log)
    text, batch = open(node_log).read(), open(batch_log).read()
    print(f"GPU sbatch job {job}: preempted at {saved}, {state} after requeue, "
          f"{time.perf_counter() - t0:.1f} s")
    assert state == "COMPLETED", batch + text[-3000:]
    assert job_field(slurm, job, "ExitCode") == "0:0", batch
    assert "requeueing job" in batch and "restart 1" in batch, batch
    # Two workers per run, rendezvous id = job id, the second run resumed where the first saved.
    assert sorted(set(re.findall(rf"rank (\d)/2 local \d run_id {job} resume 0", text))) == ["0", "1"], text
    assert sorted(set(re.findall(rf"rank (\d)/2 local \d run_id {job} resume {saved}\b", text))) == ["0", "1"], text
    assert re.search(r"rank 0 iteration 12/12", text) and re.search(r"rank 0 saved 12\b", text), text[-2000:]
