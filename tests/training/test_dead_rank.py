"""A rank that dies makes the others fail with one clear line, not hang.

Two ranks started by hand (no torchrun, which would kill the survivors itself:
this is the multi-node case where a whole node disappears).
"""

import signal
import socket
import subprocess
import time

from conftest import PRETRAIN, ROOT, TINY, command, env


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_survivor_fails_fast_with_one_line(corpus):
    port = _port()
    procs = []
    for rank in range(2):
        e = env()
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            command(PRETRAIN, [*TINY, "--data-path", corpus, "--pipeline-model-parallel-size", "2",
                               "--train-iters", "100000", "--distributed-timeout-minutes", "2"]),
            cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for line in procs[0].stdout:  # training is under way
            if "iter      2/" in line:
                break
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=150)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 1
    assert waited < 120  # well inside --distributed-timeout-minutes
    lines = [ln for ln in err.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1 and "lost contact with another rank" in lines[0], err[-2000:]
    assert "Traceback" not in err
