"""Preemption and crash behaviour of the real pretrain_gpt.py (PP=2, CPU, gloo).

* SIGTERM to one worker of a running torchrun job (what Slurm's ``--signal`` /
  ``scancel --signal`` delivers, possibly not to every rank at the same instant):
  every rank finishes the current step, one complete checkpoint is written atomically
  and the job exits 0. ``--load`` then resumes it, and the losses of the resumed
  iterations equal those of an uninterrupted run on the same data order.
* A rank killed with SIGKILL: the other exits non-zero, within the configured
  ``--distributed-timeout-minutes``, with a clear error line and no traceback, and the
  checkpoint directory holds only complete checkpoints.

The ranks of the dead-rank case are started directly (RANK/WORLD_SIZE/MASTER_ADDR, as
srun does) because torchrun would itself terminate the survivor. The corpus, the
uninterrupted run and the resumed run are jobs of the session's warm world
(tests/_world.py); the runs that are signalled or killed are processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
TRACKER = "latest_checkpointed_iteration.txt"
ITERS = 40  # long enough that the signal lands mid-run even on a fast machine (~40 ms/step)
RUN_TIMEOUT_S = 300

if not os.path.isfile(PRETRAIN):
    pytest.fail("pretrain_gpt.py does not exist", pytrace=False)


def model_args(data: str) -> list[str]:
    return [*PROJECT_RUN_FLAGS, "--cpu", "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--hidden-size",
            "32",
            "--num-attention-heads", "2", "--seq-length", "128", "--global-batch-size", "4",
            "--train-iters", str(ITERS), "--lr", "1e-3", "--log-interval", "1", "--no-progress-bar",
            "--data-path", data, "--tokenizer-type", "ByteTokenizer", "--seed", "7"]


def env1() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def torchrun(args: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", PRETRAIN, *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env1(), cwd=REPO,
                            start_new_session=True)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def worker_pids(agent: int, n: int, timeout: float = 120) -> list[int]:
    """The ``n`` worker processes torchrun started (its python children running the script)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for c in children(agent):
            try:
                cmdline = open(f"/proc/{c}/cmdline", "rb").read().split(b"\0")
            except FileNotFoundError:
                continue
            if any(a.endswith(b"pretrain_gpt.py") for a in cmdline):
                found.append(c)
        if len(found) == n:
            return found
        time.sleep(0.2)
    raise AssertionError(f"torchrun {agent} did not start {n} workers")


def worker_rank(pid: int) -> int:
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return int(next(e for e in env if e.startswith(b"RANK=")).split(b"=", 1)[1])


def losses(text: str) -> dict[int, float]:
    """{iteration: loss}: full precision from the driver's SUMMARY_JSON when the run got
    that far, else the 4-decimal values of its ``iter N/M | loss X`` lines."""
    out = {int(m.group(1)): float(m.group(2))
           for m in re.finditer(r"iter\s+(\d+)\s*/\s*\d+\s*\|\s*loss\s+([0-9.]+)", text)}
    for line in text.splitlines():
        if line.startswith("SUMMARY_JSON "):
            s = json.loads(line[len("SUMMARY_JSON "):])
            first = s["last_iteration"] - len(s["losses"]) + 1
            out.update({first + k: v for k, v in enumerate(s["losses"])})
    return out


def summary(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("SUMMARY_JSON ")]
    assert len(lines) == 1, f"expected one SUMMARY_JSON line, got {len(lines)}\n{text[-2000:]}"
    return json.loads(lines[0][len("SUMMARY_JSON "):])


def assert_only_complete_checkpoints(root: str, crashed: bool = False) -> int | None:
    """Every checkpoint under a final name is complete and the tracker names one.

    After a clean exit there must be no temporary entries at all. After a crash a
    writer may have died mid-save: its directory may remain, but only under a
    temporary name (``*.tmp-*``), never as ``iter_XXXXXXX`` or as "latest".
    """
    if not os.path.isdir(root):
        return None
    entries = os.listdir(root)
    stray = [e for e in entries if ".tmp" in e or ".old" in e]
    if not crashed:
        assert not stray, f"temporary checkpoint entries left after a clean exit: {stray}"
    else:
        assert all(re.fullmatch(r"\.?(iter_\d{7}|" + re.escape(TRACKER) + r")\.(tmp|old)-\w+", e)
                   for e in stray), f"unexpected entries: {stray}"
    finals = [e for e in entries if re.fullmatch(r"iter_\d{7}", e)]
    for e in finals:
        assert os.path.isfile(os.path.join(root, e, ".metadata")), f"{e} is incomplete (no .metadata)"
    if TRACKER not in entries:
        assert not finals, f"checkpoints without a tracker: {entries}"
        return None
    it = int(open(os.path.join(root, TRACKER)).read().strip())
    assert f"iter_{it:07d}" in finals, f"tracker names {it}, not among {finals}"
    return it


