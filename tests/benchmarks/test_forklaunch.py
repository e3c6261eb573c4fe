"""benchmarks/harness/forklaunch.py: the harness's launches forked from a warm server
behave as the real processes (``python SCRIPT``, ``torchrun``): output, exit status,
torchrun's rank environment, a failed rank ending the others, signals, process groups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.harness import forklaunch as F

SCRIPT = r'''
import json, os, signal, sys, time
mode = sys.argv[1]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
        "MASTER_ADDR", "OMP_NUM_THREADS", "SB_PROBE")
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "main": __name__,
                  "env": {k: os.environ.get(k) for k in keys}, "port": bool(os.environ.get("MASTER_PORT")),
                  "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN}), flush=True)
print("to stderr", file=sys.stderr)
if mode == "fail" and os.environ.get("RANK", "0") == "1":
    sys.exit(3)
if mode == "hang" or (mode == "fail" and os.environ.get("RANK") == "0"):
    time.sleep(120)
sys.exit(int(mode) if mode.isdigit() else 0)
'''


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def _run(cmd, tmp_path, mode, name, **kw):
    os.environ["SB_HARNESS_LAUNCH"] = mode
    env = dict(os.environ, SB_PROBE="yes", OMP_NUM_THREADS="1")
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    with open(out, "w") as so, open(err, "w") as se:
        p = F.popen(cmd, stdout=so, stderr=se, env=env, cwd=str(tmp_path), **kw)
        rc = p.wait(timeout=120)
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.startswith("{")]
    return p, rc, lines, err.read_text()


@pytest.fixture(autouse=True)
def _restore_mode():
    before = os.environ.get("SB_HARNESS_LAUNCH")
    yield
    if before is None:
        os.environ.pop("SB_HARNESS_LAUNCH", None)
    else:
        os.environ["SB_HARNESS_LAUNCH"] = before


def test_commands_it_forks_and_those_it_leaves_to_popen():
    py = sys.executable
    assert F.parse([py, "s.py", "--a", "1"]) == {"script": "s.py", "args": ["--a", "1"], "nproc": 1, "torchrun": None}
    got = F.parse([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--master-port=29400",
                   "--log-dir", "L", "--redirects", "3", "pretrain_gpt.py", "--cpu"])
    assert got["script"] == "pretrain_gpt.py" and got["args"] == ["--cpu"] and got["nproc"] == 4
    assert got["torchrun"] == {"standalone": True, "master_port": "29400", "master_addr": "localhost",
                               "log_dir": "L", "redirects": "3"}
    for other in ([py, "-m", "pytest"], [py, "-c", "pass"], ["bash", "x.sh"],
                  [py, "-m", "torch.distributed.run", "--nnodes", "2", "s.py"],
                  [py, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "s.py"],
                  [py, "-m", "torch.distributed.run", "--nproc-per-node", "gpu", "s.py"],
                  [py, "-m", "torch.distributed.run", "--nproc-per-node", "2"]):
        assert F.parse(other) is None, other


def test_script_forked_equals_script_run(script, tmp_path):
    cmd = [sys.executable, script, "5", "x"]
    cold, rc_cold, out_cold, err_cold = _run(cmd, tmp_path, "", "cold")
    warm, rc_warm, out_warm, err_warm = _run(cmd, tmp_path, "fork", "warm")
    assert isinstance(cold, subprocess.Popen) and isinstance(warm, F.ForkedProcess)
    assert rc_cold == rc_warm == 5 and out_cold == out_warm and err_cold == err_warm == "to stderr\n"
    assert out_warm[0]["main"] == "__main__" and out_warm[0]["path0"] == str(tmp_path)


def test_torchrun_forked_equals_torchrun(script, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, "0"]
    _, rc_cold, out_cold, _ = _run(cmd, tmp_path, "", "cold")
    _, rc_warm, out_warm, _ = _run(cmd, tmp_path, "fork", "warm")
    assert rc_cold == rc_warm == 0
    by_rank = [sorted(o, key=lambda x: x["env"]["RANK"]) for o in (out_cold, out_warm)]
    assert by_rank[0] == by_rank[1] and [x["env"]["RANK"] for x in by_rank[1]] == ["0", "1"]
    assert all(x["port"] and x["env"]["WORLD_SIZE"] == "2" for x in by_rank[1])


def test_a_failed_rank_ends_the_others_and_the_agent_exits_1(script, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, "fail"]
    t0 = time.monotonic()
    _, rc, out, _ = _run(cmd, tmp_path, "fork", "fail")
    assert rc == 1 and len(out) == 2 and time.monotonic() - t0 < 60  # rank 0 slept 120 s: it was ended


def test_signals_sessions_and_ignored_usr1(script, tmp_path):
    os.environ["SB_HARNESS_LAUNCH"] = "fork"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", script, "hang"]
    with open(tmp_path / "h.out", "w") as so:
        p = F.popen(cmd, stdout=so, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    ignore_usr1=True, start_new_session=True)
        deadline = time.monotonic() + 60
        while (tmp_path / "h.out").read_text().count("\n") < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.getpgid(p.pid) == p.pid and p.poll() is None
        os.killpg(p.pid, signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
    lines = [json.loads(x) for x in (tmp_path / "h.out").read_text().splitlines() if x.startswith("{")]
    assert len(lines) == 2 and all(x["usr1_ignored"] for x in lines)


def test_an_import_time_variable_that_differs_runs_cold(script, tmp_path):
    os.environ["SB_HARNESS_LAUNCH"] = "fork"
    with open(tmp_path / "t.out", "w") as so:
        first = F.popen([sys.executable, script, "0"], stdout=so, env=dict(os.environ))
        assert isinstance(first, F.ForkedProcess) and first.wait(timeout=60) == 0
        flipped = "0" if os.environ.get("TRITON_INTERPRET") == "1" else "1"
        p = F.popen([sys.executable, script, "0"], stdout=so, env=dict(os.environ, TRITON_INTERPRET=flipped))
        assert isinstance(p, subprocess.Popen) and p.wait(timeout=60) == 0


def test_inherited_stderr_is_fd_2_and_pipes_run_cold(script, tmp_path):
    os.environ["SB_HARNESS_LAUNCH"] = "fork"
    saved = os.dup(2)
    try:
        with open(tmp_path / "fd2.txt", "w") as f2, open(tmp_path / "fd1.out", "w") as so:
            os.dup2(f2.fileno(), 2)
            p = F.popen([sys.executable, script, "0"], stdout=so, env=dict(os.environ))
            assert isinstance(p, F.ForkedProcess) and p.wait(timeout=60) == 0
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert (tmp_path / "fd2.txt").read_text() == "to stderr\n"
    assert "to stderr" not in (tmp_path / "fd1.out").read_text()
    p = F.popen([sys.executable, script, "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    out, _ = p.communicate(timeout=60)
    assert isinstance(p, subprocess.Popen) and p.returncode == 0 and b"to stderr" in out
