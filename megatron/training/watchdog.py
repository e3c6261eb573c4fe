"""Hung-rank watchdog (``--step-timeout-minutes``): a rank that is alive but makes no
progress stops the whole job within about the timeout, naming itself.

Without it, a rank stuck inside a step (a wedged kernel, a deadlocked data worker,
an NFS stall) is noticed only when a peer's collective times out
(``--distributed-timeout-minutes``, 10 minutes by default, and then with a message
that names no rank). With it, each rank runs a daemon thread that, every
``poll_s`` seconds:

1. publishes the rank's heartbeat to the job's key-value store (the ``TCPStore``
   the process group was created with: out of band, so a blocked process group does
   not block it): its progress marker (``step 7``, ``checkpoint save at iteration
   6``, set by the training loop), seconds since the marker moved (own clock), whether
   the main thread is waiting in communication (its innermost Python frames are in
   ``torch.distributed`` or megatron's p2p / gradient-reduction code), and a beat
   counter;
2. rank 0 reads every heartbeat (the others read rank 0's only, so the store sees
   O(world) reads per poll): a rank whose marker has not moved for longer than the
   timeout while it is NOT waiting in communication is stuck (its peers, waiting for
   it, are not named); a rank whose beat counter stopped for longer than the timeout
   is frozen (e.g. SIGSTOP); if every rank has been waiting for twice the timeout,
   all of them are named (a collective that can never complete);
3. the first verdict is written to the store once (compare-and-set); every rank
   that reads it counts itself out in the store, waits (briefly) for the others to
   have read it too (the store may be hosted by one of them), prints it as one
   ``error:`` line and exits with status 1 (``os._exit``: the main thread may be
   blocked in C++ and cannot unwind).

Ranks that finished training publish ``done`` and are never named. If the store
itself fails (its host died) the thread stops quietly: that rank's collectives
fail on their own (the dead-rank path of pretrain_gpt.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Dict, List, Optional

KEY = "sparsebalance/watchdog"
_COMM_FILES = (os.path.join("torch", "distributed", ""),
               os.path.join("megatron", "core", "pipeline_parallel", "p2p_communication.py"),
               os.path.join("megatron", "core", "distributed", ""))
_INNER_FRAMES = 4


def waiting_in_comm(frame) -> bool:
    """True if one of the innermost frames of a thread's stack is communication code."""
    for _ in range(_INNER_FRAMES):
        if frame is None:
            return False
        name = frame.f_code.co_filename
        if any(p in name for p in _COMM_FILES):
            return True
        frame = frame.f_back
    return False


