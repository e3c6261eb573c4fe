"""A run that fails safe: non-finite steps stop it, a live run's ``--save`` is not shared,
``--exit-interval`` / ``--exit-duration-in-mins`` end it cleanly, and its JSON is strict.

* :func:`check_step_finite` (``--check-for-nan-in-loss-and-grad``, Megatron-LM's default
  on): a non-finite loss or grad norm raises one line naming the iteration, before that
  iteration's evaluation or save. Checkpoints are guarded separately
  (:func:`nonfinite_parameter`, called by the save), so nothing non-finite is written
  even with ``--no-check-for-nan-in-loss-and-grad``.
* :class:`SaveDirLock`: ``<save>/.pretrain_gpt.lock`` holds the pid, host and process
  start time of the run's rank 0. A second run on the same directory is refused while
  that process lives; a lock whose process is gone (killed run) is taken over.
* :func:`strict_json`: ``json.dumps`` with non-finite floats as ``null`` (``allow_nan=False``).
* :func:`disk_full`: whether a failed write ran out of space (the checkpoint save then
  names ENOSPC and the path, whatever the serializer said).
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import socket
import time
from typing import Optional

LOCK_NAME = ".pretrain_gpt.lock"


def check_step_finite(args, iteration: int, loss: float, grad_norm: Optional[float]) -> None:
    """Raise ``ValueError`` (one line) if the step's loss or grad norm is not finite.

    ``grad_norm`` None: no norm this step (fp16 skipped an overflowing step: not an error,
    as in Megatron-LM). A no-op with ``--no-check-for-nan-in-loss-and-grad``.
    """
    if not getattr(args, "check_for_nan_in_loss_and_grad", True):
        return
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("grad norm", grad_norm))
           if value is not None and not math.isfinite(value)]
    if bad:
        raise ValueError(f"iteration {iteration}: non-finite {' and '.join(bad)}; stopped before saving "
                         "(lower --lr, or --no-check-for-nan-in-loss-and-grad to train on)")


def nonfinite_parameter(model) -> Optional[str]:
    """Name of the first parameter (over the model chunks) holding a NaN or Inf, or None."""
    import torch

    for i, chunk in enumerate(model):
        inner = chunk.module if hasattr(chunk, "module") else chunk
        for name, param in inner.named_parameters():
            if not bool(torch.isfinite(param.detach()).all()):
                return f"model{i}.{name}"
    return None


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def strict_json(obj, **kwargs) -> str:
    """``json.dumps`` that is valid JSON: NaN / Inf become ``null``."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def should_exit(args, iteration: int, started: float) -> Optional[str]:
    """Why the loop stops after ``iteration`` (``--exit-interval`` / ``--exit-duration-in-mins``),
    or None. Collective when ``--exit-duration-in-mins`` is set: every rank gets the same answer."""
    interval = getattr(args, "exit_interval", None)
    if interval and iteration % interval == 0:
        return f"--exit-interval {interval}"
    minutes = getattr(args, "exit_duration_in_mins", None)
    if minutes is None:
        return None
    import torch

    over = (time.time() - started) / 60.0 > minutes
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
        t = torch.tensor([1.0 if over else 0.0], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        over = bool(t.item())
    return f"--exit-duration-in-mins {minutes:g}" if over else None


def disk_full(e: BaseException, path: str) -> bool:
    """ENOSPC anywhere in ``e``'s chain (or in DCP's per-rank failures), or ``path``'s file
    system has no space left: serializers such as torch.save's zip writer lose the errno
    and say e.g. "unexpected pos" instead."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return True
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        todo += [x.__cause__, x.__context__]
    try:
        st = os.statvfs(path if os.path.exists(path) else os.path.dirname(path) or ".")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)



def _start_time(pid: int) -> Optional[str]:
    """Start time of process ``pid`` (clock ticks since boot, /proc), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited already


def _alive(pid: int, started: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    now = _start_time(pid)
    if os.path.isdir("/proc/self") and now is None:
        return False  # zombie, or vanished in between
    return started is None or now is None or now == started


class SaveDirLock:
    """``--save DIR`` held by one live run (see module docstring)."""

    def __init__(self, save_dir: str) -> None:
        self.path = os.path.join(save_dir, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        """Take the lock; ``ValueError`` (one line) if a live run holds it. A directory the
        lock cannot be written to is left to the checkpoint save to report (same cause)."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError:
            return
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._read()
                if owner is not None and self._live(owner):
                    raise ValueError(f"--save {os.path.dirname(self.path)} is in use by a running "
                                     f"pretrain_gpt.py (pid {owner.get('pid')} on {owner.get('host')}, since "
                                     f"{owner.get('since')}); use another --save, or stop that run "
                                     f"(remove {self.path} if it is gone)")
                try:  # stale (its run was killed): replace it and try again
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            except OSError:
                return
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
            self.held = True
            atexit.register(self.release)
            return
        raise ValueError(f"--save {os.path.dirname(self.path)}: could not take {self.path} (another run "
                         "is starting there)")

    def _read(self) -> Optional[dict]:
        try:
            with open(self.path) as f:
                doc = json.loads(f.read() or "null")
        except (OSError, ValueError):
            return None  # unreadable or half-written: treat as stale
        return doc if isinstance(doc, dict) else None

    @staticmethod
    def _live(owner: dict) -> bool:
        if owner.get("host") != socket.gethostname():
            return True  # another machine: its process cannot be checked from here
        pid = owner.get("pid")
        return isinstance(pid, int) and pid != os.getpid() and _alive(pid, owner.get("started"))

    def release(self) -> None:
        """Remove the lock if this process holds it (idempotent)."""
        if not self.held:
            return
        self.held = False
        owner = self._read()
        if owner is not None and owner.get("pid") == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
