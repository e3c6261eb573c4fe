"""Child pytests under Triton's CPU interpreter, run side by side.

TRITON_INTERPRET must be set before triton is imported, so a module that tests kernels
under the interpreter re-runs itself in a child pytest with the variable set. Each such
module calls :func:`register` when it is collected; the first :func:`run` starts every
registered child at once (each is one busy core, mostly Python), so two modules cost
the longer of the two instead of their sum; under pytest-xdist each worker starts only its
own module's child, and the workers run the modules side by side. Output goes to files,
not pipes, so a child never blocks on a full pipe while another is awaited; children
nobody awaited are ended at exit."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from typing import Dict, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_env: Dict[str, Dict[str, str]] = {}  # registered module -> its child's extra environment
_procs: Dict[str, subprocess.Popen] = {}
_logs: Dict[str, str] = {}  # started module -> its output file, until read


def register(path: str, **extra_env: str) -> None:
    """Run ``path`` (a test module) in a child pytest with TRITON_INTERPRET=1 and ``extra_env``."""
    _env[os.path.abspath(path)] = {"TRITON_INTERPRET": "1", **extra_env}


def _child_env(path: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    return dict(env, **_env[path])


def _start(path: str) -> None:
    fd, _logs[path] = tempfile.mkstemp(prefix="interp-", suffix=".log")
    with os.fdopen(fd, "w") as out:
        _procs[path] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                                        env=_child_env(path), cwd=REPO, stdout=out,
                                        stderr=subprocess.STDOUT)


def run(path: str, timeout: float = 900) -> Tuple[int, str]:
    """(exit status, output) of ``path``'s child pytest; starts every registered child not
    yet started."""
    path = os.path.abspath(path)
    # Under pytest-xdist each worker takes whole files, so another worker runs the other
    # modules' children: start only this one.
    for other in ([path] if os.environ.get("PYTEST_XDIST_WORKER") else _env):
        if other not in _procs:
            _start(other)
    p = _procs[path]
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    log = _logs.pop(path)
    with open(log, errors="replace") as fh:
        text = fh.read()
    os.unlink(log)
    return p.returncode, text


@atexit.register
def _end_unawaited() -> None:
    for p in _procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in _logs.values():
        os.unlink(log)