class Watchdog:
    """One rank's watchdog thread (see module docstring).

    Args:
        timeout_s: seconds without progress before a rank counts as stuck (> 0).
        rank, world: this process's global rank and the world size.
        store: a ``torch.distributed.Store`` shared by all ranks; None: watch only this
            rank (a single process).
        prog: program name of the error line.
        flag: the flag that set ``timeout_s``, quoted in the error line.
        poll_s: seconds between heartbeats (default: timeout / 10, within [0.2, 5]).
    """

    def __init__(self, timeout_s: float, rank: int, world: int, store=None,
                 prog: str = "pretrain_gpt.py", flag: str = "", poll_s: Optional[float] = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.rank, self.world, self.store = timeout_s, rank, world, store
        self.prog, self.flag = prog, flag
        self.poll_s = poll_s if poll_s is not None else min(max(timeout_s / 10, 0.2), 5.0)
        self._main = threading.main_thread().ident
        self._what, self._seq, self._since = "start-up", 0, time.monotonic()
        self._beat = 0
        self._seen: Dict[int, tuple] = {}  # peer -> (last beat counter, local time it changed)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- main thread -----------------------------------------------------------------
    def mark(self, what: str) -> None:
        """The main thread made progress and is now doing ``what`` (e.g. ``step 7``)."""
        self._what, self._seq, self._since = what, self._seq + 1, time.monotonic()

    def start(self) -> "Watchdog":
        self.mark(self._what)
        self._publish(done=False)
        self._thread = threading.Thread(target=self._run, name="sb-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop watching. ``done``: tell the peers this rank finished (they stop
        watching it); False on an error exit, when the store may be gone with a peer
        (a failed store call prints a C++ backtrace)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if done:
            try:
                self._publish(done=True)
            except Exception:  # the store may be gone at shutdown; nothing left to watch
                pass

    # -- watchdog thread ---------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"{KEY}/rank{rank}"

    def _state(self, done: bool) -> dict:
        frame = sys._current_frames().get(self._main)
        return {"what": self._what, "age": time.monotonic() - self._since, "done": done,
                "waiting": waiting_in_comm(frame), "beat": self._beat}

    def _publish(self, done: bool) -> None:
        self._beat += 1
        if self.store is not None:
            self.store.set(self._key(self.rank), json.dumps(self._state(done)))

    def _read(self, rank: int) -> Optional[dict]:
        if not self.store.check([self._key(rank)]):
            return None
        return json.loads(self.store.get(self._key(rank)))

    def _frozen(self, rank: int, state: dict, now: float) -> bool:
        """True if ``rank``'s beat counter has not changed for longer than the timeout."""
        last = self._seen.get(rank)
        if last is None or last[0] != state["beat"]:
            self._seen[rank] = (state["beat"], now)
            return False
        return now - last[1] > self.timeout_s

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                self._publish(done=False)
                verdict = self._judge()
                if verdict is not None and self.store is not None:
                    # first verdict wins, so every rank prints the same line
                    verdict = self.store.compare_set(f"{KEY}/verdict", "", verdict).decode()
                elif self.store is not None and self.store.check([f"{KEY}/verdict"]):
                    verdict = self.store.get(f"{KEY}/verdict").decode()
                if verdict:
                    self._exit(verdict)
        except Exception:  # the store's host is gone: the collectives report that
            return

    def _judge(self) -> Optional[str]:
        """The verdict this rank can reach now, or None."""
        now = time.monotonic()
        if self.store is None:
            states = {self.rank: self._state(done=False)}
        elif self.rank == 0:
            states = {r: self._read(r) for r in range(self.world)}
        else:  # rank 0 judges everyone; the others only watch rank 0 (a frozen rank 0)
            states = {0: self._read(0)}
        frozen, stuck, waiting = [], [], []
        for r, s in sorted(states.items()):
            if s is None or s["done"]:
                continue
            if r != self.rank and self._frozen(r, s, now):
                frozen.append((r, s))
            elif s["age"] > self.timeout_s and not s["waiting"]:
                stuck.append((r, s))
            elif s["age"] > 2 * self.timeout_s:
                waiting.append((r, s))
        live = [s for s in states.values() if s is not None and not s["done"]]
        if not (frozen or stuck) and (self.rank != 0 or not waiting or len(waiting) < len(live)):
            return None
        parts = [f"{_ranks(stuck)} made no progress for {_age(stuck)} s (stuck in {_whats(stuck)})"] if stuck else []
        if frozen:
            parts.append(f"{_ranks(frozen)} stopped responding (no heartbeat for over "
                         f"{self.timeout_s:.0f} s; last in {_whats(frozen)})")
        if not parts:
            parts.append(f"{_ranks(waiting)} made no progress for {_age(waiting)} s, all waiting in "
                         f"communication (in {_whats(waiting)})")
        return "; ".join(parts)

    def _exit(self, verdict: str) -> None:
        if self.store is not None:  # the store may live in this process: stay until all read it
            try:
                self.store.add(f"{KEY}/exited", 1)
                deadline = time.monotonic() + max(3 * self.poll_s, 2.0)
                while self.store.add(f"{KEY}/exited", 0) < self.world and time.monotonic() < deadline:
                    time.sleep(self.poll_s / 4)
            except Exception:
                pass
        sys.stderr.write(f"{self.prog}: error: [rank {self.rank}] {verdict}; exiting ({self.flag})\n"
                         if self.world > 1 else f"{self.prog}: error: {verdict}; exiting ({self.flag})\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def _ranks(items: List[tuple]) -> str:
    names = [str(r) for r, _ in items]
    return f"rank {names[0]}" if len(names) == 1 else f"ranks {', '.join(names)}"


def _age(items: List[tuple]) -> str:
    return f"{min(s['age'] for _, s in items):.0f}"


def _whats(items: List[tuple]) -> str:
    seen = []
    for _, s in items:
        if s["what"] not in seen:
            seen.append(s["what"])
    return ", ".join(seen)


def start_watchdog(timeout_minutes: Optional[float], prog: str = "pretrain_gpt.py") -> Optional[Watchdog]:
    """The running watchdog of ``--step-timeout-minutes`` (None when it is off), on the
    default process group's store."""
    if not timeout_minutes:
        return None
    import torch

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    store = torch.distributed.distributed_c10d._get_default_store() if world > 1 else None
    return Watchdog(timeout_minutes * 60.0, rank, world, store, prog=prog,
                    flag=f"--step-timeout-minutes {timeout_minutes:g}").start()