@pytest.fixture(scope="module")
def data(tmp_path_factory, world):
    d = tmp_path_factory.mktemp("preempt_data")
    r = world.launch(os.path.join(REPO, "tools", "make_corpus.py"),
                     ["--output-prefix", str(d / "corpus"), "--num-docs", "1000", "--max-length", "128"], timeout=120)
    assert r.returncode == 0, r.stderr
    return str(d / "corpus")


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory, world):
    d = tmp_path_factory.mktemp("full")
    p = world.launch(PRETRAIN, model_args(data) + ["--save", str(d / "ck")], nproc=2, timeout=RUN_TIMEOUT_S)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-3000:]
    got = losses(text)
    assert sorted(got) == list(range(1, ITERS + 1)), f"losses parsed: {got}\n{text[-2000:]}"
    return got


def test_sigterm_checkpoints_exits_0_and_resume_matches(data, uninterrupted, tmp_path, world):
    ck = str(tmp_path / "ck")
    os.makedirs(ck)  # --load must exist; equal to --save and empty, it starts fresh (as the sbatch does)
    args = model_args(data) + ["--save", ck, "--load", ck, "--exit-signal-handler"]
    with open(tmp_path / "log1", "w") as log:
        t0 = time.monotonic()
        p = torchrun(args, log)
        workers = worker_pids(p.pid, 2)
        # Wait until iteration 2 is logged, then signal ONE rank (the last stage).
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while 2 not in losses(open(tmp_path / "log1").read()):
            assert p.poll() is None, open(tmp_path / "log1").read()[-3000:]
            assert time.monotonic() < deadline, "no iteration 2 logged"
            time.sleep(0.02)
        last = next(w for w in workers if worker_rank(w) == 1)
        os.kill(last, signal.SIGTERM)
        rc = p.wait(timeout=RUN_TIMEOUT_S)
    first = open(tmp_path / "log1").read()
    print(f"\ninterrupted run: {time.monotonic() - t0:.1f} s, rc={rc}")
    assert rc == 0, first[-3000:]
    stopped = assert_only_complete_checkpoints(ck)
    assert stopped is not None, f"no checkpoint after SIGTERM: {os.listdir(ck) if os.path.isdir(ck) else None}"
    assert 2 <= stopped < ITERS, f"stopped at {stopped}; the signal should end the run early\n{first[-2000:]}"
    s1 = summary(first)
    assert s1["preempted"] is True and s1["last_iteration"] == stopped, s1
    assert max(losses(first)) == stopped, "ranks trained past the checkpointed step"

    p = world.launch(PRETRAIN, args, nproc=2, timeout=RUN_TIMEOUT_S)
    second = p.stdout + p.stderr
    assert p.returncode == 0, second[-3000:]
    resumed = losses(second)
    assert sorted(resumed) == list(range(stopped + 1, ITERS + 1)), f"resumed iterations {sorted(resumed)}"
    assert summary(second)["preempted"] is False
    assert assert_only_complete_checkpoints(ck) == ITERS
    # Same data order and state: the losses continue as if never interrupted.
    for it in range(1, ITERS + 1):
        got = losses(first).get(it, resumed.get(it))
        ref = uninterrupted[it]
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-5), \
            f"iteration {it}: {got} vs uninterrupted {ref} (stopped at {stopped})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_rank_makes_the_other_exit_with_a_clear_error(data, tmp_path):
    timeout_min = 0.5
    ck = str(tmp_path / "ck")
    args = model_args(data) + ["--save", ck, "--save-interval", "1", "--train-iters", "400",
                               "--distributed-timeout-minutes", str(timeout_min)]
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = dict(env1(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        err = open(tmp_path / f"rank{rank}.err", "w")
        out = open(tmp_path / f"rank{rank}.out", "w")
        logs.append((out, err))
        procs.append(subprocess.Popen([sys.executable, PRETRAIN, *args], stdout=out, stderr=err,
                                      env=env, cwd=REPO, start_new_session=True))
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while 3 not in losses(open(tmp_path / "rank1.out").read() + open(tmp_path / "rank0.out").read()):
            assert all(p.poll() is None for p in procs), open(tmp_path / "rank0.err").read()[-3000:]
            assert time.monotonic() < deadline, "no iteration 3 logged"
            time.sleep(0.2)
        procs[1].kill()
        t_kill = time.monotonic()
        rc = procs[0].wait(timeout=timeout_min * 60 + 60)
        waited = time.monotonic() - t_kill
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for out, err in logs:
            out.close()
            err.close()
    err0 = open(tmp_path / "rank0.err").read()
    print(f"\nsurvivor exited {rc} {waited:.1f} s after the kill; stderr tail: {err0.strip()[-300:]}")
    assert rc != 0, "survivor exited 0 after its peer died"
    assert waited <= timeout_min * 60 + 30, f"survivor took {waited:.0f} s (timeout {timeout_min} min)"
    assert "Traceback" not in err0, err0[-3000:]
    error_lines = [ln for ln in err0.splitlines() if re.search(r"error", ln, re.I)]
    assert error_lines and re.search(r"rank|peer|timeout|timed out|connection|closed", error_lines[-1],
                                     re.I), err0[-3000:]
    assert_only_complete_checkpoints(ck, crashed=True)
