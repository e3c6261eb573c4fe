"""Child pytests under Triton's CPU interpreter, run side by side.

TRITON_INTERPRET must be set before triton is imported, so a module that tests kernels
under the interpreter re-runs itself in a child pytest with the variable set. Each such
module calls :func:`register` when it is collected; the first :func:`run` starts every
registered child at once (each is one busy core, mostly Python), so two modules cost
the longer of the two instead of their sum. Output goes to files, not pipes, so a child
never blocks on a full pipe while another is awaited; children nobody awaited are ended
at exit."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_env: Dict[str, Dict[str, str]] = {}
_procs: Dict[str, Tuple[subprocess.Popen, str]] = {}
_order: List[str] = []


def register(path: str, **extra_env: str) -> None:
    """Run ``path`` (a test module) in a child pytest with TRITON_INTERPRET=1 and ``extra_env``."""
    path = os.path.abspath(path)
    if path not in _env:
        _order.append(path)
    _env[path] = {"TRITON_INTERPRET": "1", **extra_env}


def _start(path: str) -> None:
    out = tempfile.NamedTemporaryFile("w+", prefix="interp-", suffix=".log", delete=False)
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                         env=dict(os.environ, **_env[path]), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    _procs[path] = (p, out.name)


def run(path: str, timeout: float = 900) -> Tuple[int, str]:
    """(exit status, output) of ``path``'s child pytest; starts every registered child not
    yet started."""
    path = os.path.abspath(path)
    for other in _order:
        if other not in _procs:
            _start(other)
    p, log = _procs[path]
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    with open(log, errors="replace") as fh:
        text = fh.read()
    os.unlink(log)
    _procs[path] = (p, os.devnull)
    return p.returncode, text


@atexit.register
def _end_unawaited() -> None:
    for p, log in _procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
        if log != os.devnull and os.path.exists(log):
            os.unlink(log)
