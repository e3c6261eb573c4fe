"""``--step-timeout-minutes``: a rank stuck inside a step (alive, not in a collective)
stops both ranks within about the timeout, with one line naming it.

Two ranks started by hand (no torchrun, which would kill the survivor itself); the
worker (``_fault_worker.py``, ``SB_TEST_HANG``) makes rank 1 sleep forever inside
step 3 while rank 0 waits for it in the pipeline's p2p exchange. The collective
timeout is 5 minutes: only the watchdog can end this in time.
"""

import os
import socket
import subprocess
import time

from conftest import ROOT, TINY, command, env

WORKER = os.path.join(ROOT, "tests", "training", "_fault_worker.py")
TIMEOUT_MIN = 0.1  # 6 s
MARGIN_S = 20  # polling (0.6 s) + a loaded 2-core machine


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stuck_rank_is_named_and_every_rank_exits(corpus):
    port = _port()
    procs = []
    for rank in range(2):
        e = env()
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), SB_TEST_HANG="1:3")
        procs.append(subprocess.Popen(
            command(WORKER, [*TINY, "--data-path", corpus, "--pipeline-model-parallel-size", "2",
                             "--train-iters", "50", "--distributed-timeout-minutes", "5",
                             "--step-timeout-minutes", str(TIMEOUT_MIN)]),
            cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for line in procs[0].stdout:  # step 2 done: step 3 (where rank 1 hangs) starts now
            if "iter      2/" in line:
                break
        t0 = time.monotonic()
        errs = []
        for p in procs:
            errs.append(p.communicate(timeout=TIMEOUT_MIN * 60 + MARGIN_S + 30)[1])
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [1, 1], errs
    assert waited < TIMEOUT_MIN * 60 + MARGIN_S, waited
    for rank, err in enumerate(errs):
        lines = [ln for ln in err.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
        assert len(lines) == 1, err[-2000:]
        assert lines[0].startswith(f"pretrain_gpt.py: error: [rank {rank}] rank 1 made no progress for "), lines
        assert "(stuck in step 3); exiting (--step-timeout-minutes 0.1)" in lines[0], lines
        assert "Traceback" not in err


# ---- the verdict logic, in process (a HashStore stands in for the job's TCPStore) --------

def _peer(store, rank, what, age, waiting, beat, done=False):
    import json

    from megatron.training.watchdog import KEY

    store.set(f"{KEY}/rank{rank}", json.dumps({"what": what, "age": age, "waiting": waiting,
                                               "beat": beat, "done": done}))


def _judge0(store, timeout_s=1.0, world=3):
    from megatron.training.watchdog import Watchdog

    w = Watchdog(timeout_s, 0, world, store, flag="--step-timeout-minutes x")
    w._publish(done=False)  # rank 0's own heartbeat: fresh, waiting=False, age ~0
    return w


def test_judge_names_busy_stale_rank_not_its_waiting_peers():
    import torch.distributed as dist

    store = dist.HashStore()
    w = _judge0(store)
    _peer(store, 1, "step 7", 5.0, False, 1)
    _peer(store, 2, "step 7", 5.0, True, 1)  # waiting for rank 1 in a collective
    assert w._judge() == "rank 1 made no progress for 5 s (stuck in step 7)"
    _peer(store, 1, "step 8", 0.1, False, 2)
    assert w._judge() is None  # it moved on


def test_judge_names_a_frozen_rank():
    import time

    import torch.distributed as dist

    store = dist.HashStore()
    w = _judge0(store, timeout_s=0.2)
    _peer(store, 1, "step 3", 0.0, False, 4)
    _peer(store, 2, "checkpoint save at iteration 2", 9.0, False, 9, done=True)  # finished: ignored
    assert w._judge() is None
    time.sleep(0.3)  # rank 1's beat counter has not moved for longer than the timeout
    assert w._judge() == "rank 1 stopped responding (no heartbeat for over 0 s; last in step 3)"


def test_judge_names_every_rank_when_all_wait_in_communication(monkeypatch):
    import torch.distributed as dist

    from megatron.training import watchdog

    monkeypatch.setattr(watchdog, "waiting_in_comm", lambda frame: True)  # rank 0 waits too
    store = dist.HashStore()
    w = _judge0(store, timeout_s=1.0, world=2)
    _peer(store, 1, "step 3", 2.5, True, 1)
    w._since -= 1.5  # waited 1.5 s: under twice the timeout, no verdict yet
    w._publish(done=False)
    assert w._judge() is None
    w._since -= 1.0
    w._publish(done=False)
    assert w._judge() == "ranks 0, 1 made no progress for 2 s, all waiting in communication (in start-up, step 3)"
